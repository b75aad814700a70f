"""ONNX export: every stage of the pipeline as its own static-shape graph per bucket, plus a
manifest that says what each graph is, what it was made from, and how to bind it.

Stage graphs: the stage modules of engines/stages.py (their input and output names and shapes
are listed there), exported with example inputs of each bucket's exact shape; plus, when the
model folder has one, the view selector: ids, pad_mask [1, L] -> logits [1, cameras]. Attention
over the old cache and the new rows is one softmax written as grouped matmuls (no `enable_gqa`,
which does not export).

The batched decode step (`decoder_batch`, when the buckets have batch sizes) is one graph with a
dynamic batch dimension B in [2, largest batch bucket], not one graph per bucket: ONNX Runtime
then opens one session (its weights loaded once) bound at each batch bucket, and TensorRT builds
one engine (weights once) with an optimization profile per bucket (tensorrt_engine.py), where
per-bucket graphs would hold a 2B decoder's weights once per bucket in memory. Every backend
still runs it at fixed bucket shapes on bound buffers; the manifest lists the buckets it was
exported and verified for, and a runtime with fewer KV regions binds it at its own size.

Weights are stored once per stage (`<stage>.weights`, ONNX external data) and shared by the
stage's bucket graphs, so more buckets cost graph bytes, not weight bytes.
"""

from __future__ import annotations

import hashlib
import importlib.util
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..engines.bound_stages import kv_inputs
from ..engines.buckets import Buckets, check_fits, default_buckets
from ..engines.bundle import FORMAT_VERSION, MANIFEST, checkpoint_hash, write_manifest
from ..engines.onnxruntime_engine import onnxruntime_engines
from ..engines.stages import BatchDecoderStage, DecoderStage, DraftStage, HeadStage, PrefillStage, VisionStage
from ..engines.torch_engine import torch_engines
from ..errors import LiteVLMError
from ..models.kv_cache import QuantizedKV, random_like
from ..options import BackendName
from ..stages.view_selector import load_view_selector
from ..weights.draft_head import load_draft_head
from ..weights.integrity import sha256_file

# onnx is imported where graphs are written: it is heavy, and the rest of this module (graph specs, comparing
# outputs) runs without it.

TORCH_TO_ONNX_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                       torch.int64: "int64", torch.bool: "bool", torch.int32: "int32", torch.uint8: "uint8",
                       torch.int8: "int8"}


# ----------------------------------------------------------------------------------- graph specs
@dataclass
class GraphSpec:
    stage: str
    bucket: int
    module: nn.Module
    inputs: dict[str, torch.Tensor]
    outputs: list[str]
    # input name -> {axis: name} of its dynamic axes (the batched step's B), with the sizes the
    # graph is exported for (`buckets`); None: every shape static, the one bucket
    dynamic: dict[str, dict[int, str]] | None = None
    buckets: tuple[int, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.stage}_{self.bucket}"


def stage_specs(rt, buckets: Buckets) -> list[GraphSpec]:
    """One GraphSpec per stage and bucket, with example inputs of the exact bound shapes."""
    cfg, a = rt.cfg, rt.arena
    dtype, dev = rt.dtype, rt.device
    s, d = cfg.force_image_size, cfg.llm.hidden_size
    vision = VisionStage(rt.model, rt.pos_embed).eval()
    decoder = DecoderStage(rt.lm).eval()
    prefill = PrefillStage(rt.lm).eval()
    head = HeadStage(rt.lm).eval()
    specs = []
    for n in buckets.vision:
        specs.append(GraphSpec("vision", n, vision, {"pixels": torch.randn(n, 3, s, s, dtype=dtype, device=dev)},
                               ["visual"]))
    for t in buckets.prefill:
        specs.append(GraphSpec("prefill", t, prefill, {
            "embeds": torch.randn(t, d, dtype=dtype, device=dev),
            "positions": torch.arange(t, device=dev),
            "mask_new": torch.ones(t, t, dtype=torch.bool, device=dev).tril_(),
        }, ["hidden", "k_new", "v_new"]))
    for t in buckets.step:
        specs.append(
            GraphSpec(
                "decoder",
                t,
                decoder,
                {
                    "embeds": torch.randn(t, d, dtype=dtype, device=dev),
                    "positions": torch.arange(t, device=dev),
                    "mask_cache": example_mask_cache(t, a.max_len, dev),
                    "mask_new": torch.ones(t, t, dtype=torch.bool, device=dev).tril_(),
                    **kv_inputs(
                        ("k_cache", random_like(a.k_cache, dtype=dtype)),
                        ("v_cache", random_like(a.v_cache, dtype=dtype)),
                    ),
                },
                ["hidden", "k_new", "v_new"],
            )
        )
    if buckets.batch:
        specs.append(batch_spec(rt, buckets.batch))
    for t in buckets.head:
        specs.append(GraphSpec("head", t, head, {"hidden": torch.randn(t, d, dtype=dtype, device=dev)}, ["logits"]))
    return specs


