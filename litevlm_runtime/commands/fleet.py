"""`litevlm fleet eval|compare|regress|submit|bench`: regression over many bags on Ray
(litevlm_runtime/fleet/). BAGS, RUN and report folders are local paths or URIs (s3://, gs://, ...).

  eval     BAGS... --out RUN [--params P] [--set K=V] [--ray ADDRESS] [--workers N] [--explain]
           each bag as `bag eval` evaluates it, on a pool of Ray actors; answers as Parquet,
           partitioned by bag, plus RUN/manifest.json; a rerun of RUN resumes; exit 1 if a bag failed;
           --explain stores every answer's explanation picture (JPEG) for compare's report
  compare  RUN_A RUN_B --report DIR [--max-accuracy-drop X] [--max-p99-ratio Y] [--allow-lost]
           scores, changed answers, status changes, latency; HTML + PNG + summary.json; exit 1
           past a threshold (B losing bags or answers A has is one, unless --allow-lost)
  regress  BAGS... --baseline RUN_A --out RUN_B --report DIR [gates]   eval, then compare: one
           command for a job
  submit   [--address http://HEAD:8265] [--ship-code] -- regress|eval|compare ARGS...   the command
           as a Ray job on the cluster (Ray Jobs API); its logs stream here; its exit code is ours
  bench    BAGS... --workers 1,2 [--ray auto]   wall time of each pool size on the same bags, alternating

Output: progress on stderr, results (summaries) on stdout.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import InputError
from .node_params import add_node_param_flags, overrides

SUBMITTABLE = ("regress", "eval", "compare")


def _overrides(args) -> dict:
    """--set and --model, and --explain as explain=always (every answer explained: fleet/worker.py)."""
    return overrides(args) | ({"explain": "always"} if getattr(args, "explain", False) else {})


def _params(args) -> dict:
    from ..ros.params_file import load_node_params

    return load_node_params(args.params, _overrides(args))


def _config(args, out: Path, **kw):
    from ..fleet.run import FleetConfig
    from ..fleet.sources import expand_bags

    return FleetConfig(bags=expand_bags(args.bags), out=out, params=_params(args),
                       params_file=str(args.params or ""), overrides=_overrides(args),
                       ground_truth=[str(g) for g in args.ground_truth], ray_address=args.ray,
                       threads=args.threads, gpus_per_worker=args.gpus_per_worker,
                       max_attempts=args.max_attempts, restart_wait_s=args.restart_wait, **kw)


def _eval(args) -> int:
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


def cmd_eval(args) -> int:
    return _eval(args)


def _compare(args, run_a: str, run_b: str) -> int:
    from ..fleet.compare import Thresholds, compare_runs
    from ..fleet.report import write_report

    thresholds = Thresholds(max_accuracy_drop=args.max_accuracy_drop, max_p99_ratio=args.max_p99_ratio,
                            max_language_drop=args.max_language_drop, max_changed=args.max_changed,
                            max_failed=args.max_failed, allow_lost=args.allow_lost)
    cmp = compare_runs(run_a, run_b, thresholds, lenient=args.lenient, stage=args.latency_stage)
    paths = write_report(cmp, args.report, thumbnails=not args.no_thumbnails, max_changes=args.max_shown)
    print(cmp.text_summary())
    print(f"fleet compare: report {paths['html']}, summary {paths['summary']}")
    if cmp.violations:
        for v in cmp.violations:
            print(f"  THRESHOLD {v}")
        return 1
    return 0


def cmd_compare(args) -> int:
    return _compare(args, args.a, args.b)


def cmd_regress(args) -> int:
    """eval B, then compare A with B: the exit code is the comparison's (a bag B failed is a bag it
    lost, which fails the gate unless --allow-lost), or eval's when it could not run."""
    _eval(args)             # its failed bags are in the comparison (lost bags, failures)
    return _compare(args, args.baseline, args.out)


def cmd_submit(args) -> int:
    from ..fleet.job import dashboard_address, runtime_env, submit

    command = list(args.job_command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command or command[0] not in SUBMITTABLE:
        raise InputError(f"fleet submit: give the fleet command to run after --: one of {', '.join(SUBMITTABLE)} "
                         f"(got {' '.join(command) or 'nothing'})")
    _submission_parser().parse_args(command)          # refused here, not in the job, if malformed
    env = json.loads(args.runtime_env_json) if args.runtime_env_json else {}
    address, given = dashboard_address(args.address)
    result = submit(address, given, command, runtime_env(args.ship_code, env), wait=not args.no_wait,
                    submission_id=args.submission_id, entrypoint_num_cpus=args.entrypoint_num_cpus)
    if args.no_wait:
        print(result.job_id)
    else:
        print(f"fleet submit: job {result.job_id} {result.status} (exit code {result.exit_code})")
    return result.exit_code


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
    p.add_argument("--restart-wait", type=float, default=300.0, metavar="S",
                   help="seconds a lost worker's actor may take to be placed and loaded again before it counts as "
                        "gone (a replacement node: minutes)")


def _eval_flags(p) -> None:
    _common(p)
    p.add_argument("--out", required=True, help="the run folder or URI (s3://bucket/runs/rc3); a rerun resumes it")
    p.add_argument("--workers", type=int,
                   help="actors in the pool (default: one per --threads CPUs of the cluster); 0: in-process, no Ray")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--explain", action="store_true",
                   help="store each answer's explanation picture (JPEG, column explanation_jpeg): `fleet compare` "
                        "shows both runs' pictures of a changed answer side by side; --set explain=always")


