"""`litevlm fleet eval|compare|bench`: regression over many bags on Ray (litevlm_runtime/fleet/).

  eval     BAGS... --out RUN [--params P] [--set K=V] [--ray ADDRESS] [--workers N]
           each bag as `bag eval` evaluates it, on a pool of Ray actors; answers as Parquet,
           partitioned by bag, plus RUN/manifest.json; a rerun of RUN resumes; exit 1 if a bag failed
  compare  RUN_A RUN_B --report DIR [--max-accuracy-drop X] [--max-p99-ratio Y]
           scores, changed answers, status changes, latency; HTML + PNG + summary.json; exit 1
           past a threshold
  bench    BAGS... --workers 1,2 [--ray auto]   wall time of each pool size on the same bags, alternating
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import InputError
from .node_params import add_node_param_flags, overrides


def _params(args) -> dict:
    from ..ros.params_file import load_node_params

    return load_node_params(args.params, overrides(args))


def _config(args, out: Path, **kw):
    from ..fleet.run import FleetConfig
    from ..fleet.sources import expand_bags

    return FleetConfig(bags=expand_bags(args.bags), out=out, params=_params(args),
                       params_file=str(args.params or ""), overrides=overrides(args),
                       ground_truth=[str(g) for g in args.ground_truth], ray_address=args.ray,
                       threads=args.threads, gpus_per_worker=args.gpus_per_worker,
                       max_attempts=args.max_attempts, **kw)


def cmd_eval(args) -> int:
    from ..fleet.run import run_fleet

    if args.workers is not None and args.workers < 0:
        raise InputError(f"--workers must be >= 0, got {args.workers}")
    cfg = _config(args, args.out, workers=args.workers, progress=not args.quiet)
    result = run_fleet(cfg)
    where = "in-process" if result.workers == 0 else f"{result.workers} worker(s) x {result.threads} thread(s)"
    print(f"fleet eval: {len(result.complete)} bag(s) evaluated, {len(result.skipped)} already finished, "
          f"{len(result.failed)} failed; {result.answers} answers in {result.wall_s:.1f} s ({where}) -> {args.out}")
    for key, reason in result.failed.items():
        print(f"  FAILED {key}: {reason}")
    return result.exit_code


def cmd_compare(args) -> int:
    from ..fleet.compare import Thresholds, compare_runs
    from ..fleet.report import write_report

    thresholds = Thresholds(max_accuracy_drop=args.max_accuracy_drop, max_p99_ratio=args.max_p99_ratio,
                            max_language_drop=args.max_language_drop, max_changed=args.max_changed,
                            max_failed=args.max_failed)
    cmp = compare_runs(args.a, args.b, thresholds, lenient=args.lenient, stage=args.latency_stage)
    paths = write_report(cmp, args.report, thumbnails=not args.no_thumbnails, max_changes=args.max_shown)
    print(cmp.text_summary())
    print(f"fleet compare: report {paths['html']}, summary {paths['summary']}")
    if cmp.violations:
        for v in cmp.violations:
            print(f"  THRESHOLD {v}")
        return 1
    return 0


def cmd_bench(args) -> int:
    from ..fleet.bench import scaling

    sizes = [int(v) for v in args.workers.split(",")]
    table, ok = scaling(lambda out, n: _config(args, out, workers=n, progress=False), sizes, args.out,
                        rounds=args.rounds, versus_bag_eval=args.versus_bag_eval)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(ok, indent=1))
    return 0 if ok["identical"] else 1


def _common(p, bags: bool = True) -> None:
    if bags:
        p.add_argument("bags", nargs="+", metavar="BAGS",
                       help="bag folders, .mcap/.db3 files, or text files listing them (one per line)")
    add_node_param_flags(p, model=True)
    p.add_argument("--ground-truth", action="append", default=[], type=Path, metavar="DIR",
                   help="a DriveLM-layout folder (QA json + samples/) the bags were made from: answers get its "
                        "reference (repeatable)")
    p.add_argument("--ray", metavar="ADDRESS",
                   help="a running Ray cluster (auto, or HOST:PORT); default: start a local one sized to this machine")
    p.add_argument("--threads", type=int, help="torch threads (and Ray CPUs) per worker (default: the CPUs divided "
                                               "among the workers)")
    p.add_argument("--gpus-per-worker", type=float, default=0.0, help="GPUs each worker reserves (with device=cuda)")
    p.add_argument("--max-attempts", type=int, default=3,
                   help="times a bag is tried when its worker dies under it (a corrupt bag fails at once)")


def register(subparsers) -> None:
    fleet = subparsers.add_parser("fleet", help="regression over many bags on Ray: eval, compare, bench")
    sub = fleet.add_subparsers(dest="fleet_command", required=True)

    p = sub.add_parser("eval", help="evaluate many bags as `bag eval` does, on a pool of Ray actors")
    _common(p)
    p.add_argument("--out", type=Path, required=True, help="the run folder (a rerun resumes it)")
    p.add_argument("--workers", type=int,
                   help="actors in the pool (default: one per --threads CPUs of the cluster); 0: in-process, no Ray")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("compare", help="two runs side by side: HTML report, summary.json, exit 1 past thresholds")
    p.add_argument("a", type=Path, metavar="RUN_A", help="the reference run (e.g. the release)")
    p.add_argument("b", type=Path, metavar="RUN_B", help="the candidate run")
    p.add_argument("--report", type=Path, required=True, help="folder for index.html, the PNGs and summary.json")
    p.add_argument("--max-accuracy-drop", type=float, help="fail when B's accuracy is lower than A's by more")
    p.add_argument("--max-language-drop", type=float, help="fail when B's language score is lower by more")
    p.add_argument("--max-p99-ratio", type=float, help="fail when B's p99 total latency / A's exceeds this")
    p.add_argument("--max-changed", type=float, help="fail when more than this fraction of answers changed")
    p.add_argument("--max-failed", type=int, help="fail when B has more failed bags than this")
    p.add_argument("--latency-stage", default="total", help="the latency the p99 gate reads (total or a stage)")
    p.add_argument("--lenient", action="store_true", help="score with the project's lenient rules (litevlm eval --lenient)")
    p.add_argument("--no-thumbnails", action="store_true", help="do not read the bags for camera thumbnails")
    p.add_argument("--max-shown", type=int, default=200, help="changed answers shown in the HTML (all are in summary.json)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("bench", help="wall time of pools of N workers on the same bags, alternating, as a table")
    _common(p)
    p.add_argument("--workers", default="1,2", help="pool sizes to time, comma-separated (the first is the baseline)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the sizes alternately this often")
    p.add_argument("--out", type=Path, required=True, help="a folder for the runs (one per size and round)")
    p.add_argument("--json", type=Path, help="also write the measurements here")
    p.add_argument("--versus-bag-eval", action="store_true",
                   help="also evaluate each bag as `bag eval` does (a fresh pipeline per bag) and compare the answers")
    p.set_defaults(func=cmd_bench)