def batch_spec(rt, sizes: tuple[int, ...]) -> GraphSpec:
    """The batched decode step, traced at its largest bucket with B dynamic; example rows of
    different lengths (row b sees the first 4 + b columns of region b)."""
    a, dev, dt = rt.arena, rt.device, rt.dtype
    b, d = max(sizes), rt.cfg.llm.hidden_size
    regions = (b, *a.k_regions.shape[1:])
    mask_cache = torch.zeros(b, a.max_len, dtype=torch.bool, device=dev)
    for row in range(b):
        mask_cache[row, :4 + row] = True
    inputs = {"embeds": torch.randn(b, d, dtype=dt, device=dev), "positions": torch.arange(b, device=dev) + 4,
              "mask_cache": mask_cache, "mask_new": torch.eye(b, dtype=torch.bool, device=dev),
              **kv_inputs(("k_regions", random_like(a.k_regions, regions, dt)),
                          ("v_regions", random_like(a.v_regions, regions, dt)))}
    dynamic = {name: {0: "batch"} for name in inputs}
    dynamic["mask_new"] = {0: "batch", 1: "batch"}
    return GraphSpec("decoder_batch", b, BatchDecoderStage(rt.lm).eval(), inputs, ["hidden", "k_new", "v_new"],
                     dynamic=dynamic, buckets=tuple(sizes))


def example_mask_cache(rows: int, columns: int, device) -> torch.Tensor:
    mask = torch.zeros(rows, columns, dtype=torch.bool, device=device)
    mask[:, :4] = True
    return mask


def draft_specs(rt, buckets: Buckets) -> tuple[list[GraphSpec], str]:
    """The EAGLE-2 draft step per decoder bucket, when the runtime decodes with EAGLE or the model
    folder carries a draft head (`eagle/`)."""
    draft = rt.draft
    if draft is None:
        folder = Path(rt.model_dir) / "eagle" if rt.model_dir else None
        if folder is None or not (folder / "model.safetensors").is_file():
            return [], "no eagle/model.safetensors in the model folder (train one: litevlm train eagle)"

        draft = load_draft_head(folder, rt.cfg.llm, rt.lm.rope, rt.dtype).to(rt.device)
    cfg, a, dev, dt = rt.cfg.llm, rt.arena, rt.device, rt.dtype
    stage = DraftStage(draft).eval()
    cache_shape = (1, cfg.num_key_value_heads, a.max_len, cfg.head_dim)
    specs = []
    for t in buckets.decoder():
        specs.append(GraphSpec("eagle_draft", t, stage, {
            "token_embeds": torch.randn(t, cfg.hidden_size, dtype=dt, device=dev),
            "features": torch.randn(t, cfg.hidden_size, dtype=dt, device=dev),
            "positions": torch.arange(t, device=dev),
            "mask_cache": example_mask_cache(t, a.max_len, dev),
            "mask_new": torch.ones(t, t, dtype=torch.bool, device=dev).tril_(),
            "k_cache": torch.randn(cache_shape, dtype=dt, device=dev),
            "v_cache": torch.randn(cache_shape, dtype=dt, device=dev),
        }, ["features_out", "k_new", "v_new"]))
    return specs, "exported"


def view_selector_spec(model_dir: Path) -> tuple[GraphSpec | None, str]:
    """The view selector graph when the model folder carries one (`view_selector/`)."""
    folder = model_dir / "view_selector"
    if not (folder / "config.json").is_file():
        return None, f"no {folder.name}/config.json in the model folder"

    sel = load_view_selector(folder)
    length = sel.cfg.max_len
    ids = torch.zeros(1, length, dtype=torch.long)
    pad = torch.ones(1, length, dtype=torch.bool)
    pad[0, :4] = False
    return GraphSpec("view_selector", length, sel.model.eval(), {"ids": ids, "pad_mask": pad}, ["logits"]), "exported"


