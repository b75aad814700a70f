"""`litevlm calibrate`: INT8/FP8 Q/DQ graphs from real pipeline traffic (NVIDIA ModelOpt), with the
accuracy change against the unquantized model on held-out questions."""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import replace
from pathlib import Path

from ..errors import InputError
from ..export.calibration.plan import METHODS, PRECISIONS, QUANTIZED_STAGES, CalibrationPlan
from ..report import table
from .ask import add_pipeline_args, pipeline_options


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="quantize a bundle's graphs (int8 for ONNX Runtime, fp8 for TensorRT)")
    add_pipeline_args(p)
    p.add_argument("--data", type=Path, required=True, help="DriveLM-layout QA.json (with its frames) or a rosbag2")
    p.add_argument("--frames-root", type=Path, help="where the QA file's images are (default: the file's folder)")
    p.add_argument("--precision", choices=PRECISIONS, default="int8",
                   help="int8 / fp8: ModelOpt Q/DQ from recorded traffic; int4: weight-only INT4 AWQ as TensorRT 10 "
                        "takes it (DequantizeLinear with block_size): the weights --quantized names, or "
                        "the project's INT4 AWQ (symmetric) from --calib-questions questions of --data without it")
    p.add_argument("--quantized", type=Path, help="with --precision int4: weights stored by `litevlm quantize "
                                                   "--weights int4 --symmetric` (the same the PyTorch engines run "
                                                   "with --backend.weights int4)")
    p.add_argument("--mix", nargs=2, type=Path, metavar=("BASE", "DONOR"),
                   help="instead of calibrating: a bundle of BASE's graphs with --mix-stages' graphs from DONOR "
                        "(two bundles of the same export), written to --out/--name")
    p.add_argument("--mix-stages", default="vision", help="with --mix: the stages taken from DONOR")
    p.add_argument("--out", type=Path, help="output folder: <out>/<precision> is the new bundle")
    p.add_argument("--check", type=Path, metavar="QUANTIZED_BUNDLE",
                   help="instead of calibrating: prove that ONNX Runtime executes every Q/DQ pair of this bundle "
                        "as it is written (each pair against its rounding recomputed in numpy with ml_dtypes, the "
                        "graph against onnx's reference evaluator and the unquantized graph; export/qdq.py), on "
                        "inputs recorded from --calib-questions questions of --data")
    p.add_argument("--bundle", type=Path, help="fp32 export bundle to quantize (default: export one to <out>/fp32)")
    p.add_argument("--buckets", help="buckets for that export (see litevlm export --buckets)")
    p.add_argument("--calib-questions", type=int, default=16, help="questions answered to record traffic")
    p.add_argument("--eval-questions", type=int, default=16, help="held-out questions for the accuracy change")
    p.add_argument("--samples", type=int, default=16, help="recorded calls kept per graph (reservoir sample)")
    p.add_argument("--method", choices=METHODS, default="", help="activation range calibration "
                                                                  "(default: entropy for int8, max for fp8)")
    p.add_argument("--stages", default=",".join(QUANTIZED_STAGES),
                   help="stages whose graphs are quantized (the others stay as exported), e.g. "
                        "prefill,decoder,decoder_batch for a float vision encoder")
    p.add_argument("--keep-float", default="", metavar="REGEX",
                   help="weight products to leave in float: a regular expression on weight names (a mixed "
                        "configuration; `--sensitivity` prints the one for its most sensitive layers)")
    p.add_argument("--fp8-decode", action="store_true",
                   help="with --precision fp8: the one-row decode step (decoder_1, and with it the batched step) "
                        "in FP8 too, as TensorRT runs it when the step is built with FP8 GEMMs; by default "
                        "ModelOpt leaves such GEMV-shaped products float (its enable_gemv_detection_for_trt)")
    p.add_argument("--name", default="", help="the new bundle's folder under --out (default: the precision)")
    p.add_argument("--sensitivity", action="store_true",
                   help="instead of calibrating: quantize one layer/stage part at a time (fp8 and int4) in PyTorch "
                        "on --calib-questions questions of --data and print the damage to the answers' next-token "
                        "distributions (export/sensitivity.py); --bundle CAL/fp8 reads that bundle's FP8 scales")
    p.add_argument("--plot", type=Path, help="with --sensitivity: the bar chart (PNG)")
    p.add_argument("--report", type=Path, help="with --sensitivity: the rows as JSON")
    p.add_argument("--int4-block", type=int, default=128, help="with --sensitivity: INT4 block (input channels)")
    p.set_defaults(func=run)


