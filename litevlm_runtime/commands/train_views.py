"""`litevlm train views`: the command line of litevlm_runtime.training.views."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InputError
from ..options import ANSWER_TAG_POLICIES, FUSION_RULES


def frame_spec(text: str) -> float | list[str]:
    """--frames-holdout / --val-frames: a fraction (< 1) or count (>= 1) of frames, or frame tokens."""
    try:
        value = float(text)
    except ValueError:
        tokens = [t.strip() for t in text.split(",") if t.strip()]
        if not tokens:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction, a count or frame tokens") from None
        return tokens
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: a frame fraction or count cannot be negative")
    return value


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "views",
        help="train the view selector on DriveLM-format QA (runs under torchrun for DDP)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--data", action="append", required=True, metavar="QA.json", help="DriveLM-format QA file (repeatable)"
    )
    p.add_argument("--out", help="output folder (default: <--model>/view_selector)")
    p.add_argument("--model", help="VLM folder; the selector is written beside it in <model>/view_selector")
    p.add_argument("--tokenizer", help="tokenizer.json (or a folder holding one) to use instead of training one")
    p.add_argument("--epochs", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frames-holdout", "--holdout-frames", type=frame_spec, default=0.25,
                   help="key frames held out for evaluation, never trained or tuned on: a fraction (<1), a count "
                        "(>=1) or comma-separated frame tokens; 0: none")
    p.add_argument("--val-frames", type=frame_spec, default=0.25,
                   help="of the other key frames, those that choose the fusion rule and thresholds (not trained on): "
                        "a fraction, a count or frame tokens; 0: none (then give a fixed --fusion)")
    p.add_argument("--eval-data", action="append", metavar="QA.json",
                   help="also evaluate on this DriveLM-format file, never trained on (repeatable)")
    p.add_argument("--fold", type=int, default=0, help="which block of held-out frames (k-fold cross-validation)")
    p.add_argument("--answer-tags", choices=ANSWER_TAG_POLICIES, default="cued",
                   help="when cameras tagged only in the answer become labels (see camera_labels)")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-len", type=int, default=160, help="question tokens kept (longer ones are truncated)")
    p.add_argument(
        "--fusion",
        choices=("auto",) + FUSION_RULES,
        default="auto",
        help="how the module and the keyword map combine (see view_selector.Fusion); auto: the rule and "
        "thresholds with the fewest cameras on the validation frames at no less recall than the keyword map",
    )
    p.add_argument(
        "--tune-tolerance",
        type=float,
        default=0.02,
        help="auto: a setting must save more than this many cameras per validation question to beat a more "
             "cautious one",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=0.4,
        help="keyword map: keep a camera whose keyword score reaches this (weighted: the fused-score threshold)",
    )
    p.add_argument("--keyword-weight", type=float, default=0.4, help="weighted fusion: weight w of the keyword map")
    p.add_argument(
        "--add-threshold",
        type=float,
        default=0.5,
        help="add / add_remove: module probability at which a camera is added (a fixed --fusion; auto tunes it)",
    )
    p.add_argument("--remove-threshold", type=float, default=0.1,
                   help="remove / add_remove: module probability below which an uncertain camera is removed")
    p.add_argument("--max-past-frames", type=int,
                   help="the time head's range: past frame sets it can ask for (default: the training data's "
                        "longest motion question, frames - 1; 0: no time head)")
    p.add_argument("--time-weight", type=float, default=1.0, help="weight of the time head's cross-entropy")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per process")
    p.add_argument("--device", help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    p.set_defaults(func=_run)


def _run(args) -> int:
    if not args.out and not args.model:
        raise InputError("train views: give --out DIR or --model DIR (output goes to <model>/view_selector)")
    if args.model and not Path(args.model).is_dir():
        raise InputError(f"train views: --model {args.model} is not a folder")
    for name in ("keyword_weight", "threshold", "add_threshold", "remove_threshold"):
        if not 0 <= getattr(args, name) <= 1:
            raise InputError(f"train views: --{name.replace('_', '-')} must be in [0, 1]")
    if args.threshold == 0:
        raise InputError("train views: --threshold 0 would keep every camera")
    from ..training.views import train

    train(args)
    return 0
