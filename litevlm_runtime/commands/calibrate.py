"""`litevlm calibrate`: INT8/FP8 Q/DQ graphs from real pipeline traffic (NVIDIA ModelOpt), with the
accuracy change against the unquantized model on held-out questions."""

from __future__ import annotations

import sys
from pathlib import Path

from .ask import add_pipeline_args, pipeline_options


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="quantize a bundle's graphs (int8 for ONNX Runtime, fp8 for TensorRT)")
    add_pipeline_args(p)
    p.add_argument("--data", type=Path, required=True, help="DriveLM-layout QA.json (with its frames) or a rosbag2")
    p.add_argument("--frames-root", type=Path, help="where the QA file's images are (default: the file's folder)")
    p.add_argument("--precision", choices=("int8", "fp8"), default="int8")
    p.add_argument("--out", type=Path, required=True, help="output folder: <out>/<precision> is the new bundle")
    p.add_argument("--bundle", type=Path, help="fp32 export bundle to quantize (default: export one to <out>/fp32)")
    p.add_argument("--buckets", help="buckets for that export (see litevlm export --buckets)")
    p.add_argument("--calib-questions", type=int, default=16, help="questions answered to record traffic")
    p.add_argument("--eval-questions", type=int, default=16, help="held-out questions for the accuracy change")
    p.add_argument("--samples", type=int, default=16, help="recorded calls kept per graph (reservoir sample)")
    p.add_argument("--method", choices=("entropy", "max"), help="activation range calibration "
                                                                "(default: entropy for int8, max for fp8)")
    p.set_defaults(func=run)


def run(args) -> int:
    import logging

    from ..export.calibration import calibrate
    from ..engines.buckets import default_buckets, parse_buckets

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    options = pipeline_options(args)
    buckets = None
    if args.buckets:
        from ..pipeline.pipeline import Pipeline

        buckets = parse_buckets(args.buckets, default_buckets(Pipeline.from_pretrained(args.model, options).rt.arena))
    say = lambda m: print(m, file=sys.stderr)
    manifest, report = calibrate(args.model, args.data, args.precision, args.out, options, bundle=args.bundle,
                                 buckets=buckets, frames_root=args.frames_root, calib_questions=args.calib_questions,
                                 eval_questions=args.eval_questions, samples_per_graph=args.samples, method=args.method,
                                 progress=say)
    print(f"{args.precision} bundle: {args.out / args.precision}  ({len(manifest['graphs'])} graphs, ModelOpt "
          f"{manifest['calibration']['modelopt']})")
    if report.questions:
        print("\n".join(report.lines(args.precision)))
    if args.precision == "int8":
        print(f"\nspeed, int8 vs fp32 in one run: litevlm bench --model {args.model} "
              f"--backend onnxruntime={args.bundle or args.out / 'fp32'},onnxruntime={args.out / 'int8'}")
    else:
        print(f"\nTensorRT FP8 engines (on the GPU): litevlm build-engines {args.out / 'fp8'} --precision fp8")
    return 0