# ------------------------------------------------------------------------------------ export
class SharedWeights:
    """Moves each graph's large initializers into one external-data file per stage, storing a
    tensor once however many bucket graphs use it (matched by name and content)."""

    def __init__(self, folder: Path, stage: str):
        self.location = f"{stage}.weights"
        self.path = folder / self.location
        self.path.write_bytes(b"")
        self.index: dict[tuple[str, str], tuple[int, int]] = {}

    def externalize(self, model) -> None:
        from onnx import TensorProto
        from onnx.external_data_helper import set_external_data

        for tensor in model.graph.initializer:
            if not tensor.HasField("raw_data") or len(tensor.raw_data) < 1024:
                continue
            raw = tensor.raw_data
            key = (tensor.name, hashlib.sha1(raw).hexdigest())
            if key not in self.index:
                with open(self.path, "ab") as f:
                    offset = f.tell()
                    f.write(raw)
                self.index[key] = (offset, len(raw))
            offset, length = self.index[key]
            set_external_data(tensor, self.location, offset, length)
            tensor.data_location = TensorProto.EXTERNAL
            tensor.ClearField("raw_data")


def export_graph(spec: GraphSpec, path: Path, weights: SharedWeights) -> dict:
    import onnx

    tmp = path.with_suffix(".tmp.onnx")
    names = list(spec.inputs)
    dynamic_shapes = None
    if spec.dynamic:
        dim = torch.export.Dim("batch", min=2, max=max(spec.buckets))
        dynamic_shapes = tuple({axis: dim for axis in spec.dynamic.get(n, {})} or None for n in names)
    with torch.no_grad():
        # optimize=False: onnxscript's graph optimizer (0.7.2) miscompiles the prefill graph
        # (hidden states off by 80% relative; measured, see tests/export/test_export.py). ONNX Runtime and
        # TensorRT optimize the graph themselves when they load it.
        program = torch.onnx.export(spec.module, tuple(spec.inputs.values()), dynamo=True,
                                    input_names=names, output_names=spec.outputs, dynamic_shapes=dynamic_shapes,
                                    optimize=False, verbose=False, external_data=False)
        if program is None:
            raise LiteVLMError(f"{spec.name}: torch.onnx.export returned nothing")
        program.save(str(tmp), external_data=True)
        outputs = spec.module(*spec.inputs.values())
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    model = onnx.load(str(tmp), load_external_data=True)
    for f in tmp.parent.glob(tmp.name + "*"):
        f.unlink()
    weights.externalize(model)
    onnx.save(model, str(path))
    graph_inputs = [i.name for i in model.graph.input]
    graph_outputs = [o.name for o in model.graph.output]
    if graph_inputs != names or graph_outputs != spec.outputs:
        raise LiteVLMError(f"{spec.name}: exported names {graph_inputs} -> {graph_outputs}, "
                           f"expected {names} -> {spec.outputs}")
    entry = {
        "stage": spec.stage, "bucket": spec.bucket, "file": path.name, "weights": weights.location,
        "inputs": [{"name": n, "shape": graph_shape(t.shape, spec.dynamic and spec.dynamic.get(n)),
                    "dtype": TORCH_TO_ONNX_DTYPE[t.dtype]} for n, t in spec.inputs.items()],
        "outputs": [{"name": n, "shape": graph_shape(t.shape, spec.dynamic and BATCH_OUTPUT_AXES.get(n)),
                     "dtype": TORCH_TO_ONNX_DTYPE[t.dtype]} for n, t in zip(spec.outputs, outputs)],
    }
    if spec.dynamic:
        entry["buckets"] = list(spec.buckets)
    return entry


def values(cache):
    """A copy of cache rows (a quantized cache's codes and scales)."""
    return cache.clone()


STORED_CODES_TARGET = 1e-3


def stored_error(got, want) -> tuple[float, float]:
    """(error, target) of stored cache rows: float rows, max |got - want| / max |want| (target 1e-4,
    the caller's); a quantized cache's rows, the fraction of codes that differ, as long as none by
    more than one step (float rows equal to 1e-7 may straddle a rounding boundary: one step), else 1."""
    if not isinstance(want, QuantizedKV):
        return float((got.float() - want.float()).abs().max() / want.float().abs().max()), 0.0
    step = (got.codes.to(torch.int16) - want.codes.to(torch.int16)).abs()
    if want.kind == "fp8":           # adjacent E4M3 values of one sign are adjacent bit patterns
        step = torch.where((got.codes ^ want.codes) >= 128, 255, step)
    differ = float((step > 0).float().mean())
    return (differ if int(step.max()) <= 1 else 1.0), STORED_CODES_TARGET


