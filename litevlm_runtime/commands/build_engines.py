"""`litevlm build-engines BUNDLE --precision fp16|fp8|int8|int4`: TensorRT engines from a bundle's ONNX graphs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("build-engines", help="build TensorRT engines from an export/calibration bundle")
    p.add_argument("bundle", type=Path)
    p.add_argument("--precision", choices=("fp16", "fp8", "int8", "int4"), default="fp16",
                   help="fp16 from a float16 export; fp8 / int8 / int4 from a `litevlm calibrate --precision "
                        "fp8|int8|int4` bundle (int4: symmetric weights, `litevlm quantize --symmetric`)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..engines.tensorrt_engine import build_engines

    manifest = build_engines(args.bundle, args.precision, progress=lambda m: print(m, file=sys.stderr))
    rec = manifest["engines"][args.precision]
    print(f"{len(rec['files'])} {args.precision} engines, TensorRT {rec['tensorrt']}, {rec['gpu']['name']} "
          f"-> {args.bundle / 'manifest.json'}")
    return 0
