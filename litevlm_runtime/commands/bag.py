"""`litevlm bag make|replay|record|eval|compare`: rosbag2 test harness of the ROS 2 node.

  make     --from-drivelm DIR | --from-synth DIR  --out BAG [--raw ENCODING]   six cameras + timed questions
  replay   BAG [--rate X] [--params FILE | --topics T.. | --all-topics]  publish over DDS, original timing and QoS
  record   --out FILE [--bag BAG] [--count N]  answers -> JSON lines (+ end-to-end latency), and a bag
  eval     BAG --out FILE [--explain OUT.mcap]   the node's query server + pipeline on the bag, no DDS
                                          (with every answer explained for Foxglove: docs/explain.md)
  summary  FILE                           each answer with per-stage latency; median/p90 table
  compare  A B                            answer-by-answer differences and latency deltas;
                                          exit 1 when any answer differs (the regression check)
  soak     BAG [--count N --rate R]       start the node, replay the bag's frames and questions over
                                          DDS at a fixed rate: RSS, latency percentiles, lost and
                                          duplicated answers, determinism (exit 1 on any of those)
  peak     BAG                            the highest query rate with under 5% queue_full (bisection)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
from pathlib import Path

from ..errors import InputError
from .node_params import add_node_param_flags, overrides, parse_sets

# Each sub-command imports the code it runs inside its function (commands/__init__.py): building
# the parser loads neither torch nor rclpy.


def cmd_make(args) -> int:
    from ..bag.io import write_bag
    from ..bag.make import BagTiming, drivelm_contents

    src = args.from_drivelm or args.from_synth
    contents = drivelm_contents(src, max_frames=args.max_frames, questions_per_frame=args.questions_per_frame,
                                max_width=args.max_width,
                                timing=BagTiming(query_delay_s=args.query_delay, scene_gap_s=args.scene_gap),
                                raw_encoding=args.raw, query_frames=args.query_frames)
    write_bag(contents, args.out, storage=args.storage)
    n_frames = sum(len(v) for v in contents.frames.values())
    print(f"wrote {args.out}: {n_frames} camera frames ({n_frames // 6} sets), {len(contents.queries)} queries, "
          f"{args.storage}")
    return 0


def cmd_replay(args) -> int:
    from ..bag.dds import ReplayOptions, replay

    return replay(args.bag, ReplayOptions(rate=args.rate, restamp=not args.keep_stamps, params_file=args.params,
                                          topics=args.topics, all_topics=args.all_topics,
                                          wait_s=0.0 if args.no_wait else args.wait, reliable=args.reliable,
                                          namespace=args.namespace, remaps=args.remap))


def cmd_record(args) -> int:
    from ..bag.dds import record

    return record(args.out, topic=args.topic, count=args.count, timeout_s=args.timeout, bag_out=args.bag)


def print_latency(rows, title: str) -> None:
    from ..bag.compare import latency_table

    table = latency_table(rows)
    if not table:
        return
    print(f"\n{title}\n{'stage':<14}{'median ms':>12}{'p90 ms':>12}{'n':>6}")
    for stage, p50, p90, n in table:
        print(f"{stage:<14}{p50:>12.2f}{p90:>12.2f}{n:>6}")


def cmd_eval(args) -> int:
    from ..bag.evaluate import evaluate
    from ..ros.params_file import load_node_params

    params = load_node_params(args.params, overrides(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with out.open("w") as fh, explained_mcap(args.explain) as explainer:
        def on_record(rec):
            row = rec.to_json()
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            shown = f"{rec.total_ms:8.1f} ms  {rec.text[:60]!r}" if rec.status == "ok" else rec.status_message
            print(f"eval: {rec.query_id:<10} [{rec.status}] {shown}")
        evaluate(args.bag, params, on_record, explainer=explainer)
    print(f"eval: {len(rows)} answers -> {out}")
    if args.explain:
        print(f"eval: {explainer.explained} explained answers -> {args.explain} (Foxglove layout: "
              f"{layout_path(args.explain)}; open the MCAP, then Layouts > Import from file)")
    print_latency(rows, "pipeline latency (no DDS)")
    return 0


def layout_path(mcap: Path) -> Path:
    return mcap.with_name(mcap.stem + ".layout.json")


@contextlib.contextmanager
def explained_mcap(path: Path | None):
    """An inline Explainer writing every explained answer into the MCAP at `path` (explain/foxglove_mcap.py:
    its frames, heatmaps, annotations, picture and the answer record), and the Foxglove layout beside it;
    None without a path."""
    if path is None:
        yield None
        return
    from ..explain.foxglove_mcap import ExplanationMcap, write_layout
    from ..serving.explainer import Explainer

    path.parent.mkdir(parents=True, exist_ok=True)
    with ExplanationMcap(path) as mcap:
        def add(done):
            rec = done.record
            mcap.add(done.explanation, done.images, rec.query_stamp_ns, rec.query_id, extra=rec.to_json())
        yield Explainer(add, picture=False, threaded=False)
    write_layout(layout_path(path))


def cmd_summary(args) -> int:
    from ..bag.compare import read_jsonl, reuse_summary
    from ..pipeline.answer import STAGES

    rows = read_jsonl(args.file)
    print(f"{len(rows)} answers in {args.file}")
    head = "".join(f"{s[:10]:>11}" for s in STAGES)
    print(f"\n{'query':<12}{'status':<16}{head}{'total':>9}{'e2e':>9}  question -> answer")
    for r in rows:
        stages = "".join(f"{r['stage_ms'].get(s, 0.0):>11.1f}" for s in STAGES) if r["status"] == "ok" \
            else " " * 11 * len(STAGES)
        e2e = f"{r['e2e_ms']:>9.1f}" if "e2e_ms" in r else f"{'-':>9}"
        said = r["answer"] if r["status"] == "ok" else r["status_message"]
        print(f"{r['query_id']:<12}{r['status']:<16}{stages}{r['total_ms']:>9.1f}{e2e}  "
              f"{r['question'][:50]!r} -> {said[:60]!r}")
    print_latency(rows, "latency over ok answers (transport = end-to-end - queue - pipeline)")
    reuse = reuse_summary(rows)
    if reuse:
        print(f"\nvisual reuse: vision median {reuse['first_ms']:.2f} ms for the first question on a frame set "
              f"({reuse['first']}), {reuse['later_ms']:.2f} ms for the later ones ({reuse['later']}): "
              f"{reuse['later_ms'] / max(reuse['first_ms'], 1e-9):.2g}x of the first's; "
              f"{reuse['answers_reusing']} answers reused cameras")
    return 0


def cmd_compare(args) -> int:
    from ..bag.compare import compare_runs, read_jsonl

    a, b = read_jsonl(args.a), read_jsonl(args.b)
    cmp = compare_runs(a, b)
    print(f"compare: {cmp.matched} queries in both, {len(cmp.differences)} differences")
    for d in cmp.differences:
        print(f"  DIFF {d}")
    if cmp.latency_rows:
        print(f"\n{'stage':<14}{'A p50':>10}{'B p50':>10}{'delta':>10}{'A p90':>10}{'B p90':>10}{'delta':>10}")
        for stage, a50, b50, a90, b90 in cmp.latency_rows:
            print(f"{stage:<14}{a50:>10.2f}{b50:>10.2f}{b50 - a50:>+10.2f}{a90:>10.2f}{b90:>10.2f}{b90 - a90:>+10.2f}")
    print("compare: answers identical" if cmp.ok else "compare: ANSWERS DIFFER")
    return 0 if cmp.ok else 1


def _harness(args, extra: dict, node_log: Path | None):
    """Start the node under test (parameters: --params, --set, then `extra`) and a DDS client on
    the bag: (node, client, workload, closer)."""
    from ..bench.dds_client import DDSClient
    from ..bench.soak import NodeProcess
    from ..bench.soak_workload import workload_from_bag
    from ..ros.params_file import config_dir, load_node_params

    params_file = args.params or config_dir() / "drive.yaml"
    extra = dict(extra)
    nice = int(extra.pop("nice", args.nice))          # a process setting, not a node parameter
    node_overrides = overrides(args) | extra
    params = load_node_params(params_file, node_overrides)
    work = workload_from_bag(args.bag, params)
    env = dict(os.environ)
    if args.domain_id is not None:
        env["ROS_DOMAIN_ID"] = str(args.domain_id)
    log = node_log or Path(tempfile.mkdtemp(prefix="litevlm_soak_")) / "node.log"
    print(f"{args.bag_command}: {len(work.frame_sets)} frame sets, {len(work.questions)} questions from {args.bag}; "
          f"starting the node{' with ' + ', '.join(f'{k}={v}' for k, v in extra.items()) if extra else ''}"
          f"{f' at nice {nice}' if nice else ''} (log {log})")
    node = NodeProcess(params_file, log, node_overrides, env, nice=nice)
    try:
        node.wait_for("ready (", timeout=args.start_timeout)
        client = DDSClient(params, domain_id=args.domain_id)
        client.wait_for_node()
    except BaseException:
        node.stop(signal.SIGINT)
        raise

    def close() -> None:
        client.close()
        node.stop(signal.SIGINT)
    return node, client, work, close


def _versus(items: list[str]) -> dict[str, dict]:
    """--versus LABEL=NAME=VALUE[,NAME=VALUE...] -> {label: overrides}; the baseline is ''."""
    configs = {"": {}}
    for item in items:
        label, sep, rest = item.partition("=")
        if not sep or not label or not rest:
            raise InputError(f"--versus {item!r}: expected LABEL=NAME=VALUE[,NAME=VALUE...]")
        configs[label] = parse_sets(rest.split(","), "--versus")
    return configs


def _each_config(args, configs: dict[str, dict], rounds: int, run) -> dict[str, list]:
    """The loop soak and peak share: for each round, each configuration in turn (alternating, so
    that a change in load hits all alike) on a fresh node and DDS client; `run(node, client,
    work, round)` measures it. With several runs, each node's log gets its own name beside
    --node-log (NAME.LABEL[ROUND].log). Returns {label: [each round's result]}."""
    results: dict[str, list] = {label: [] for label in configs}
    for r in range(rounds):
        for label, extra in configs.items():
            node_log = args.node_log
            if node_log and (len(configs) > 1 or rounds > 1):
                name = f"{node_log.stem.split('.')[0]}.{label or 'baseline'}{r if rounds > 1 else ''}.log"
                node_log = node_log.with_name(name)
            node, client, work, close = _harness(args, extra, node_log)
            try:
                results[label].append(run(node, client, work, r))
            finally:
                close()
            for line in node.text().splitlines():          # what standing questions did beside the queries
                if "summary: standing" in line:
                    print(f"{args.bag_command} {label or 'baseline'}: {line[line.index('standing'):]}")
    return results


def _print_tables(configs: dict[str, dict], results: dict) -> None:
    for label, result in results.items():
        if len(configs) > 1:
            settings = ", ".join(f"{k}={v}" for k, v in configs[label].items()) or "as given"
            print(f"\n== {label or 'baseline'}: {settings}")
        print(result.table())


def cmd_soak(args) -> int:
    from ..bench.soak import SoakPlan, soak
    from ..bench.soak_stats import SoakResult, comparison_table

    configs = _versus(args.versus)
    runs = _each_config(args, configs, args.rounds, lambda node, client, work, r: soak(
        client, work, SoakPlan(args.count, args.rate, frame_rate=args.frame_rate, warmup=args.warmup,
                               grace_s=args.grace, prefix=f"soak{r}_", concurrency=args.concurrency), node=node))
    results = {label: SoakResult.pooled(rs) for label, rs in runs.items()}
    _print_tables(configs, results)
    if len(configs) > 1:
        print("\n" + comparison_table(results, args.rounds))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("".join(json.dumps({**r, "config": label}) + "\n"
                                    for label, res in results.items() for r in res.rows))
        print(f"soak: {sum(len(res.rows) for res in results.values())} answers -> {args.out}")
    return 0 if all(res.ok() for res in results.values()) else 1


def _loaded(args):
    """--hog N: N busy processes beside the node while each configuration runs (`litevlm bench
    --contention`'s hogs, one core each), with the load average said before and after."""
    from contextlib import contextmanager

    from ..bench.contention import Hog

    @contextmanager
    def beside():
        before = open("/proc/loadavg").read().split()[0]
        with Hog(args.hog, args.hog_kind):
            yield
        print(f"{args.bag_command}: beside {args.hog} {args.hog_kind} processes; load average {before} before, "
              f"{open('/proc/loadavg').read().split()[0]} after")
    return beside


def cmd_peak(args) -> int:
    from ..bench.soak import PeakPlan, peak
    from ..bench.soak_stats import peak_comparison

    configs = _versus(args.versus)
    beside = _loaded(args)

    def measured(node, client, work, r):
        with beside():
            return peak(client, work, PeakPlan(
                lo=args.min_rate, hi=args.max_rate, steps=args.steps, trial_count=args.trial_count,
                max_queue_full=args.max_queue_full, frame_rate=args.frame_rate, grace_s=args.grace,
                concurrency=args.concurrency, lone=args.lone))
    runs = _each_config(args, configs, 1, measured)
    results = {label: rs[0] for label, rs in runs.items()}
    _print_tables(configs, results)
    comparison = peak_comparison(results) if len(results) > 1 else None
    if comparison is not None:
        print("\n" + comparison["table"])
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        doc = {"concurrency": args.concurrency,
               "configs": {label or "baseline": {"overrides": configs[label], **res.to_json()}
                           for label, res in results.items()}}
        if comparison is not None:
            doc["comparison"] = {k: v for k, v in comparison.items() if k != "table"}
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"peak: -> {args.json}")
    return 0 if comparison is None or not comparison["differing"] else 1


def _harness_args(p) -> None:
    p.add_argument("bag", type=Path, help="a bag with the six camera topics and questions (litevlm bag make)")
    add_node_param_flags(p)
    p.add_argument("--frame-rate", type=float, default=2.0, help="frame sets published per second (re-stamped to now)")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds without a new answer before the rest count as lost")
    p.add_argument("--domain-id", type=int,
                   help="ROS_DOMAIN_ID for the node and the harness (default: the environment's)")
    p.add_argument("--node-log", type=Path, help="the node's output (default: a temporary folder)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds for the node to configure and activate")
    p.add_argument("--nice", type=int, default=0,
                   help="the node process's nice value (CPU priority; below 0 needs CAP_SYS_NICE); in --versus, nice=N")


def register(subparsers) -> None:
    """`litevlm bag SUB-COMMAND`: one parser function per sub-command."""
    bag = subparsers.add_parser("bag", help="rosbag2 harness: make, replay, record, eval, compare")
    sub = bag.add_subparsers(dest="bag_command", required=True)
    _make_parser(sub)
    _replay_parser(sub)
    _record_parser(sub)
    _eval_parser(sub)
    _summary_parser(sub)
    _compare_parser(sub)
    _soak_parser(sub)
    _peak_parser(sub)


def _make_parser(sub) -> None:
    p = sub.add_parser("make", help="make a bag of six camera streams + timed questions")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-drivelm", type=Path, metavar="DIR", help="DriveLM folder (samples/CAM_X/*.jpg + QA json)")
    src.add_argument("--from-synth", type=Path, metavar="DIR",
                     help="SynthDrive output folder (the same DriveLM layout; a single-frame set's frames on a 2 Hz "
                          "timeline, a set made with --frames K as sequences: each key frame's K - 1 earlier frame "
                          "sets at their capture times, --stride apart, asked nothing; docs/motion.md)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap")
    p.add_argument("--max-frames", type=int, help="at most this many six-camera frame sets")
    p.add_argument("--questions-per-frame", type=int, default=2)
    p.add_argument("--max-width", type=int, help="downscale frames wider than this (re-encoded JPEG)")
    # (the encodings are checked when used: listing them here would import OpenCV for every command)
    p.add_argument("--raw", metavar="ENCODING",
                   help="write sensor_msgs/Image in this encoding on .../image_raw (default: CompressedImage): rgb8, "
                        "bgr8, rgba8, bgra8, mono8, mono16, rgb16, ..., bayer_rggb8, ..., yuv422, yuv422_yuy2, nv12, "
                        "nv21 (docs/ros.md lists them all)")
    p.add_argument("--query-delay", type=float, default=0.2,
                   help="seconds after a frame set that its first question comes")
    p.add_argument("--query-frames", type=int, default=0, metavar="K",
                   help="Query.frames of every question: K frame sets, temporal.stride_s apart (0: the node's "
                        "temporal.frames; a --frames K SynthDrive set has each key frame's K sets)")
    p.add_argument("--scene-gap", type=float, default=2.0,
                   help="seconds between one scene's last frame set or question and the next scene's first frame "
                        "set (default 2; keep it longer than the history a question may ask for, frames x stride, "
                        "so that none reaches into the scene before)")
    p.set_defaults(func=cmd_make)


def _replay_parser(sub) -> None:
    p = sub.add_parser("replay", help="publish a bag over DDS with its original timing")
    p.add_argument("bag", type=Path, help="a rosbag2 folder, a folder of .mcap/.db3 files, or one such file")
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--keep-stamps", action="store_true",
                   help="publish the bag's stamps unchanged (default: re-stamp to now)")
    p.add_argument("--params", type=Path,
                   help="the node's parameters YAML: its camera and query topics are what is replayed "
                        "(default: config/drive.yaml)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--topics", nargs="+", metavar="TOPIC", help="replay these topics instead of the node's")
    which.add_argument("--all-topics", action="store_true", help="replay every topic whose message type is installed")
    p.add_argument("--wait", type=float, default=10.0,
                   help="seconds to wait for the node's query subscription before publishing (once, not per topic)")
    p.add_argument("--no-wait", action="store_true", help="publish at once")
    p.add_argument("--reliable", action="store_true",
                   help="publish every topic reliable, volatile, depth 100 instead of the QoS the bag recorded")
    p.add_argument("--namespace", default="", metavar="NS",
                   help="publish every topic under NS (/cam_front/... as /NS/cam_front/...): feeds a node in NS")
    p.add_argument("--remap", action="append", default=[], metavar="FROM:=TO",
                   help="publish bag topic FROM as TO (relative TO: under --namespace); "
                        "the first rule that matches wins")
    p.set_defaults(func=cmd_replay)


def _record_parser(sub) -> None:
    p = sub.add_parser("record", help="write the node's answers to JSON lines")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--topic", default="/litevlm/answer")
    p.add_argument("--bag", type=Path, help="also write the Answer messages to this rosbag2 (MCAP)")
    p.add_argument("--count", type=int, help="stop after this many answers")
    p.add_argument("--timeout", type=float, help="stop after this many seconds")
    p.set_defaults(func=cmd_record)


def _eval_parser(sub) -> None:
    p = sub.add_parser("eval", help="run the bag through the node's query server + pipeline without DDS")
    p.add_argument("bag", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--explain", type=Path, metavar="OUT.mcap",
                   help="explain every answer into this MCAP for Foxglove (camera frames, heatmaps, ImageAnnotations, "
                        "the rig picture, the answers) and write its layout beside it as OUT.layout.json "
                        "(docs/explain.md)")
    add_node_param_flags(p, model=True)
    p.set_defaults(func=cmd_eval)


def _summary_parser(sub) -> None:
    p = sub.add_parser("summary", help="each answer with its per-stage latency, then median/p90 per stage")
    p.add_argument("file", type=Path, help="JSON lines from bag record or bag eval")
    p.set_defaults(func=cmd_summary)


def _compare_parser(sub) -> None:
    p = sub.add_parser("compare", help="answer-by-answer differences and latency deltas of two JSON-lines runs")
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.set_defaults(func=cmd_compare)


def _soak_parser(sub) -> None:
    p = sub.add_parser("soak", help="run the node on the bag's frames and questions at a fixed rate over DDS: "
                                    "RSS, latency percentiles, lost/duplicated answers, determinism")
    _harness_args(p)
    p.add_argument("--count", type=int, default=1500, help="queries to send")
    p.add_argument("--rate", type=float, default=2.0, help="queries per second")
    p.add_argument("--warmup", type=int, default=10, help="first queries left out of the statistics")
    p.add_argument("--out", type=Path, help="every answer received, as JSON lines")
    p.add_argument("--versus", action="append", default=[], metavar="LABEL=NAME=VALUE[,NAME=VALUE]",
                   help="also soak the node with these parameters (a fresh node each), after the baseline, and "
                        "compare them in one table")
    p.add_argument("--rounds", type=int, default=1, help="repeat baseline and --versus runs alternately this often")
    p.add_argument("--concurrency", type=int, default=1, help="N clients asking at once: queries come N together")
    p.set_defaults(func=cmd_soak)


def _peak_parser(sub) -> None:
    p = sub.add_parser("peak", help="the highest query rate with under 5%% queue_full answers, by bisection")
    _harness_args(p)
    p.add_argument("--min-rate", type=float, default=0.5, help="queries/s expected to pass")
    p.add_argument("--max-rate", type=float, default=64.0, help="queries/s expected to fail")
    p.add_argument("--steps", type=int, default=6, help="bisection steps between them")
    p.add_argument("--trial-count", type=int, default=60, help="queries per trial")
    p.add_argument("--max-queue-full", type=float, default=0.05,
                   help="the fraction of queue_full a passing rate stays under")
    p.add_argument("--concurrency", type=int, default=1, help="N clients asking at once: queries come N together")
    p.add_argument("--lone", type=int, default=10, help="then this many queries one at a time (a lone query's latency)")
    p.add_argument("--versus", action="append", default=[], metavar="LABEL=NAME=VALUE[,NAME=VALUE]",
                   help="also find the peak of a node with these parameters (e.g. batch1=serving.max_batch=1) and "
                        "compare: rate ratio, answers to the same (question, frame set), lone latency")
    p.add_argument("--json", type=Path, help="write peak_rate, the trials and every answer (per configuration) here")
    p.add_argument("--hog", type=int, default=0, help="busy processes beside the node while each configuration runs "
                                                      "(the machine a CPU deployment shares)")
    p.add_argument("--hog-kind", default="spin", help="spin (a Python loop) | matmul (numpy, one thread)")
    p.set_defaults(func=cmd_peak)