def compared(got, want, rel, row: dict) -> dict:
    """A verification row: rel_error (and, for a quantized cache's stored codes, its own target)."""
    if isinstance(want, QuantizedKV):
        error, target = stored_error(got, want)
        return dict(row, output=row["output"] + " (codes differing)", rel_error=error, target=target)
    return dict(row, rel_error=rel(got, want))


# The batched step's outputs: hidden [B, D], k_new / v_new [layers, Hkv, B, hd].
BATCH_OUTPUT_AXES = {"hidden": {0: "batch"}, "k_new": {2: "batch"}, "v_new": {2: "batch"}}


def graph_shape(shape, axes: dict[int, str] | None) -> list:
    """A tensor's shape in the manifest: its dynamic axes by name ("batch"), the rest as sizes."""
    axes = axes or {}
    return [axes.get(i, size) for i, size in enumerate(shape)]


OPTIONAL_STAGES = {
    # stage -> module that implements it (written by other engineers); exported when present.
    "token_selector": "litevlm_runtime.stages.token_selector",
}


def optional_stage_status() -> dict[str, str]:
    status = {}
    for stage, module in OPTIONAL_STAGES.items():
        found = importlib.util.find_spec(module) is not None
        status[stage] = (f"not exported: {module} exists but has no static-shape export form yet (runs in PyTorch)"
                         if found else f"not present ({module} does not exist in this checkout)")
    return status


# The batched step has the decode step's parameters under the same names: one weights file.
WEIGHT_GROUPS = {"decoder_batch": "decoder"}