def run(args) -> int:
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    options = pipeline_options(args)
    say = lambda m: print(m, file=sys.stderr)
    if args.check:
        return check(args, options, say)
    if args.sensitivity:
        return sensitivity(args, options, say)
    if args.mix:
        return mix(args)
    # The whole plan is checked here, before a model is loaded or a question answered.
    plan = CalibrationPlan(args.model, options, args.data, args.out, frames_root=args.frames_root,
                           calib_questions=args.calib_questions, eval_questions=args.eval_questions,
                           samples_per_graph=args.samples, precision=args.precision, method=args.method,
                           stages=tuple(s for s in args.stages.split(",") if s), keep_float=args.keep_float,
                           fp8_decode=args.fp8_decode, quantized=args.quantized, bundle=args.bundle,
                           buckets=args.buckets or "", name=args.name).checked()
    # (the calibration itself loads torch, ModelOpt and onnx: imported when run, so `--help` loads none)
    from ..export.awq import with_int4_weights
    from ..export.calibration.calibrate import calibrate

    manifest, report = calibrate(with_int4_weights(plan, progress=say), progress=say)
    made = (f"ModelOpt {manifest['calibration']['modelopt']}" if "modelopt" in manifest.get("calibration", {})
            else f"weights {manifest.get('quantization', {}).get('weights')}")
    print(f"{plan.precision} bundle: {plan.quant_dir}  ({len(manifest['graphs'])} graphs, {made})")
    if report.questions:
        print("\n".join(report.lines(plan.precision)))
    if plan.precision in ("int8", "int4"):
        print(f"\nspeed, {plan.precision} vs fp32 in one run: litevlm bench --model {args.model} "
              f"--backend onnxruntime={plan.source_bundle},onnxruntime={plan.quant_dir}")
    else:
        print(f"\nTensorRT FP8 engines (on the GPU): litevlm build-engines {plan.quant_dir} --precision fp8")
    return 0


def mix(args) -> int:
    """`--mix BASE DONOR`: a bundle of BASE's graphs with --mix-stages' graphs from DONOR."""
    from ..export.calibration.accuracy import mix_bundles

    if args.out is None or not args.name:
        raise InputError("--mix needs --out and --name (the mixed bundle's folder)")
    manifest = mix_bundles(args.mix[0], args.mix[1], tuple(args.mix_stages.split(",")), args.out / args.name)
    print(f"{args.out / args.name}: {manifest['precision']} ({args.mix_stages} from {args.mix[1]}, the rest from "
          f"{args.mix[0]})")
    return 0


def check(args, options, say) -> int:
    from ..export.calibration.check import check_bundle
    from ..export.qdq import CHECK_HEADER, check_rows

    reports = check_bundle(args.model, options, args.data, args.check, frames_root=args.frames_root,
                           questions=args.calib_questions, samples_per_graph=min(args.samples, 4), progress=say)
    print(f"Q/DQ execution check of {args.check} ({args.calib_questions} questions of {args.data}, "
          f"{min(args.samples, 4)} recorded calls per graph):")
    print(table(CHECK_HEADER, check_rows(reports)))
    bad = [r.graph for r in reports if r.mismatches]
    print(f"{sum(r.checked for r in reports)} Q/DQ pairs checked in {len(reports)} graphs, "
          f"{sum(r.elements for r in reports)} elements: {sum(r.mismatches for r in reports)} differ from the "
          f"recomputed rounding" + (f" (in {', '.join(bad)})" if bad else ""))
    return 1 if bad else 0


def sensitivity(args, options, say) -> int:
    """`--sensitivity`: the per-unit table (and PNG), the most sensitive units and the --keep-float
    expression that keeps them in float."""

    from ..export.calibration.traffic import load_queries, split_queries
    from ..export.sensitivity import (
        SENSITIVITY_HEADER,
        keep_float_pattern,
        most_sensitive,
        plot,
        record_traffic,
        sensitivity_rows,
    )
    from ..export.sensitivity import sensitivity as sweep
    from ..pipeline.pipeline import Pipeline

    opts = replace(
        options,
        backend=replace(options.backend, name="torch"),
        serving=replace(options.serving, feature_cache=False),
        decoding=replace(options.decoding, mode="greedy"),
    )
    pipe = Pipeline.from_pretrained(args.model, opts)
    queries, _ = split_queries(load_queries(args.data, args.frames_root), args.calib_questions, 0)
    traffic = record_traffic(pipe, queries, say)
    graphs = None
    if args.bundle:
        from ..engines.bundle import read_manifest

        manifest = read_manifest(args.bundle)
        if manifest.get("precision") != "fp8":
            raise InputError(f"--bundle {args.bundle}: --sensitivity reads FP8 scales from an fp8 bundle "
                             f"(its precision is {manifest.get('precision')!r})")
        biggest = {}
        for g in manifest["graphs"]:          # per stage its largest bucket's scales
            if g["stage"] in ("vision", "prefill") and g["bucket"] >= biggest.get(g["stage"], {"bucket": -1})["bucket"]:
                biggest[g["stage"]] = g
        graphs = [args.bundle / g["file"] for g in biggest.values()]
    rows = sweep(pipe.rt, traffic, bundle_graphs=graphs, int4_block=args.int4_block, progress=say)
    print(f"per-unit sensitivity on {len(traffic)} questions of {args.data} ({sum(len(t.answer) + 1 for t in traffic)} "
          f"answer positions, teacher-forced on the float answers); FP8 scales "
          f"{'of ' + str(args.bundle) if graphs else 'calibrated on this traffic (amax / 448)'}, INT4 blocks of "
          f"{args.int4_block} (weight only):")
    print(table(SENSITIVITY_HEADER, sensitivity_rows(rows)))
    for fmt in ("fp8", "int4"):
        top = most_sensitive(rows, fmt, 2)
        print(f"most sensitive under {fmt}: {', '.join(top)}  ->  --keep-float '{keep_float_pattern(top)}'")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    if args.report:
        args.report.write_text(json.dumps(rows, indent=1) + "\n")
    return 0
