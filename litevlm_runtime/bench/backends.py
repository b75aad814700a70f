"""Backends side by side: the same queries through one pipeline per backend, in one process,
interleaved query by query so that machine noise hits every backend alike. The first backend
is the baseline; every other gets a speed-up column (baseline ms / its ms) and a count of
answers identical to the baseline's.

A backend is named `NAME` or `NAME=BUNDLE` (NAME one of the registered backends; BUNDLE an export
or calibration bundle folder, which may hold INT8/FP8 graphs), or `openvino:COMPRESS=BUNDLE` for
OpenVINO with NNCF-compressed weights (backend.compress int8 | int4), e.g.
    torch,onnxruntime=bundle,onnxruntime=bundle-int8,openvino=bundle,openvino:int8=bundle

The table says, per stage, which backend was fastest and by how much over the next.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import LiteVLMError
from ..options import Backend, BackendName
from ..pipeline.answer import STAGES
from ..pipeline.pipeline import Pipeline
from ..report import table

NEEDS_BUNDLE = ("onnxruntime", "openvino", "tensorrt")


@dataclass
class BackendRun:
    label: str
    pipe: object
    stage_ms: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    total_ms: list[float] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)


@dataclass(frozen=True)
class BackendSpec:
    label: str                # the table's column: NAME, NAME[precision] (a calibrated bundle), openvino[int8]
    name: str                 # backend.name
    bundle: Path | None       # backend.bundle
    compress: str = ""        # backend.compress ("": the command's own)


def parse_backends(spec: str, default_bundle: Path | None) -> list[BackendSpec]:
    """'torch,onnxruntime=B,openvino:int8=B' -> one BackendSpec each; labels say the bundle's
    precision (a calibrated bundle) or OpenVINO's weight compression (NAME:COMPRESS)."""
    BACKENDS = [b.value for b in BackendName]
    COMPRESS = Backend.__dataclass_fields__["compress"].metadata["choices"]

    out: list[BackendSpec] = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        head, _, bundle = item.partition("=")
        name, _, compress = head.partition(":")
        if name not in BACKENDS:
            raise LiteVLMError(f"--backend {item!r}: unknown backend ({', '.join(BACKENDS)})")
        if compress and (name != "openvino" or compress not in COMPRESS):
            raise LiteVLMError(f"--backend {item!r}: NAME:COMPRESS is openvino:{'|'.join(COMPRESS)}")
        path = Path(bundle) if bundle else (default_bundle if name in NEEDS_BUNDLE else None)
        if name in NEEDS_BUNDLE and path is None:
            raise LiteVLMError(f"--backend {item!r}: needs a bundle ({name}=DIR or --bundle DIR)")
        label = name
        if path is not None:
            manifest = path / "manifest.json"
            precision = json.loads(manifest.read_text()).get("precision") if manifest.is_file() else None
            label = f"{name}[{precision}]" if precision else name
        if compress and compress != "none":
            label = f"{name}[{compress}]"
        if any(label == o.label for o in out):
            label = f"{label}#{len(out)}"
        out.append(BackendSpec(label, name, path, compress))
    if not out:
        raise LiteVLMError("--backend: no backend given")
    return out


def backend_options(options, spec: BackendSpec):
    """The command's options with this backend's name, bundle and compression."""
    backend = replace(options.backend, name=spec.name,
                      bundle=str(spec.bundle) if spec.bundle is not None else options.backend.bundle)
    if spec.name == "openvino":
        backend = replace(backend, compress=spec.compress or options.backend.compress)
    elif backend.compress != "none":
        backend = replace(backend, compress="none")        # --backend.compress applies to the openvino entries
    return replace(options, backend=backend)


def build_runs(model_dir: Path, options, backends: list[BackendSpec]) -> list[BackendRun]:
    return [BackendRun(b.label, Pipeline.from_pretrained(model_dir, backend_options(options, b))) for b in backends]


def compare_backends(runs: list[BackendRun], frame_sets: list[dict], questions: list[str], repeat: int = 1,
                     warmup: int = 2, progress=print) -> dict:
    pairs = [(f, q) for _ in range(repeat) for f in frame_sets for q in questions]
    for f, q in pairs[:warmup]:
        for r in runs:
            r.pipe.answer(f, q)
    for i, (frames, question) in enumerate(pairs):
        line = []
        for r in runs:
            ans = r.pipe.answer(frames, question)
            for s in STAGES:
                r.stage_ms[s].append(ans.stage_ms[s])
            r.total_ms.append(ans.total_ms)
            r.answers.append(list(ans.token_ids))
            line.append(f"{r.label} {ans.total_ms:7.1f} ms")
        progress(f"[{i + 1}/{len(pairs)}] " + "  ".join(line) + f"  {question[:40]}")
    base = runs[0]
    summary = {"queries": len(pairs), "baseline": base.label, "backends": {}}
    for r in runs:
        med = {s: statistics.median(v) for s, v in r.stage_ms.items()}
        med["total"] = statistics.median(r.total_ms)
        same = sum(a == b for a, b in zip(r.answers, base.answers))
        summary["backends"][r.label] = {"median_ms": med, "identical_to_baseline": f"{same}/{len(pairs)}"}
    return summary


# The fastest backend of a stage is named only when it leads the next by more than this: a few
# per cent between medians of a shared machine is noise (the stages no backend runs, such as
# preprocessing, are then "level").
LEAD = 1.05


def fastest(ms: dict[str, float]) -> str:
    """'LABEL (1.23x over NEXT)' for the stage's fastest backend, or 'level' within LEAD."""
    ranked = sorted((m, label) for label, m in ms.items())
    if len(ranked) < 2 or ranked[0][0] <= 0:
        return "-"
    (best, label), (second, other) = ranked[0], ranked[1]
    lead = second / best
    return f"{label} ({lead:.2f}x over {other})" if lead > LEAD else "level"


def comparison_table(summary: dict) -> str:
    labels = list(summary["backends"])
    base = summary["baseline"]
    headers = (["stage"] + [f"{l} ms" for l in labels] + [f"{l} speed-up" for l in labels[1:]]
               + (["fastest"] if len(labels) > 1 else []))
    rows = []
    for stage in list(STAGES) + ["total"]:
        ms = [summary["backends"][l]["median_ms"][stage] for l in labels]
        base_ms = ms[0]
        ratios = [f"{base_ms / m:.2f}x" if m > 0 else "-" for m in ms[1:]]
        rows.append([stage] + ms + ratios + ([fastest(dict(zip(labels, ms)))] if len(labels) > 1 else []))
    same = "   ".join(f"{l}: {summary['backends'][l]['identical_to_baseline']}" for l in labels[1:])
    return (table(headers, rows) + f"\n\nmedian over {summary['queries']} queries; speed-up = {base} ms / backend ms"
            + (f"; fastest: the stage's fastest backend when it leads the next by more than {LEAD - 1:.0%}"
               if len(labels) > 1 else "")
            + (f"\nanswers identical to {base}: {same}" if same else ""))