def export_bundle(rt, out: Path, buckets: Buckets | None = None,
                  progress: Callable[[str], None] = print) -> dict:
    """Export the runtime's stages into the folder `out`; return the manifest (also written there)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    buckets = buckets or default_buckets(rt.arena)
    check_fits(buckets, rt.arena)
    if buckets.cache:
        raise LiteVLMError(f"--buckets cache={','.join(map(str, buckets.cache))}: cache-column buckets are "
                           "torch-compile's (backend.buckets); an exported step graph reads the whole static cache")
    model_dir = rt.model_dir
    specs = stage_specs(rt, buckets)
    not_present = optional_stage_status()
    drafts, why = draft_specs(rt, buckets)
    specs += drafts
    if drafts:
        not_present.pop("eagle_draft", None)
    else:
        not_present["eagle_draft"] = why
    if model_dir is not None:
        vs, why = view_selector_spec(Path(model_dir))
        if vs is not None:
            specs.insert(0, vs)
        else:
            not_present["view_selector"] = why
    weights: dict[str, SharedWeights] = {}
    graphs = []
    t_all = time.perf_counter()
    for i, spec in enumerate(specs):
        t0 = time.perf_counter()
        group = WEIGHT_GROUPS.get(spec.stage, spec.stage)
        if group not in weights:
            weights[group] = SharedWeights(out, group)
        entry = export_graph(spec, out / f"{spec.name}.onnx", weights[group])
        graphs.append(entry)
        progress(f"[{i + 1}/{len(specs)}] {spec.name:<18} {time.perf_counter() - t0:6.1f} s")
    for entry in graphs:
        entry["sha256"] = sha256_file(out / entry["file"])
    a = rt.arena
    manifest = {
        "format": FORMAT_VERSION,
        "created_by": "litevlm export",
        "torch": torch.__version__,
        "model": {
            "name": rt.name,
            "dir": str(model_dir) if model_dir else None,
            "checkpoint_sha256": checkpoint_hash(Path(model_dir)) if model_dir else None,
            "architecture": rt.cfg.llm.architecture,
        },
        "dtype": rt.options.dtype,
        "arena": {"max_len": a.max_len, "max_prompt": a.max_prompt, "max_query": a.max_query,
                  "kv_dtype": a.limits.kv_dtype,
                  "tiles_per_camera": a.limits.tiles_per_camera, "cameras": a.limits.cameras,
                  "max_tiles": a.limits.max_tiles(), "tree_tokens": a.limits.tree_tokens},
        "buckets": buckets.to_dict(),
        "graphs": graphs,
        "weights": {w.location: sha256_file(w.path) for w in weights.values()},
        "not_present": not_present,
        "engines": {},
    }
    write_manifest(out, manifest)
    progress(f"exported {len(graphs)} graphs in {time.perf_counter() - t_all:.1f} s -> {out / MANIFEST}")
    return manifest


# ------------------------------------------------------------------------------------ verify
@torch.no_grad()
def verify_bundle(rt, bundle: Path, seed: int = 0) -> list[dict]:
    """Every bucket of every stage through the bundle's graphs (ONNX Runtime) and through the
    PyTorch stage, on the same random inputs; returns the relative errors
    max |onnx - torch| / max |torch| of each output (decoder: hidden states and the stored K/V;
    the batched step at each batch bucket the runtime binds, and once with a padding row)."""


    a = rt.arena
    ref = torch_engines(rt)
    ort = onnxruntime_engines(replace(rt, options=replace(rt.options, backend=replace(
        rt.options.backend, name=BackendName.ONNXRUNTIME, bundle=str(bundle)))))
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(rt.dtype)
    rel = lambda got, want: float((got.float() - want.float()).abs().max() / want.float().abs().max())
    rows = []
    s, d = rt.cfg.force_image_size, rt.cfg.llm.hidden_size
    for n in ort.vision.sizes:
        pixels = rand(n, 3, s, s)
        want = ref.vision.run(pixels=pixels).clone()
        rows.append(
            {"stage": "vision", "bucket": n, "output": "visual", "rel_error": rel(ort.vision.run(pixels=pixels), want)}
        )
    calls = [("prefill", t, 0) for t in ort.decoder.prefill_sizes]       # a prompt: no history
    calls += [("decoder", t, min(16, a.max_len - t)) for t in ort.decoder.sizes]   # steps over the cache
    for stage, t, history in calls:
        slots = torch.arange(history, history + t)
        mask_cache = torch.ones(t, history, dtype=torch.bool)
        mask_new = torch.ones(t, t, dtype=torch.bool).tril_()
        embeds, positions = rand(t, d), torch.arange(history, history + t)
        cache = (rand(*a.k_cache.shape), rand(*a.v_cache.shape))
        out = {}
        for name, engines in (("torch", ref), ("onnx", ort)):
            a.k_cache.copy_(cache[0])
            a.v_cache.copy_(cache[1])
            if stage == "prefill":
                hidden = engines.decoder.prefill(embeds, positions, mask_new).clone()
            else:
                hidden = engines.decoder.step(embeds, positions, slots, mask_cache, mask_new).clone()
            out[name] = (hidden, values(a.k_cache[:, :, slots]), values(a.v_cache[:, :, slots]))
        for i, output in enumerate(("hidden", "k rows", "v rows")):
            rows.append(compared(out["onnx"][i], out["torch"][i], rel, {"stage": stage, "bucket": t, "output": output}))
    rows += verify_batched(rt, ref, ort, rand, rel)
    for t in ort.head.sizes:
        hidden = rand(t, d)
        want = ref.head.run(hidden=hidden).clone()
        rows.append(
            {"stage": "head", "bucket": t, "output": "logits", "rel_error": rel(ort.head.run(hidden=hidden), want)}
        )
    return rows


def verify_batched(rt, ref, ort, rand, rel) -> list[dict]:
    """The batched step (ONNX Runtime) against eager torch's (TorchBatchDecoder) over random KV
    regions: rows of different histories, each over its own region; at every batch bucket, and
    one row short of the largest (a padding row that must see only itself and store nothing)."""
    if ort.batch is None or ref.batch is None:
        return []
    a, d = rt.arena, rt.cfg.llm.hidden_size
    sizes = ort.batch.sizes
    calls = [(b, b) for b in sizes] + ([(max(sizes), max(sizes) - 1)] if max(sizes) > 2 else [])
    rows = []
    for bucket, t in calls:
        history = torch.tensor([16 + 5 * r for r in range(t)])
        live = int(history.max())
        mask_cache = torch.arange(live)[None, :] < history[:, None]           # row r sees its own history only
        embeds, positions, slots = rand(t, d), history + 3, history
        mask_new = torch.eye(t, dtype=torch.bool)
        regions = (rand(*a.k_regions.shape), rand(*a.v_regions.shape))
        out = {}
        for name, engines in (("torch", ref), ("onnx", ort)):
            a.k_regions.copy_(regions[0])
            a.v_regions.copy_(regions[1])
            hidden = engines.batch.step(embeds, positions, slots, mask_cache, mask_new).clone()
            out[name] = (hidden, values(a.k_regions), values(a.v_regions))
        for i, output in enumerate(("hidden", "k regions", "v regions")):
            rows.append(compared(out["onnx"][i], out["torch"][i], rel,
                                 {"stage": "decoder_batch", "bucket": bucket, "rows": t, "output": output}))
    return rows
