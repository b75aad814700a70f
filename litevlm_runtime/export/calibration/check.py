"""`litevlm calibrate --check`: a quantized bundle's Q/DQ pairs executed as written, proven on traffic.

Every quantized graph of the bundle is checked as export/qdq.py describes, on inputs recorded from
a few questions (drawn with a fixed seed, answered by the PyTorch pipeline on the bundle's buckets,
as calibration records them): each Q/DQ pair against the float8/int8/int4 rounding recomputed in
numpy, the graph against onnx's reference evaluator and against the unquantized graph of the bundle
it was calibrated from.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from ...engines.bundle import read_manifest
from ...engines.onnxruntime_engine import Bundle
from ...errors import LiteVLMError
from ...pipeline.pipeline import Pipeline
from ..qdq import check_graph
from .plan import QUANTIZED_STAGES
from .traffic import Recorder, collect_traffic, load_queries, samples_for, split_queries

SEED = 1            # which questions of the data are answered to record the inputs


def check_bundle(model_dir: Path, options, data: Path, quant_bundle: Path, *, frames_root: Path | None = None,
                 questions: int = 4, samples_per_graph: int = 2, progress=print) -> list:
    """The check of every quantized graph of `quant_bundle` (export/qdq.py's reports), on inputs
    recorded from `questions` questions of `data`, at most `samples_per_graph` calls per graph."""
    quant_bundle = Path(quant_bundle)
    manifest = read_manifest(quant_bundle)
    if not manifest.get("precision"):
        raise LiteVLMError(f"{quant_bundle}: not a quantized bundle (no precision in its manifest)")
    made = manifest.get("calibration") or manifest.get("quantization") or {}
    if "source_bundle" not in made:
        raise LiteVLMError(f"{quant_bundle}: its manifest does not say which float bundle it was made from")
    src_dir = Path(made["source_bundle"])
    pipe = Pipeline.from_pretrained(model_dir, replace(options, backend=replace(options.backend, name="torch")))
    src = Bundle(pipe.rt, src_dir)
    picked, _ = split_queries(load_queries(data, frames_root), questions, 0, SEED)
    recorder = Recorder(samples_per_graph, SEED)
    collect_traffic(pipe, src, picked, recorder, progress)
    reports = []
    for g in manifest["graphs"]:
        if g.get("precision") in (None, manifest["dtype"]) or g["stage"] not in QUANTIZED_STAGES:
            continue
        feeds, _ = samples_for(g, src.manifest, recorder)
        t0 = time.perf_counter()
        reports.append(check_graph(quant_bundle / g["file"], feeds[:samples_per_graph], src_dir / g["file"]))
        r = reports[-1]
        progress(f"[check {len(reports)}] {g['file']:<18} {r.checked} pairs, {r.mismatches}/{r.elements} elements "
                 f"differ, ORT vs reference {r.vs_reference:.1e}, vs float {r.vs_float:.1e}  "
                 f"{time.perf_counter() - t0:.1f} s")
    return reports
