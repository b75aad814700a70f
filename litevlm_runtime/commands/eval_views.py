"""`litevlm eval-views`: a view selector against the keyword map and all six cameras.

    litevlm eval-views --selector DIR --data QA.json [--data ...] [--frames eval|val|all|TOKEN,...]
                       [--fusion RULE] [--threshold T] [--json] [--bench]

On the same questions: the selector under its fusion rule, the same architecture at its random
initialisation, the keyword map alone (at the selector's keyword threshold, and with only its
certain cameras) and all six cameras; then camera x time: the share of motion questions (items with
"frames" > 1) for which past frame sets are chosen and of the others for which none are, by the
selector's time selection, its time head alone and the time cue alone. `--frames eval` (the
default) takes the frames held out when the selector was trained, as recorded in its config.json.
Metric definitions:
litevlm_runtime.training.views.selection_metrics.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from ..errors import InputError
from ..options import FUSION_RULES


def register(subparsers) -> None:
    p = subparsers.add_parser("eval-views", help="evaluate a view selector on DriveLM-format QA")
    p.add_argument(
        "--selector", required=True, help="view selector folder (config.json, model.safetensors, tokenizer.json)"
    )
    p.add_argument(
        "--data", action="append", required=True, metavar="QA.json", help="DriveLM-format QA file (repeatable)"
    )
    p.add_argument(
        "--frames",
        default="eval",
        help="'eval' (the frames held out when the selector was trained), 'val' (its validation frames), "
             "'all' key frames, or a comma-separated list",
    )
    p.add_argument("--fusion", choices=FUSION_RULES, help="override the saved fusion rule")
    p.add_argument("--keyword-weight", type=float, help="override the saved fusion weight (weighted)")
    p.add_argument("--threshold", type=float, help="override the saved keyword threshold")
    p.add_argument("--add-threshold", type=float, help="override the saved add threshold")
    p.add_argument("--remove-threshold", type=float, help="override the saved remove threshold")
    p.add_argument("--json", action="store_true", help="print the metrics as JSON")
    p.add_argument("--bench", action="store_true",
                   help="also time one-question selection (selector vs keyword map alone) on these questions")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.set_defaults(func=_run)


def _bench(selector, questions: list[str]) -> str:
    """Median/p90 milliseconds per single-question selection, selector vs keyword map alone."""
    from ..stages.view_selector import Fusion, fuse, keyword_map, tagged_cameras

    def keyword_only(q):
        return fuse(keyword_map(q), None, tagged_cameras(q), Fusion(threshold=selector.fusion.threshold))

    rows = {}
    for name, fn in (("keyword map only", keyword_only), ("selector (tokenize+model+fuse)", selector.explain)):
        for q in questions[:10]:
            fn(q)  # warm-up
        times = []
        for q in questions:
            t0 = time.perf_counter()
            fn(q)
            times.append((time.perf_counter() - t0) * 1e3)
        times.sort()
        rows[name] = (statistics.median(times), times[int(0.9 * (len(times) - 1))])
    base = rows["keyword map only"][0]
    lines = [f"{'selection, one question':<32} {'median ms':>9} {'p90 ms':>8} {'x keyword':>9}"]
    for name, (med, p90) in rows.items():
        lines.append(f"{name:<32} {med:>9.3f} {p90:>8.3f} {med / base:>9.1f}")
    return "\n".join(lines)


def _run(args) -> int:
    import torch

    from ..evaluation.views import compare, compare_time, format_table, format_time_table, load_qa
    from ..stages.view_selector import CONFIG_FILE, LoadedViewSelector, ViewSelector, load_view_selector

    torch.set_num_threads(args.threads)
    selector = load_view_selector(args.selector, keyword_weight=args.keyword_weight, threshold=args.threshold,
                                  fusion_rule=args.fusion, add_threshold=args.add_threshold,
                                  remove_threshold=args.remove_threshold)
    config = json.loads((Path(args.selector) / CONFIG_FILE).read_text())
    training = config.get("training", {})
    records = load_qa(args.data)
    if args.frames in ("eval", "val"):
        frames = set(training.get(f"{args.frames}_frames") or [])
        if not frames:
            what = "held-out" if args.frames == "eval" else "validation"
            raise InputError(
                f"{args.selector}: no {what} frames recorded in its config.json (give --frames all or a list)"
            )
    elif args.frames == "all":
        frames = {r.frame for r in records}
    else:
        frames = {f.strip() for f in args.frames.split(",") if f.strip()}
    records = [r for r in records if r.frame in frames]
    seen = {r.frame for r in records} - set(training.get("eval_frames") or [])
    if seen and training:
        print(f"note: {len(seen)} of these frames are not among the frames held out when this selector was "
              "trained: it was trained or tuned on them if they are in its training data", file=sys.stderr)
    if not records:
        raise InputError(f"eval-views: none of the frames {sorted(frames)} are in {args.data}")

    # The untrained baseline: the same architecture at the initialisation its training started
    # from (training seeds torch right before building the model).
    torch.manual_seed(int(training.get("seed", 0)))
    untrained = LoadedViewSelector(ViewSelector(selector.cfg), selector.tokenizer)
    rows = compare(selector, untrained, records)
    time_rows = compare_time(selector, records)
    if args.json:
        print(json.dumps({"frames": sorted({r.frame for r in records}), "metrics": rows, "time": time_rows},
                         indent=2))
    else:
        shown = sorted({r.frame for r in records})
        print(f"{len(records)} questions from {len(shown)} key frame(s) "
              f"({', '.join(shown[:8])}{' ...' if len(shown) > 8 else ''}); fusion: {selector.fusion.describe()}")
        print(format_table(rows))
        print()
        print(format_time_table(time_rows))
    if args.bench:
        print()
        print(f"{len(records)} questions, torch threads {torch.get_num_threads()}")
        print(_bench(selector, [r.question for r in records]))
    return 0
