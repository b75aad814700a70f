"""Backends side by side: the same queries through one pipeline per backend, in one process,
interleaved query by query so that machine noise hits every backend alike. The first backend
is the baseline; every other gets a speed-up column (baseline ms / its ms) and a count of
answers identical to the baseline's.

A backend is named `NAME` or `NAME=BUNDLE` (NAME one of the registered backends; BUNDLE an export
or calibration bundle folder, which may hold INT8/FP8 graphs), e.g.
    torch,onnxruntime=bundle,onnxruntime=bundle-int8
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..pipeline.answer import STAGES
from ..errors import LiteVLMError
from ..report import table

NEEDS_BUNDLE = ("onnxruntime", "tensorrt")


@dataclass
class BackendRun:
    label: str
    pipe: object
    stage_ms: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    total_ms: list[float] = field(default_factory=list)
    answers: list[list[int]] = field(default_factory=list)


def parse_backends(spec: str, default_bundle: Path | None) -> list[tuple[str, str, Path | None]]:
    """'torch,onnxruntime=B' -> [(label, backend, bundle)]; labels say the bundle's precision."""
    from ..options import BackendName

    BACKENDS = [b.value for b in BackendName]

    out = []
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        name, _, bundle = item.partition("=")
        if name not in BACKENDS:
            raise LiteVLMError(f"--backend {item!r}: unknown backend ({', '.join(BACKENDS)})")
        path = Path(bundle) if bundle else (default_bundle if name in NEEDS_BUNDLE else None)
        if name in NEEDS_BUNDLE and path is None:
            raise LiteVLMError(f"--backend {item!r}: needs a bundle ({name}=DIR or --bundle DIR)")
        label = name
        if path is not None:
            manifest = path / "manifest.json"
            precision = json.loads(manifest.read_text()).get("precision") if manifest.is_file() else None
            label = f"{name}[{precision}]" if precision else name
        if any(label == o[0] for o in out):
            label = f"{label}#{len(out)}"
        out.append((label, name, path))
    if not out:
        raise LiteVLMError("--backend: no backend given")
    return out


def build_runs(model_dir: Path, options, backends: list[tuple[str, str, Path | None]]) -> list[BackendRun]:
    from ..pipeline.pipeline import Pipeline

    runs = []
    for label, name, bundle in backends:
        backend = replace(options.backend, name=name, bundle=str(bundle) if bundle is not None else options.backend.bundle)
        runs.append(BackendRun(label, Pipeline.from_pretrained(model_dir, replace(options, backend=backend))))
    return runs


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


def comparison_table(summary: dict) -> str:
    labels = list(summary["backends"])
    base = summary["baseline"]
    headers = ["stage"] + [f"{l} ms" for l in labels] + [f"{l} speed-up" for l in labels[1:]]
    rows = []
    for stage in list(STAGES) + ["total"]:
        ms = [summary["backends"][l]["median_ms"][stage] for l in labels]
        base_ms = ms[0]
        ratios = [f"{base_ms / m:.2f}x" if m > 0 else "-" for m in ms[1:]]
        rows.append([stage] + ms + ratios)
    same = "   ".join(f"{l}: {summary['backends'][l]['identical_to_baseline']}" for l in labels[1:])
    return (table(headers, rows) + f"\n\nmedian over {summary['queries']} queries; speed-up = {base} ms / backend ms"
            + (f"\nanswers identical to {base}: {same}" if same else ""))
