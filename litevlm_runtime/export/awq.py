"""`litevlm quantize`: a model's decoder weights quantized once and stored (safetensors + manifest,
weights/quantize.py's format), for `backend.weights int4` (AWQ) to load; int4-rtn and int8 can be
stored the same way (they also quantize at load).

AWQ needs the activations each linear layer sees in real use: calibration questions (a DriveLM
layout QA.json with its frames, or a rosbag2: the same readers and the same seeded split as
`litevlm calibrate`, export/calibration/traffic.py) are answered by the float pipeline, and a forward
pre-hook on every decoder linear keeps a uniform reservoir sample of the rows it multiplies
(prompt rows and decode-step rows alike), at most `rows` per layer. Each layer is then quantized
by weights/quantize.awq_quantize against its own rows. A tied LM head (InternVL3/3.5: the
embedding) is quantized round-to-nearest: it also serves the embedding lookup, which its output
error on head rows would not see.

Why a command of its own and not `calibrate --precision int4`: calibrate writes an ONNX bundle
through ModelOpt for ONNX Runtime/TensorRT; these are weights for the PyTorch engines of a model
folder, read at load. The TensorRT INT4 AWQ export takes the same stored weights (one quantizer,
two executors).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..errors import InputError
from ..options import PipelineOptions
from ..pipeline.pipeline import Pipeline
from ..weights.integrity import read_manifest
from ..weights.linear_forms import QUANTIZED_DIR, decoder_linears, module_names
from ..weights.quantize import (
    FORMAT,
    GROUP_SIZE,
    KINDS,
    awq_quantize,
    check_group,
    quantize_int4,
    quantize_int8,
    save_quantized,
)
from .calibration.plan import CalibrationPlan, data_kind
from .calibration.traffic import answer_queries, load_queries, split_queries


class RowReservoir:
    """A uniform sample of at most `size` rows [K] out of every row a layer multiplied (Algorithm R)."""

    def __init__(self, size: int, rng: random.Random):
        self.size, self.rng, self.seen = size, rng, 0
        self.rows: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        for row in x.reshape(-1, x.shape[-1]).detach().float():
            self.seen += 1
            if len(self.rows) < self.size:
                self.rows.append(row.clone())
            else:
                j = self.rng.randrange(self.seen)
                if j < self.size:
                    self.rows[j] = row.clone()

    def tensor(self) -> torch.Tensor:
        return torch.stack(self.rows)


def record_activations(pipe: Pipeline, queries, rows: int, seed: int = 0, progress=print) -> dict[str, RowReservoir]:
    """Answer `queries` with the float pipeline; per decoder linear (by module name) a reservoir of
    its input rows."""
    rt = pipe.rt
    names = module_names(rt.model)
    rng = random.Random(seed)
    reservoirs: dict[str, RowReservoir] = {}
    hooks = []
    for _, _, module in decoder_linears(rt.lm):
        if isinstance(module, torch.nn.Linear):
            res = reservoirs[names[id(module)]] = RowReservoir(rows, rng)
            hooks.append(module.register_forward_pre_hook(lambda m, args, res=res: res.add(args[0])))
    try:
        answer_queries(pipe, queries, "quantize traffic", progress)
    finally:
        for h in hooks:
            h.remove()
    return reservoirs


def source_files(model_dir: Path) -> dict:
    """The model folder's weight files and digests (its litevlm_manifest.json), to tie stored
    quantized weights to the float weights they came from."""
    listed = read_manifest(model_dir) or {}
    return {name: {"sha256": e["sha256"]} for name, e in listed.items() if name.endswith(".safetensors")}


@dataclass(frozen=True)
class QuantizePlan:
    """What `litevlm quantize` stores: the decoder of `model_dir` in `kind` (int4: AWQ from `data`'s
    traffic; int4-rtn, int8: round to nearest), checked before the model is loaded."""
    model_dir: Path
    options: PipelineOptions
    kind: str = "int4"                  # KINDS
    out: Path | None = None             # default: <model_dir>/quantized-<kind> (int4: QUANTIZED_DIR, what it reads)
    data: Path | None = None            # int4: a DriveLM-layout QA.json (with frames) or a rosbag2
    frames_root: Path | None = None     # where the QA file's images are (default: its folder)
    questions: int = 32                 # calibration questions answered (seeded draw)
    rows: int = 512                     # input rows kept per layer (reservoir sample)
    group_size: int = GROUP_SIZE        # INT4 inputs per scale/zero group
    symmetric: bool = False             # signed INT4, no zero point (TensorRT/ModelOpt INT4 AWQ)
    # int4, > 0: a layer whose INT4 output error, relative to its output's mean square on the
    # calibration rows, exceeds it is stored in per-channel INT8 instead (mixed precision for the
    # layers INT4 hurts most; the kernels run either)
    int8_above: float = 0.0

    @property
    def folder(self) -> Path:
        """Where the weights are stored."""
        if self.out:
            return Path(self.out)
        return Path(self.model_dir) / (QUANTIZED_DIR if self.kind == "int4" else f"quantized-{self.kind}")

    def checked(self) -> QuantizePlan:
        """This plan, or InputError naming the flag at fault (reads no model)."""
        if self.kind not in KINDS:
            raise InputError(f"--weights {self.kind!r}: one of {', '.join(KINDS)}")
        if self.questions < 1 or self.rows < 1:
            raise InputError("--questions and --rows must be at least 1")
        if self.kind == "int4":
            if self.data is None:
                raise InputError("--weights int4 (AWQ) needs --data: DriveLM-layout QA.json (with frames) or a rosbag2")
            if not Path(self.data).exists():
                raise InputError(f"--data {self.data}: no such file or folder", path=self.data)
            data_kind(self.data)
        return replace(self, model_dir=Path(self.model_dir))


def quantize_model(plan: QuantizePlan, progress=print) -> dict:
    """The decoder of plan.model_dir quantized as the plan says and stored in plan.folder. Returns the
    manifest."""
    plan = plan.checked()
    model_dir, kind, group_size, symmetric = plan.model_dir, plan.kind, plan.group_size, plan.symmetric
    out, options = plan.folder, plan.options
    opts = replace(options, backend=replace(options.backend, name="torch", weights="float"))
    pipe = Pipeline.from_pretrained(model_dir, opts)
    rt = pipe.rt
    names = module_names(rt.model)
    layers = decoder_linears(rt.lm)
    for _, _, module in layers:
        k = module.embedding_dim if isinstance(module, torch.nn.Embedding) else module.in_features
        if kind != "int8":
            check_group(k, group_size, names[id(module)])
    calibration: dict = {}
    reservoirs = {}
    if kind == "int4":
        queries = load_queries(Path(plan.data), plan.frames_root)
        calib, _ = split_queries(queries, plan.questions, 0)
        progress(f"{len(queries)} questions in {plan.data}: {len(calib)} answered for AWQ's activations")
        t0 = time.perf_counter()
        with torch.inference_mode():
            reservoirs = record_activations(pipe, calib, plan.rows, progress=progress)
        calibration = {"data": str(plan.data), "questions": len(calib), "rows_per_layer": plan.rows,
                       "rows_seen": max((r.seen for r in reservoirs.values()), default=0),
                       "seconds": round(time.perf_counter() - t0, 1)}
    weights, info = {}, {}
    for i, (_, _, module) in enumerate(layers):
        name = names[id(module)]
        tied = isinstance(module, torch.nn.Embedding)
        w = module.weight.detach()
        t0 = time.perf_counter()
        if kind == "int8":
            weights[name] = quantize_int8(w)
            note = "per-channel"
        elif kind == "int4-rtn" or tied or name not in reservoirs or not reservoirs[name].rows:
            weights[name] = quantize_int4(w, group_size, symmetric)
            info[name] = {"method": "rtn" + (" (tied embedding + head)" if tied else "")}
            note = info[name]["method"]
        else:
            res = awq_quantize(w, reservoirs[name].tensor(), group_size, symmetric)
            info[name] = {"method": "awq", "alpha": res.alpha, "clip": res.clip, "output_mse": res.error,
                          "rtn_output_mse": res.rtn_error, "relative_error": res.relative_error}
            note = (f"awq alpha {res.alpha:.2f} clip {res.clip:.2f}  output MSE {res.error:.3g} "
                    f"(RTN {res.rtn_error:.3g}), relative {res.relative_error:.2g}")
            if plan.int8_above and res.relative_error > plan.int8_above:
                weights[name] = quantize_int8(w)
                info[name]["method"] = f"int8 (int4 relative error above {plan.int8_above:g})"
                note += " -> int8"
            else:
                weights[name] = res.weight
        progress(f"[quantize {i + 1}/{len(layers)}] {name} {tuple(w.shape)} {note}  {time.perf_counter() - t0:.1f} s")
    manifest = {"weights": kind, "method": {"int4": "awq", "int4-rtn": "rtn", "int8": "per-channel"}[kind],
                "group_size": None if kind == "int8" else group_size,
                "symmetric": symmetric if kind != "int8" else True, "int8_above": plan.int8_above or None,
                "source": {"model": str(model_dir), "files": source_files(model_dir)},
                "calibration": calibration, "module_info": info}
    manifest = save_quantized(out, weights, manifest)
    progress(f"{kind} weights of {len(weights)} modules ({FORMAT}) -> {out}")
    return manifest


def with_int4_weights(plan: CalibrationPlan, progress=print) -> CalibrationPlan:
    """An INT4 calibration plan with the stored weights it writes into the graphs: the ones it names
    (--quantized), or the project's own AWQ (symmetric, as TensorRT's INT4 AWQ takes it) from the
    plan's calibration questions, stored beside its bundle as <name>-weights. Other precisions: the
    plan as it is. (ModelOpt's ONNX INT4 AWQ-lite was the path here once: it quantizes graph by graph,
    so each shape bucket got its own scales; it needed cppimport; and ModelOpt 0.47 blocked the
    weights along the output channels, which TensorRT's INT4 AWQ and this format cannot take.)"""
    plan = plan.checked()
    if plan.precision != "int4" or plan.quantized is not None:
        return plan
    out = plan.quant_dir.with_name(plan.quant_dir.name + "-weights")
    progress(f"INT4 AWQ (symmetric) from {plan.calib_questions} questions of {plan.data} -> {out}")
    quantize_model(QuantizePlan(plan.model_dir, plan.options, kind="int4", out=out, data=plan.data,
                                frames_root=plan.frames_root, questions=plan.calib_questions, symmetric=True), progress)
    return replace(plan, quantized=out)
