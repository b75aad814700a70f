"""ONNX export: every stage of the pipeline as its own static-shape graph per bucket, plus a
manifest that says what each graph is, what it was made from, and how to bind it.

Stage graphs (names are the graphs' input/output names; S = max_len of the arena's KV cache):

  vision      pixels [n, 3, s, s]                                  -> visual [n, tokens_per_tile, D]
  prefill     embeds [T, D], positions [T], mask_new [T, T]    -> hidden [T, D],
                                                                      k_new, v_new [layers, kv, T, hd]
  decoder     embeds [T, D], positions [T], mask_cache [T, S],
              mask_new [T, T], k_cache, v_cache [layers, kv, S, hd] -> hidden [T, D],
                                                                      k_new, v_new [layers, kv, T, hd]
  head        hidden [T, D]                                        -> logits [T, V]
  eagle_draft (when the model has a draft head) token_embeds, features [T, D], positions, the two
              masks, k_cache, v_cache [1, kv, S, hd]       -> features_out [T, D], k_new, v_new
  view_selector (when the model folder has one) ids, pad_mask [1, L] -> logits [1, cameras]

The decoder graphs are the decoder's one forward (models/decoder.py), which every backend runs:
the cache is an explicit input and the new K/V rows are explicit outputs (the engine stores them
at their slots), so the graph has no in-place update and no aliasing, which both ONNX Runtime and
TensorRT need; attention over the old cache (`mask_cache`) and the new rows (`mask_new`) is one
softmax written as grouped matmuls (no `enable_gqa`, which does not export).

Weights are stored once per stage (`<stage>.weights`, ONNX external data) and shared by the
stage's bucket graphs, so more buckets cost graph bytes, not weight bytes.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..engines.buckets import Buckets, check_fits, default_buckets
from ..errors import LiteVLMError
from ..weights.integrity import file_digest, sha256_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
TORCH_TO_ONNX_DTYPE = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
                       torch.int64: "int64", torch.bool: "bool", torch.int32: "int32", torch.uint8: "uint8"}


# ------------------------------------------------------------------------------------------ stages
class VisionStage(nn.Module):
    """pixels -> visual tokens (InternViT + pixel shuffle + mlp1), position table baked in."""

    def __init__(self, model, pos_embed: torch.Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("pos_embed", pos_embed.detach().clone(), persistent=False)

    def forward(self, pixels):
        return self.model.encode_images(pixels, self.pos_embed)


class DecoderStage(nn.Module):
    """The decoder over the static cache: cache in, new rows out (the decoder's own forward)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, embeds, positions, mask_cache, mask_new, k_cache, v_cache):
        return self.lm(embeds, positions, mask_new, k_cache, v_cache, mask_cache)


class PrefillStage(nn.Module):
    """The decoder over a prompt that starts an empty cache: no cache input, the prompt's K/V
    rows as outputs (attention over T x T rather than T x (max_len + T))."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, embeds, positions, mask_new):
        return self.lm(embeds, positions, mask_new)


class DraftStage(nn.Module):
    """One EAGLE-2 draft step (models/eagle.py DraftHead): its own one-layer KV cache
    [1, Hkv, S, D] as input, the new rows as outputs. Its logits come from the head graph."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, token_embeds, features, positions, mask_cache, mask_new, k_cache, v_cache):
        return self.draft(token_embeds, features, positions, mask_new, k_cache, v_cache, mask_cache)


class HeadStage(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.head = lm.head

    def forward(self, hidden):
        return self.head(hidden)


# ----------------------------------------------------------------------------------- graph specs
@dataclass
class GraphSpec:
    stage: str
    bucket: int
    module: nn.Module
    inputs: dict[str, torch.Tensor]
    outputs: list[str]

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
        specs.append(GraphSpec("decoder", t, decoder, {
            "embeds": torch.randn(t, d, dtype=dtype, device=dev),
            "positions": torch.arange(t, device=dev),
            "mask_cache": example_mask_cache(t, a.max_len, dev),
            "mask_new": torch.ones(t, t, dtype=torch.bool, device=dev).tril_(),
            "k_cache": torch.randn_like(a.k_cache),
            "v_cache": torch.randn_like(a.v_cache),
        }, ["hidden", "k_new", "v_new"]))
    for t in buckets.head:
        specs.append(GraphSpec("head", t, head, {"hidden": torch.randn(t, d, dtype=dtype, device=dev)}, ["logits"]))
    return specs


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
        from ..models.eagle import load_draft_head

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
    from ..stages.view_selector import load_view_selector

    sel = load_view_selector(folder)
    length = sel.cfg.max_len
    ids = torch.zeros(1, length, dtype=torch.long)
    pad = torch.ones(1, length, dtype=torch.bool)
    pad[0, :4] = False
    return GraphSpec("view_selector", length, sel.model.eval(), {"ids": ids, "pad_mask": pad}, ["logits"]), "exported"


# ------------------------------------------------------------------------------------ hashing
def checkpoint_hash(model_dir: Path) -> str:
    """sha256 over config.json and every *.safetensors file (names and contents, sorted)."""
    h = hashlib.sha256()
    files = [model_dir / "config.json"] + sorted(model_dir.glob("*.safetensors"))
    for f in files:
        if f.is_file():
            h.update(f.name.encode())
            h.update(file_digest(f).encode())   # cached per file version: a bundle load does not rehash 4 GB
    return h.hexdigest()


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
        from onnx.external_data_helper import set_external_data
        from onnx import TensorProto

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
    with torch.no_grad():
        # optimize=False: onnxscript's graph optimizer (0.7.2) miscompiles the prefill graph
        # (hidden states off by 80% relative; measured, see tests/test_export.py). ONNX Runtime and
        # TensorRT optimize the graph themselves when they load it.
        program = torch.onnx.export(spec.module, tuple(spec.inputs.values()), dynamo=True,
                                    input_names=names, output_names=spec.outputs,
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
    return {
        "stage": spec.stage, "bucket": spec.bucket, "file": path.name, "weights": weights.location,
        "inputs": [{"name": n, "shape": list(t.shape), "dtype": TORCH_TO_ONNX_DTYPE[t.dtype]}
                   for n, t in spec.inputs.items()],
        "outputs": [{"name": n, "shape": list(t.shape), "dtype": TORCH_TO_ONNX_DTYPE[t.dtype]}
                    for n, t in zip(spec.outputs, outputs)],
    }


OPTIONAL_STAGES = {
    # stage -> module that implements it (written by other engineers); exported when present.
    "token_selector": "litevlm_runtime.stages.token_selector",
}


def optional_stage_status() -> dict[str, str]:
    import importlib.util

    status = {}
    for stage, module in OPTIONAL_STAGES.items():
        found = importlib.util.find_spec(module) is not None
        status[stage] = (f"not exported: {module} exists but has no static-shape export form yet (runs in PyTorch)"
                         if found else f"not present ({module} does not exist in this checkout)")
    return status


def export_bundle(rt, out: Path, buckets: Buckets | None = None,
                  progress: Callable[[str], None] = print) -> dict:
    """Export the runtime's stages into the folder `out`; return the manifest (also written there)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    buckets = buckets or default_buckets(rt.arena)
    check_fits(buckets, rt.arena)
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
        if spec.stage not in weights:
            weights[spec.stage] = SharedWeights(out, spec.stage)
        entry = export_graph(spec, out / f"{spec.name}.onnx", weights[spec.stage])
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


def write_manifest(bundle: Path, manifest: dict) -> None:
    tmp = Path(bundle) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(Path(bundle) / MANIFEST)


def read_manifest(bundle: Path) -> dict:
    path = Path(bundle) / MANIFEST
    if not path.is_file():
        raise LiteVLMError(f"{bundle}: no {MANIFEST} (not an export bundle; run `litevlm export` first)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LiteVLMError(f"{path}: not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise LiteVLMError(f"{path}: bundle format {manifest.get('format')!r}, this runtime reads {FORMAT_VERSION}")
    return manifest


def check_bundle_matches(manifest: dict, rt, bundle: Path) -> None:
    """The bundle must have been exported for this runtime's arena, dtype and checkpoint."""
    a = rt.arena
    want = {"max_len": a.max_len, "max_tiles": a.limits.max_tiles(), "max_query": a.max_query}
    have = manifest["arena"]
    for key, value in want.items():
        if have.get(key) != value:
            raise LiteVLMError(f"{bundle}: exported for arena {key}={have.get(key)}, this pipeline has {value} "
                               f"(re-export with the same --tiles-per-camera/--max-new-tokens)")
    if manifest["dtype"] != rt.options.dtype:
        raise LiteVLMError(f"{bundle}: exported in {manifest['dtype']}, pipeline runs {rt.options.dtype}")
    model_dir = rt.model_dir
    ck = manifest["model"].get("checkpoint_sha256")
    if model_dir is not None and ck and checkpoint_hash(Path(model_dir)) != ck:
        raise LiteVLMError(f"{bundle}: exported from a different checkpoint than {model_dir} (hash mismatch)")


def verify_files(manifest: dict, bundle: Path) -> None:
    """Every graph and weights file listed must be there with the recorded sha256."""
    files = {g["file"]: g["sha256"] for g in manifest["graphs"]} | dict(manifest["weights"])
    for name, digest in files.items():
        path = Path(bundle) / name
        if not path.is_file():
            raise LiteVLMError(f"{bundle}: missing {name}")
        if sha256_file(path) != digest:
            raise LiteVLMError(f"{bundle}: {name} does not match its sha256 in {MANIFEST} (modified or corrupt)")


def graphs_of(manifest: dict, stage: str) -> dict[int, dict]:
    return {g["bucket"]: g for g in manifest["graphs"] if g["stage"] == stage}


# ------------------------------------------------------------------------------------ verify
@torch.no_grad()
def verify_bundle(rt, bundle: Path, seed: int = 0) -> list[dict]:
    """Every bucket of every stage through the bundle's graphs (ONNX Runtime) and through the
    PyTorch stage, on the same random inputs; returns the relative errors
    max |onnx - torch| / max |torch| of each output (decoder: hidden states and the stored K/V)."""
    from dataclasses import replace

    from ..engines.onnxruntime_engine import onnxruntime_engines
    from ..engines.torch_engine import torch_engines
    from ..options import BackendName

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
        rows.append({"stage": "vision", "bucket": n, "output": "visual", "rel_error": rel(ort.vision.run(pixels=pixels), want)})
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
            out[name] = (hidden, a.k_cache[:, :, slots].clone(), a.v_cache[:, :, slots].clone())
        for i, output in enumerate(("hidden", "k rows", "v rows")):
            rows.append({"stage": stage, "bucket": t, "output": output, "rel_error": rel(out["onnx"][i], out["torch"][i])})
    for t in ort.head.sizes:
        hidden = rand(t, d)
        want = ref.head.run(hidden=hidden).clone()
        rows.append({"stage": "head", "bucket": t, "output": "logits", "rel_error": rel(ort.head.run(hidden=hidden), want)})
    return rows
