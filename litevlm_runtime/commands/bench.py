"""`litevlm bench`: per-stage latency (median, p90) over N questions, against transformers'
reference `generate` on the same weights and inputs, in the same run."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from ..errors import InputError
from ..frames import load_frame_sets
from ..report import table
from .ask import pipeline_options


def register(subparsers) -> None:
    from ..options import add_option_flags
    from ..weights.presets import PRESETS

    p = subparsers.add_parser("bench", help="per-stage latency table, against transformers' generate")
    model = p.add_mutually_exclusive_group()
    model.add_argument("--model", type=Path, help="InternVL2.5 checkpoint folder")
    model.add_argument("--preset", choices=PRESETS, help="random weights of a preset's shape, in memory "
                                                        "(e.g. internvl2_5-2b: what the real sizes cost here)")
    add_option_flags(p, with_model=False)
    p.add_argument("--frames", type=Path, help="frame folder (default: random frames)")
    p.add_argument("--frame-sets", type=int, default=2, help="how many frame sets to cycle through")
    p.add_argument("--questions", type=int, help="how many of the built-in questions (default 8; --peers --whole: "
                                                 "DriveLM sample questions, default 4)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--no-reference", action="store_true", help="skip the transformers baseline")
    p.add_argument("--json", nargs="?", const="-", metavar="OUT",
                   help="print JSON instead of the table (--peers: also the table; with OUT, write the rows there)")
    p.add_argument("--backend", help="comma list of backends to run side by side in one table, first = baseline "
                                     "(NAME or NAME=BUNDLE, e.g. torch,onnxruntime=b,onnxruntime=b-int8,openvino=b,"
                                     "openvino:int8=b: OpenVINO with NNCF int8 weights); "
                                     "one backend keeps the transformers comparison")
    p.add_argument("--bundle", type=Path, help="default export bundle for onnxruntime/openvino/tensorrt in --backend")
    p.add_argument("--ablation", action="store_true",
                   help="baseline / +FastV / +EAGLE / LiteVLM on --data questions (needs the model's trained modules)")
    p.add_argument("--temporal", type=int, metavar="K",
                   help="frame sets over time: 1 set vs K sets with every token vs K sets with temporal token "
                        "selection on --data's closed-form motion questions, the window warm: vision, prefill rows, "
                        "accuracy (bench/temporal.py)")
    p.add_argument("--data", type=Path, help="DriveLM-format QA json for --ablation (frames from --frames)")
    p.add_argument("--limit", type=int, default=40, help="--ablation, --temporal: first N questions")
    p.add_argument("--plot", type=Path, help="--ablation, --peers --whole: write the bar chart (PNG) here")
    p.add_argument("--costs", action="store_true",
                   help="the speculation cost table measured on this device and backend, and the tree the policy "
                        "chooses from it (decodes with EAGLE-2; with --preset, a random draft head)")
    p.add_argument("--roofline", action="store_true",
                   help="each stage's time against the floor the measured memory bandwidth and peak FLOP/s allow "
                        "(bench/roofline.py); --weights float,int8 alternates the decoder's weights in one process")
    p.add_argument(
        "--weights", help="--roofline: comma list of backend.weights kinds to alternate (e.g. float,int8,bf16); "
                          "--peers: this project's forms (default float,int8,int4; int4 is AWQ where the model has "
                          "quantized-int4, else int4-rtn)"
    )
    p.add_argument("--context", type=int, help="--roofline: cached rows a decode step attends to (default: a real "
                                               "query's prompt; 256 with --preset)")
    p.add_argument("--stages", help="--roofline: comma list of step, head, prefill, vision (default all; "
                                    "step,head with --preset: a 2B prefill or vision pass takes minutes here)")
    p.add_argument("--budget", type=float, action="append", metavar="F",
                   help="latency budgets at F x the unbudgeted median on --data questions (repeatable; e.g. 0.5)")
    p.add_argument("--contention", action="store_true",
                   help="p50/p99 quiet and beside --hog busy processes, per --threads-configs (contention.py)")
    p.add_argument("--hog", type=int, help="--contention: busy processes in the loaded condition (default: the cores); "
                                          "--peers: also run every row beside this many busy processes")
    p.add_argument("--hog-kind", default="spin", help="--contention: spin (a Python loop) | matmul (numpy, one thread)")
    p.add_argument("--threads-configs", default="default,torch+spin,half+spin,1",
                   help="--contention: comma list of THREADS[+passive|+active|+spin], THREADS = default | torch | "
                        "half | N (default: the shipped default, torch's own, the one before passive waiting, 1)")
    p.add_argument("--rounds", type=int, default=1, help="--contention: quiet/loaded pairs per configuration; --peers: "
                                                      "alternating rounds of every row")
    p.add_argument("--memory", action="store_true",
                   help="the memory plan for the car: InternVL2.5-2B and InternVL3-2B (or --preset) at 12 tiles, "
                        "weights / TensorRT workspace / arena / KV per batch region and conversation for FP16, FP8, "
                        "INT4 weights and FP16, FP8 KV, against the paper's Thor figures (bench/memory.py; computed, "
                        "no GPU needed)")
    p.add_argument("--reserved-gib", type=float, default=40.0,
                   help="--memory: GiB of a 64 GB DRIVE Thor the rest of the driving stack keeps (an assumption: "
                        "perception, planning, sensor buffers, OS)")
    add_peer_flags(p)
    p.add_argument("--study", nargs=argparse.REMAINDER, metavar="NAME [ARGS]",
                   help="a measuring study with its own flags, everything after NAME (bench/studies/; "
                        "`--study list` lists them, `--study NAME --help` shows a study's flags)")
    p.set_defaults(func=run)


def add_peer_flags(p) -> None:
    """`--peers` and its flags (bench/peers/command.py reads them)."""
    peers = p.add_argument_group("--peers: the engines users run instead, same weights, one run (bench/peers/)")
    peers.add_argument("--peers", action="store_true",
                       help="this project against llama.cpp and OpenVINO GenAI at their own defaults, each row in its "
                            "own process (slow; `bash scripts/setup.sh --peers` installs the peers): the decode step "
                            "table, or with --whole whole six-camera DriveLM questions")
    peers.add_argument("--whole", action="store_true", help="--peers: whole questions with images (TTFT, total, "
                                                            "vision, prefill, decode, peak RSS, agreement)")
    peers.add_argument("--threads", type=int, default=2, help="--peers: threads of every row (default 2)")
    peers.add_argument("--engines", help="--peers: comma list of litevlm, llama.cpp, openvino (default all)")
    peers.add_argument("--gguf", help="--peers: llama.cpp text model forms, comma list of f16, q8_0, q4_0 "
                                      "(default all; the mmproj is F16)")
    peers.add_argument("--openvino", help="--peers: OpenVINO weight compressions, comma list of int8, int4 "
                                          "(default both)")
    peers.add_argument("--pipelines", help="--peers --whole: this project's pipelines, baseline,litevlm (default both)")
    peers.add_argument("--new-tokens", type=int, default=32, help="--peers --whole: answer length cap (default 32)")
    peers.add_argument("--llama-preprocess", choices=("tile", "mtmd"), default="tile",
                       help="--peers --whole: llama.cpp's images: tile (default: each JPEG decoded and resized to "
                            "the one tile by PIL, bicubic, as upstream InternVL does) | mtmd (libmtmd decodes and "
                            "preprocesses: tile + overview, 2 tiles per camera)")
    peers.add_argument("--drivelm", type=Path, help="--peers --whole: the DriveLM sample folder (default "
                                                   "../shared/drivelm_sample)")
    peers.add_argument("--cache", type=Path, help="--peers: folder for checkpoints and the peers' files, reused by "
                                                  "later runs, keyed by the weights' digest (default "
                                                  "/tmp/litevlm-peers; ~20 GB at internvl3-2b)")
    peers.add_argument("--seed", type=int, default=0, help="--peers --preset: the random weights' seed")
    peers.add_argument("--prompt", type=int, default=256, help="--peers (decode table): prompt ids before decoding")
    peers.add_argument("--tokens", type=int, default=32, help="--peers (decode table): greedy steps per round")


def run_ablation_command(args) -> int:
    from ..bench.ablation import ablation_plot, ablation_table, run_ablation

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


def run_temporal_command(args) -> int:
    from ..bench.temporal import run_temporal, temporal_table

    if not args.data or not args.frames:
        raise InputError("--temporal needs --data QA.json (a set in motion) and --frames ROOT")
    if args.temporal < 2:
        raise InputError(f"--temporal {args.temporal}: at least 2 frame sets")
    result = run_temporal(args.model, args.data, args.frames, pipeline_options(args), args.temporal, args.limit,
                          progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else temporal_table(result))
    return 0


def build_pipeline(args, options):
    from ..pipeline.pipeline import Pipeline

    if args.preset:
        from ..bench.random_model import random_pipeline

        return random_pipeline(args.preset, options)
    return Pipeline.from_pretrained(args.model, options)


def run_costs_command(args) -> int:
    from ..bench.policy import policy_choice
    from ..bench.roofline import decode_step_line
    from ..decoding.spec_policy import measure_costs
    from ..options import options_from_flat

    options = pipeline_options(args)
    options = options_from_flat({"decoding.mode": "eagle"} if options.decoding.mode.value == "auto" else {}, options)
    pipe = build_pipeline(args, options)
    rt = pipe.rt
    if args.preset:
        # Random weights: no answer worth running (and a 2B prefill takes minutes on a CPU); the
        # costs at a prompt of 256 rows are what the policy needs.
        context, learned = 256, None
    else:
        ans = pipe.warm_up(load_frame_sets(args.frames, 1)[0])
        context, learned = ans.input_tokens, rt.costs
    costs = measure_costs(rt, context=context, repeats=2 if args.preset else 5)
    costs.carry_over(learned)
    tree = rt.options.decoding.eagle
    print(f"model {rt.name}  device {rt.options.device} {rt.options.dtype}  backend {rt.options.backend.name.value}  "
          f"{rt.options.threads()} threads  context {context} rows\n")
    print(table(["measured", "ms", "x plain step"], costs.table()))
    print()
    print(table(["adaptive policy", ""], policy_choice(costs, tree)))
    print("\n" + decode_step_line(rt, context))
    return 0


def run_roofline_command(args) -> int:
    from ..bench.roofline import RooflineStages, roofline_table, run_roofline

    options = pipeline_options(args)
    pipe = build_pipeline(args, options)
    rt = pipe.rt
    weights = [w.strip() for w in (args.weights or options.backend.weights).split(",") if w.strip()]
    if args.context:
        context = args.context
    elif args.preset:
        context = 256
    else:
        context = pipe.warm_up(load_frame_sets(args.frames, 1)[0]).input_tokens
    stages = tuple(s.strip() for s in (args.stages or ("step,head" if args.preset else "vision,prefill,step,head"))
                   .split(",") if s.strip())
    measured = RooflineStages(stages, context, context, rt.arena.pixels.shape[0])
    result = run_roofline(pipe, weights, measured, rounds=max(5, args.repeat),
                          progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else roofline_table(result))
    return 0


def run_budget_command(args) -> int:
    from ..bench.budget import budget_table, run_budget_bench

    if not args.data or not args.frames:
        raise InputError("--budget needs --data QA.json and --frames ROOT")
    result = run_budget_bench(args.model, args.data, args.frames, pipeline_options(args), args.limit,
                              tuple(args.budget), progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(result, indent=2) if args.json else budget_table(result))
    return 0


def run_contention_command(args) -> int:
    from ..bench.benchmark import DEFAULT_QUESTIONS
    from ..bench.contention import Workload, contention_table, parse_configs, run_contention

    if args.rounds < 1:
        raise InputError(f"--rounds {args.rounds}: must be 1 or more")
    workload = Workload(DEFAULT_QUESTIONS[: args.questions], args.frames, args.frame_sets, args.repeat)
    summary = run_contention(args.model, pipeline_options(args), parse_configs(args.threads_configs), workload,
                             args.hog, args.hog_kind, args.rounds, progress=lambda m: print(m, file=sys.stderr))
    print(json.dumps(summary, indent=2) if args.json else contention_table(summary))
    return 0


def run_memory_command(args) -> int:
    from ..bench.memory import MEMORY_HEADER, PRESETS, THOR_GIB, memory_rows, memory_table_rows

    presets = [args.preset] if args.preset else list(PRESETS)
    tiles = int(getattr(args, "opt:tiles_per_camera", None) or 2)
    rows = [r for name in presets for r in memory_rows(name, args.reserved_gib, tiles_per_camera=tiles)]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    first = rows[0]
    print(f"memory plan: 6 cameras x {tiles} tiles, FP16 activations, serving.max_batch {first['batch']} KV regions + "
          f"serving.conversations {first['conversations']} turns + the prompt prefix, max_len {first['max_len']} rows "
          f"per region; the VLM's share of a {THOR_GIB} GB Thor: {THOR_GIB - args.reserved_gib:g} GiB (assumed: the "
          f"rest of the driving stack keeps {args.reserved_gib:g} GiB)")
    print(table(MEMORY_HEADER, memory_table_rows(rows)))
    return 0


def run(args) -> int:
    if args.study is not None:
        from ..bench.studies import run_study

        return run_study(args.study)
    if args.memory:
        return run_memory_command(args)
    if args.peers or args.whole:
        from ..bench.peers.command import run_peers  # (imports the peers' packages only when asked)

        if not args.peers:
            raise InputError("--whole belongs to --peers: litevlm bench --peers --whole ...")
        return run_peers(args)
    if args.questions is None:
        args.questions = 8
    if not args.model and not args.preset:
        raise InputError("litevlm bench: --model or --preset is required (--memory needs neither)")
    if args.costs:
        return run_costs_command(args)
    if args.roofline:
        return run_roofline_command(args)
    if args.preset:
        if args.ablation or args.budget or args.backend or args.contention or args.temporal:
            raise InputError("--preset (random weights) runs the latency table and --costs; --ablation, --budget, "
                             "--contention and --backend need a trained --model")
        args.no_reference = True      # no checkpoint folder for transformers to load
    if args.ablation:
        return run_ablation_command(args)
    if args.temporal:
        return run_temporal_command(args)
    if args.budget:
        return run_budget_command(args)
    if args.contention:
        return run_contention_command(args)
    return run_latency_command(args)


def run_latency_command(args) -> int:
    """The default: per-stage latency of the pipeline (and of transformers, unless --no-reference), or
    several --backend side by side."""
    from ..bench.benchmark import DEFAULT_QUESTIONS, run_benchmark

    options = pipeline_options(args)
    if args.backend:
        from ..bench.backends import backend_options, parse_backends

        backends = parse_backends(args.backend, args.bundle)
        if len(backends) > 1:
            return run_backends(args, options, backends)
        options = backend_options(options, backends[0])
    pipe = build_pipeline(args, options)
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
          f"device {options.device} {options.dtype}  pipeline {pipe.rt.options.label()}  backend "
          f"{pipe.rt.engines.backend}  weights {options.backend.weights}"
          + (f" (prompt GEMM {pipe.rt.weights.prefill})" if pipe.rt.weights and pipe.rt.weights.prefill else "")
          + f"  float32 GEMM {pipe.rt.gemm}  vision GEMM {pipe.rt.vision_gemm}\n")
    print(table(["stage", "median ms", "p90 ms"], rows))
    print_latency_extras(pipe.rt, s, res)
    return 0


def print_latency_extras(rt, s: dict, res) -> None:
    """Below the latency table: compile times, the decode step's floor, the speculation costs and
    policy, the rounds it chose, and the comparison with transformers."""
    from ..bench.policy import policy_choice
    from ..bench.roofline import decode_step_line

    seconds = getattr(rt.engines.decoder, "compile_seconds", None)
    if seconds:
        print(
            f"\ncompiled at start-up ({rt.engines.backend}): "
            + ", ".join(f"{stage} {s:.1f} s" for stage, s in seconds.items())
            + f"; total {sum(seconds.values()):.1f} s"
        )
    print("\n" + decode_step_line(rt, round(statistics.median(res.input_tokens))))
    if rt.costs is not None and rt.costs.source == "measured":
        print("\nspeculation costs measured at warm-up on this device and backend:")
        print(table(["measured", "ms", "x plain step"], rt.costs.table()))
        print()
        print(table(["adaptive policy", ""], policy_choice(rt.costs, rt.options.decoding.eagle)))
    if "eagle_rounds" in s:
        print("\ndecode rounds the policy chose (count):")
        print(table(["round", "count"], [[k, v] for k, v in s["eagle_rounds"].items()]))
    if "reference" in s:
        r = s["reference"]
        print()
        print(table(["model time (all but preprocess)", "median ms", "p90 ms"], [
            ["litevlm pipeline", s["model_ms"]["median"], s["model_ms"]["p90"]],
            ["transformers generate", r["median"], r["p90"]],
        ]))
        print(
            f"\nspeed-up over transformers: {r['speedup_model']:.2f}x   identical answers: {r['identical_answers']}   "
            f"(mean new tokens: ours {s['mean_new_tokens']:.1f}, transformers {r['mean_new_tokens']:.1f})"
        )
        print(f"query by query (paired): median {r['speedup_paired_median']:.2f}x "
              f"(min {r['speedup_paired_min']:.2f}x, max {r['speedup_paired_max']:.2f}x); "
              f"whole run (total time): {r['speedup_total']:.2f}x")


def run_backends(args, options, backends) -> int:
    """Several backends side by side: one table, a speed-up column against the first."""

    from ..bench.backends import build_runs, compare_backends, comparison_table
    from ..bench.benchmark import DEFAULT_QUESTIONS

    runs = build_runs(args.model, options, backends)
    summary = compare_backends(runs, load_frame_sets(args.frames, args.frame_sets), DEFAULT_QUESTIONS[: args.questions],
                               args.repeat, progress=lambda m: print(m, file=sys.stderr))
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"model {args.model}  device {options.device} {options.dtype}\n")
    print(comparison_table(summary))
    return 0
