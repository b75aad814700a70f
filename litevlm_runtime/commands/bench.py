"""`litevlm bench`: per-stage latency (median, p90) over N questions, against transformers'
reference `generate` on the same weights and inputs, in the same run."""

from __future__ import annotations

import json
from pathlib import Path

from ..report import table
from .ask import add_pipeline_args, pipeline_options


def load_frame_sets(frames: Path | None, count: int) -> list[dict]:
    from ..frames import read_frame_set

    if frames is None:
        import numpy as np

        from ..cameras import CAMERAS

        rng = np.random.default_rng(0)
        return [{c: rng.integers(0, 256, (450, 800, 3), dtype=np.uint8) for c in CAMERAS} for _ in range(count)]
    sets = []
    for i in range(count):
        try:
            sets.append(read_frame_set(frames, i))
        except Exception:
            break
    return sets or [read_frame_set(frames, 0)]


def register(subparsers) -> None:
    p = subparsers.add_parser("bench", help="per-stage latency table, against transformers' generate")
    add_pipeline_args(p)
    p.add_argument("--frames", type=Path, help="frame folder (default: random frames)")
    p.add_argument("--frame-sets", type=int, default=2, help="how many frame sets to cycle through")
    p.add_argument("--questions", type=int, default=8, help="how many of the built-in questions")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--no-reference", action="store_true", help="skip the transformers baseline")
    p.add_argument("--json", action="store_true")
    p.add_argument("--backend", help="comma list of backends to run side by side in one table, first = baseline "
                                     "(NAME or NAME=BUNDLE, e.g. torch,onnxruntime=b,onnxruntime=b-int8); "
                                     "one backend keeps the transformers comparison")
    p.add_argument("--bundle", type=Path, help="default export bundle for onnxruntime/tensorrt in --backend")
    p.add_argument("--ablation", action="store_true",
                   help="baseline / +FastV / +EAGLE / LiteVLM on --data questions (needs the model's trained modules)")
    p.add_argument("--data", type=Path, help="DriveLM-format QA json for --ablation (frames from --frames)")
    p.add_argument("--limit", type=int, default=40, help="--ablation: first N questions")
    p.add_argument("--plot", type=Path, help="--ablation: write the per-stage bar chart (PNG) here")
    p.add_argument("--budget", type=float, action="append", metavar="F",
                   help="latency budgets at F x the unbudgeted median on --data questions (repeatable; e.g. 0.5)")
    p.set_defaults(func=run)


def run_ablation_command(args) -> int:
    import json
    import sys

    from ..ablation import ablation_plot, ablation_table, run_ablation
    from ..errors import InputError

    if not args.data or not args.frames:
        raise InputError("--ablation needs --data QA.json and --frames ROOT")
    result = run_ablation(args.model, args.data, args.frames, pipeline_options(args), args.limit,
                          progress=lambda m: print(m, file=sys.stderr))
    if args.plot:
        ablation_plot(result, args.plot)
    print(json.dumps(result, indent=2) if args.json else ablation_table(result))
    if args.plot and not args.json:
        print(f"plot: {args.plot}")
    return 0


def run_budget_command(args) -> int:
    import sys

    from ..budget_bench import budget_table, run_budget_bench
    from ..errors import InputError

    if not args.data or not args.frames:
        raise InputError("--budget needs --data QA.json and --frames ROOT")
    result = run_budget_bench(args.model, args.data, args.frames, pipeline_options(args), args.limit,
                              tuple(args.budget), progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else budget_table(result))
    return 0


def run(args) -> int:
    import sys

    from ..benchmark import DEFAULT_QUESTIONS, run_benchmark
    from ..pipeline import Pipeline

    if args.ablation:
        return run_ablation_command(args)
    if args.budget:
        return run_budget_command(args)
    options = pipeline_options(args)
    if args.backend:
        from ..backend_bench import parse_backends

        backends = parse_backends(args.backend, args.bundle)
        if len(backends) > 1:
            return run_backends(args, options, backends)
        from dataclasses import replace

        _, name, bundle = backends[0]
        options = replace(options, backend=replace(options.backend, name=name,
                                                   bundle=str(bundle) if bundle else options.backend.bundle))
    pipe = Pipeline.from_pretrained(args.model, options)
    frame_sets = load_frame_sets(args.frames, args.frame_sets)
    questions = DEFAULT_QUESTIONS[: args.questions]
    res = run_benchmark(pipe, frame_sets, questions, args.repeat, reference=not args.no_reference,
                        progress=lambda m: print(m, file=sys.stderr))
    s = res.summary()
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    rows = [[stage, v["median"], v["p90"]] for stage, v in s["stages"].items()]
    print(f"model {args.model}  queries {s['queries']}  mean new tokens {s['mean_new_tokens']:.1f}  "
          f"device {options.device} {options.dtype}  pipeline {pipe.rt.options.label()}\n")
    print(table(["stage", "median ms", "p90 ms"], rows))
    if "reference" in s:
        r = s["reference"]
        print()
        print(table(["model time (all but preprocess)", "median ms", "p90 ms"], [
            ["litevlm pipeline", s["model_ms"]["median"], s["model_ms"]["p90"]],
            ["transformers generate", r["median"], r["p90"]],
        ]))
        print(f"\nspeed-up over transformers: {r['speedup_model']:.2f}x   identical answers: {r['identical_answers']}   "
              f"(mean new tokens: ours {s['mean_new_tokens']:.1f}, transformers {r['mean_new_tokens']:.1f})")
    return 0


def run_backends(args, options, backends) -> int:
    """Several backends side by side: one table, a speed-up column against the first."""
    import sys

    from ..backend_bench import build_runs, comparison_table, compare_backends
    from ..benchmark import DEFAULT_QUESTIONS

    runs = build_runs(args.model, options, backends)
    summary = compare_backends(runs, load_frame_sets(args.frames, args.frame_sets), DEFAULT_QUESTIONS[: args.questions],
                               args.repeat, progress=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"model {args.model}  device {options.device} {options.dtype}\n")
    print(comparison_table(summary))
    return 0
