"""`litevlm train vlm`: the command line of litevlm_runtime.training.vlm."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..weights.presets import PRESETS


def register(subparsers) -> None:
    p = subparsers.add_parser("vlm", help="train an InternVL2.5-layout model from scratch on DriveLM-format QA",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", type=Path, required=True, help="training QA (DriveLM v1.1 JSON)")
    p.add_argument("--frames", type=Path, required=True, help="root the image_paths are relative to")
    p.add_argument(
        "--val", type=Path, help="held-out QA for the periodic accuracy (default: --holdout of --data's frames)"
    )
    p.add_argument("--val-frames", type=Path, help="image root of --val (default: --frames)")
    p.add_argument("--holdout", type=float, default=0.05, help="fraction of frames held out when no --val")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--preset", choices=PRESETS, default="bundled")
    p.add_argument(
        "--init", type=Path, help="continue from this checkpoint (its weights and tokenizer) instead of random weights"
    )
    p.add_argument("--vocab-size", type=int, default=1024)
    p.add_argument("--tile-size", type=int,
                   help="tile size in pixels instead of the preset's; with --init the position embedding is "
                        "interpolated from the checkpoint's grid (a higher-resolution fine-tune)")
    p.add_argument("--decoder-layers", type=int,
                   help="decoder depth instead of the preset's; with --init a shallower checkpoint is grown to it "
                        "(new layers interleaved, starting as identities)")
    p.add_argument("--steps", type=int, help="optimizer steps (default: --epochs over the data)")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--frames-per-step", type=int, default=8, help="frame groups per optimizer step (global)")
    p.add_argument("--questions-per-frame", type=int, default=16, help="questions per frame group (one prefix tree)")
    p.add_argument("--questions-per-visit", type=int, default=0,
                   help="random questions of each frame per pass over the data (0: all)")
    p.add_argument("--max-sequence-tokens", type=int, default=1024, help="longest packed sequence per forward")
    p.add_argument(
        "--loss-per",
        choices=("token", "sample"),
        default="sample",
        help="mean the loss over answer tokens, or over QA (short yes/no answers weigh as much as long ones)",
    )
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--warmup", type=float, default=0.05, help="warm-up fraction of the steps")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--max-answer-tokens", type=int, default=64)
    p.add_argument("--save-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the written weights (training keeps float32 masters; the loader reads either "
                        "into the pipeline's dtype): bfloat16 halves the folder")
    add_signal_flags(p)
    add_run_flags(p)

    def run(args) -> int:
        from ..training.vlm import train

        train(args)
        return 0

    p.set_defaults(func=run)


def add_signal_flags(p) -> None:
    """What else the model learns from: vision labels, selected views, questions over time, a frozen
    vision side."""
    p.add_argument("--vision-labels", type=Path,
                   help="SynthDrive ground_truth.json: also train a linear probe on every visual token to predict the "
                        "objects drawn there (training only; not in the checkpoint)")
    p.add_argument("--vision-weight", type=float, default=0.2, help="weight of the vision-label loss")
    p.add_argument("--view-selector", type=Path,
                   help="view selector folder: --selected-views of the QA are trained with only the cameras it selects")
    p.add_argument("--selected-views", type=float, default=0.5, help="fraction of QA trained with selected cameras")
    p.add_argument("--time-share", type=float, default=0.0,
                   help="with --questions-per-visit: the share of a frame visit's QA that are over several frame sets "
                        "(motion questions, as many as the frame has; 0: drawn like the others)")
    p.add_argument("--change-threshold", type=float, default=0.2,
                   help="temporal token selection in prompts over several frame sets, as the pipeline's "
                        "temporal.change_threshold (0: every token of every frame set)")
    p.add_argument("--motion", type=int, default=0, metavar="HIDDEN",
                   help="give the model a motion network of HIDDEN units (stages/motion.py: the optical flow from "
                        "the previous frame set, per cell, added to the newest set's visual tokens of a prompt over "
                        "frame sets), trained from zero with the decoder; --init's own is kept where it has one")
    p.add_argument("--motion-lr-scale", type=float, default=10.0,
                   help="the motion network's learning rate as a multiple of --lr (it starts from zero)")
    p.add_argument("--freeze-vision", action="store_true",
                   help="keep the vision side (InternViT and mlp1) as --init has it: its visual tokens are computed "
                        "once per frame set and cached, each step trains the decoder only, and older frame sets' "
                        "unchanged tokens are left out of the sequences instead of masked (not with --vision-labels)")


def add_run_flags(p) -> None:
    """Where and how the training runs: seed, device, precision, time budget, threads, logging."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: a GPU per rank where torch sees one, else the CPU")
    p.add_argument("--precision", choices=("auto", "float32", "bfloat16"), default="auto",
                   help="auto: bf16 autocast on a GPU (float32 master weights), float32 on the CPU")
    p.add_argument("--time-budget", type=float, metavar="MINUTES",
                   help="train for this many minutes (held-out checks not counted) instead of --steps/--epochs; "
                        "the learning-rate schedule follows the fraction of the budget spent")
    p.add_argument("--decode-threads", type=int,
                   help="decode all frames up front on this many threads (default: all cores on a GPU, "
                        "0 = lazily during training on the CPU)")
    p.add_argument("--threads", type=int, help="torch threads per process (default: cores / local ranks)")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=200, help="steps between held-out accuracy checks (0: off)")
    p.add_argument("--eval-questions", type=int, default=200)