def _compare_flags(p) -> None:
    p.add_argument("--report", required=True, help="folder or URI for index.html, the PNGs and summary.json")
    p.add_argument("--max-accuracy-drop", type=float, help="fail when B's accuracy is lower than A's by more")
    p.add_argument("--max-language-drop", type=float, help="fail when B's language score is lower by more")
    p.add_argument("--max-p99-ratio", type=float, help="fail when B's p99 total latency / A's exceeds this")
    p.add_argument("--max-changed", type=float, help="fail when more than this fraction of answers changed")
    p.add_argument("--max-failed", type=int, help="fail when B has more failed bags than this")
    p.add_argument("--allow-lost", action="store_true",
                   help="do not fail when B lost bags or answers that A has (failed or missing in B)")
    p.add_argument("--latency-stage", default="total", help="the latency the p99 gate reads (total or a stage)")
    p.add_argument("--lenient", action="store_true",
                   help="score with the project's lenient rules (litevlm eval --lenient)")
    p.add_argument("--no-thumbnails", action="store_true", help="do not read the bags for camera thumbnails")
    p.add_argument("--max-shown", type=int, default=200,
                   help="changed answers shown in the HTML (all are in summary.json)")


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="evaluate many bags as `bag eval` does, on a pool of Ray actors")
    _eval_flags(p)
    p.set_defaults(func=cmd_eval)


def _add_compare(sub) -> None:
    p = sub.add_parser("compare", help="two runs side by side: HTML report, summary.json, exit 1 past thresholds")
    p.add_argument("a", metavar="RUN_A", help="the reference run (e.g. the release): a folder or URI")
    p.add_argument("b", metavar="RUN_B", help="the candidate run")
    _compare_flags(p)
    p.set_defaults(func=cmd_compare)


def _add_regress(sub) -> None:
    p = sub.add_parser("regress", help="eval the bags into RUN_B, then compare the baseline RUN_A with it (a job's one "
                                       "command)")
    _eval_flags(p)
    p.add_argument("--baseline", required=True, metavar="RUN_A", help="the reference run to compare with")
    _compare_flags(p)
    p.set_defaults(func=cmd_regress)


class _Refusing(argparse.ArgumentParser):
    def error(self, message: str):
        raise InputError(f"fleet submit: the command for the job is malformed: {message}")


def _add_job_commands(sub) -> None:
    """The sub-commands a job can run: the CLI's and the submission check's one list."""
    _add_eval(sub)
    _add_compare(sub)
    _add_regress(sub)


def _submission_parser() -> argparse.ArgumentParser:
    """The parser a submitted command line must pass (the job runs `litevlm fleet` with it)."""
    parser = _Refusing(prog="litevlm fleet")
    _add_job_commands(parser.add_subparsers(dest="fleet_command", required=True))
    return parser


def register(subparsers) -> None:
    fleet = subparsers.add_parser("fleet", help="regression over many bags on Ray: eval, compare, bench")
    sub = fleet.add_subparsers(dest="fleet_command", required=True)
    _add_job_commands(sub)

    p = sub.add_parser("submit", help="run a fleet command as a Ray job on the cluster (Ray Jobs API)")
    p.add_argument("--address", help="the Jobs API (the dashboard): http://HEAD:8265; default: RAY_API_SERVER_ADDRESS, "
                                     "or RAY_ADDRESS when it is an http address")
    p.add_argument("--ship-code", action="store_true",
                   help="upload this checkout's litevlm_runtime as the job's py_modules (its dependencies must be on "
                        "the nodes already: the image in deploy/)")
    p.add_argument("--runtime-env-json", help="more runtime environment for the job, as JSON (env_vars, ...)")
    p.add_argument("--entrypoint-num-cpus", type=float, help="CPUs reserved for the job's driver")
    p.add_argument("--submission-id", help="the job's id (default: Ray picks one)")
    p.add_argument("--no-wait", action="store_true", help="submit and return (the job id on stdout)")
    p.add_argument("job_command", nargs=argparse.REMAINDER, metavar="-- COMMAND ARGS",
                   help=f"the fleet command for the job: {', '.join(SUBMITTABLE)} with its arguments")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("bench", help="wall time of pools of N workers on the same bags, alternating, as a table")
    _common(p)
    p.add_argument("--workers", default="1,2", help="pool sizes to time, comma-separated (the first is the baseline)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the sizes alternately this often")
    p.add_argument("--out", type=Path, required=True, help="a folder for the runs (one per size and round)")
    p.add_argument("--json", type=Path, help="also write the measurements here")
    p.add_argument("--versus-bag-eval", action="store_true",
                   help="also evaluate each bag as `bag eval` does (a fresh pipeline per bag) and compare the answers")
    p.set_defaults(func=cmd_bench)
