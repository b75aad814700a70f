"""`calibrate(plan)`: a quantized bundle from real pipeline traffic, and what it costs in accuracy.

Top to bottom: the questions (split into calibration and held-out ones), the float export (made
when the plan names none), the traffic recorded on its buckets, every graph quantized (or the INT4
weights written in), the held-out questions answered by both bundles. The plan was checked before
any of it (plan.py).
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import replace

from ...engines.buckets import default_buckets, parse_buckets
from ...engines.bundle import MANIFEST, write_manifest
from ...engines.onnxruntime_engine import Bundle
from ...errors import LiteVLMError
from ...pipeline.pipeline import Pipeline
from ..exporter import export_bundle
from .accuracy import AccuracyReport, evaluate
from .plan import CalibrationPlan
from .quantize import int4_bundle, quantize_bundle
from .traffic import Recorder, collect_traffic, load_queries, split_queries


def calibrate(plan: CalibrationPlan, progress=print) -> tuple[dict, AccuracyReport]:
    """The bundle `plan` asks for, in plan.quant_dir (its manifest returned), with the accuracy
    report of the held-out questions (also written to <out>/calibration_report_<name>.json)."""
    plan = plan.checked()
    queries = load_queries(plan.data, plan.frames_root)
    calib, held_out = split_queries(queries, plan.calib_questions, plan.eval_questions)
    progress(f"{len(queries)} questions in {plan.data}: {len(calib)} for calibration, {len(held_out)} held out "
             f"for evaluation")
    options = plan.options
    pipe = Pipeline.from_pretrained(plan.model_dir, replace(options, backend=replace(options.backend, name="torch")))
    bundle = plan.source_bundle
    if plan.bundle is None and not (bundle / MANIFEST).is_file():
        progress(f"no --bundle: exporting the unquantized graphs to {bundle}")
        buckets = parse_buckets(plan.buckets, default_buckets(pipe.rt.arena)) if plan.buckets else None
        export_bundle(pipe.rt, bundle, buckets, progress=progress)
    src = Bundle(pipe.rt, bundle)
    if src.manifest.get("precision"):
        raise LiteVLMError(f"{bundle}: already quantized ({src.manifest['precision']}); calibrate an fp32 export")
    recorder = Recorder(plan.samples_per_graph)
    if plan.precision != "int4":          # INT4 is weight-only: its stored weights need no traffic
        t0 = time.perf_counter()
        collect_traffic(pipe, src, calib, recorder, progress)
        progress(f"traffic recorded in {time.perf_counter() - t0:.1f} s")
    if plan.quant_dir.exists():
        shutil.rmtree(plan.quant_dir)
    if plan.precision == "int4":
        manifest = int4_bundle(plan, pipe.rt, progress)
    else:
        record = {"data": str(plan.data), "questions": len(calib), "samples_per_graph": plan.samples_per_graph,
                  "method": plan.method, "quantized_stages": list(plan.stages), "keep_float": plan.keep_float}
        if plan.fp8_decode:
            record["fp8_decode"] = True
        manifest = quantize_bundle(plan, recorder, record, progress)
    # FP8 Q/DQ runs in ONNX Runtime too (its CPU QuantizeLinear/DequantizeLinear take float8e4m3fn;
    # `calibrate --check` proves every pair): every precision is measured against the float graphs.
    report = evaluate(plan.model_dir, options, bundle, plan.quant_dir, plan.precision, held_out, progress)
    manifest.setdefault("calibration", {})["evaluation"] = report.__dict__
    write_manifest(plan.quant_dir, manifest)
    (plan.out / f"calibration_report_{plan.quant_dir.name}.json").write_text(json.dumps(
        {"precision": plan.precision, "bundle": str(plan.quant_dir), "fp32_bundle": str(bundle),
         "evaluation": report.__dict__}, indent=2) + "\n")
    return manifest, report
