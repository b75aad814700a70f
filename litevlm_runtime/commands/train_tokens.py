"""`litevlm train tokens`: the command line of litevlm_runtime.training.tokens."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("tokens", help="train the token selector (layer-0 copy) on the full model's attention",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="InternVL2.5-layout model folder (the teacher)")
    p.add_argument("--data", type=Path, required=True, help="QA (DriveLM v1.1 JSON)")
    p.add_argument("--frames", type=Path, required=True, help="root the image_paths are relative to")
    p.add_argument("--val", type=Path, help="held-out QA (default: --holdout of --data's key frames)")
    p.add_argument("--val-frames", type=Path, help="image root of --val (default: --frames)")
    p.add_argument("--out", type=Path, help="output folder (default: <model>/token_selector)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="samples per optimizer step (global)")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--keep-ratio", type=float, default=0.8, help="r of the recall metric and pipeline check")
    p.add_argument("--reduce", choices=("max", "mean"), default="max", help="over question tokens")
    p.add_argument("--scope", choices=("camera", "global"), default="camera", help="pipeline check's selection scope")
    p.add_argument("--holdout", type=float, default=0.25, help="fraction of key frames held out")
    p.add_argument("--max-samples", type=int, default=0, help="cap on training QA (0: all)")
    p.add_argument("--max-frames", type=int, default=0, help="cap on training key frames (0: all)")
    p.add_argument("--eval-samples", type=int, default=200, help="cap on held-out QA for the recall metric")
    p.add_argument("--eval-questions", type=int, default=40, help="held-out questions through the pipeline (0: skip)")
    p.add_argument("--max-answer-tokens", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--threads", type=int, help="torch intra-op threads per process (default: torch's choice)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--json", action="store_true", help="print the metrics as JSON at the end")

    def run(args) -> int:
        from ..training.tokens import train

        train(args)
        return 0

    p.set_defaults(func=run)
