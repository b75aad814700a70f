"""`litevlm quantize`: the decoder's weights quantized once and stored beside the model (INT4 with
AWQ scales from real pipeline traffic, or round to nearest; INT8), for `backend.weights int4` to load
(export/awq.py, weights/quantize.py's format)."""

from __future__ import annotations

import sys
from pathlib import Path

from .ask import add_pipeline_args, pipeline_options


def register(subparsers) -> None:
    p = subparsers.add_parser("quantize", help="store the decoder's weights as INT4 (AWQ from traffic, or RTN) or INT8")
    add_pipeline_args(p)
    p.add_argument("--data", type=Path, help="calibration traffic for AWQ: DriveLM-layout QA.json (with its frames) "
                                             "or a rosbag2")
    p.add_argument("--frames-root", type=Path, help="where the QA file's images are (default: the file's folder)")
    p.add_argument("--weights", choices=("int4", "int4-rtn", "int8"), default="int4",
                   help="int4: AWQ (needs --data); int4-rtn: round to nearest; int8: per-channel")
    p.add_argument("--out", type=Path, help="output folder (default: <model>/quantized-int4 for int4, which "
                                            "backend.weights int4 reads without backend.quantized)")
    p.add_argument("--questions", type=int, default=32, help="calibration questions answered (seeded draw)")
    p.add_argument("--rows", type=int, default=512, help="input rows kept per layer (reservoir sample)")
    p.add_argument("--group-size", type=int, default=128, help="INT4 inputs per scale/zero group")
    p.add_argument("--symmetric", action="store_true", help="signed INT4, no zero point (TensorRT/ModelOpt INT4 AWQ)")
    p.add_argument("--int8-above", type=float, default=0.0,
                   help="int4: store a layer in INT8 when its INT4 output error relative to its output (mean "
                        "squares on the calibration rows) exceeds this (0: every layer INT4)")
    p.set_defaults(func=run)


def run(args) -> int:
    # (the quantizer loads torch: imported when run, so `--help` loads none)
    from ..export.awq import QuantizePlan, quantize_model

    plan = QuantizePlan(Path(args.model), pipeline_options(args), args.weights, args.out, args.data, args.frames_root,
                        args.questions, args.rows, args.group_size, args.symmetric, args.int8_above).checked()
    manifest = quantize_model(plan, progress=lambda m: print(m, file=sys.stderr))
    print(f"{args.weights} weights: {plan.folder}  ({len(manifest['modules'])} modules, {manifest['format']})")
    if args.weights == "int4":
        print("use: --backend.weights int4" + ("" if args.out is None else f" --backend.quantized {plan.folder}"))
    return 0
