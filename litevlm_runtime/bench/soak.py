"""Soak and peak-rate harness for the node over real DDS, after ros2_benchmark's design: the
graph under test (`litevlm drive`, started here as a child process so that its memory can be
read) is fed by a playback side that publishes a bag's frames and questions at a fixed rate,
and a monitor that subscribes to the answers (its own ROS context, in this process).

  soak   N queries at a fixed rate: RSS of the node over the run (growth and slope per 1000
         queries), p50/p90/p99 of pipeline, queue and end-to-end latency (and per stage, and
         per question: a tail that is the mix of questions is not a tail of the runtime), lost
         and duplicated answers, status counts, and determinism (every repeat of a (question,
         frame set) pair must give the same token ids).
  peak   the highest query rate with under `max_queue_full` (5%) queue_full answers, found by
         bisection between a rate that passes and one that fails (geometric midpoints, as the
         rates span orders of magnitude); each trial sends `trial_count` queries at its rate,
         and the next starts when every answer is in.

Frames: the bag's frame sets (the k-th message of every camera topic is set k) are published in
turn at `frame_rate`, re-stamped to now (keeping each camera's offset within its set), so every
query finds a fresh set; the CAM_FRONT stamp a set was published with says which set an answer
used. Questions: the bag's Query texts, in turn. RSS is read from /proc (Linux).

`DDSClient`, `NodeProcess` and `LoggedProcess` are also what the DDS tests drive the node with.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..bag.dds import answer_row, rclpy_type
from ..bag.io import bag_topics, read_bag
from ..cameras import CAMERAS
from ..errors import InputError
from ..pipeline.answer import STAGES
from ..ros.node import use_large_data_profile
from ..timing import percentile

S = 1_000_000_000


def percentiles(values, qs=(50, 90, 99)) -> tuple[float, ...]:
    return tuple(percentile(values, q) for q in qs)


# --------------------------------------------------------------------------------------------
# The graph under test
class LoggedProcess:
    """A child process with its output (stdout and stderr) in a log file, waited on by what it
    prints. The DDS tests' child processes are these too."""

    what = "the process"       # what the error says did not print

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None,
                 nice: int = 0):
        self.log = Path(log)
        self._fh = self.log.open("w")
        env = dict(os.environ if env is None else env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        # `nice`: the CPU priority a deployment would give the node (below 0 needs CAP_SYS_NICE).
        self.p = subprocess.Popen(cmd, env=env, stdout=self._fh, stderr=subprocess.STDOUT, cwd=cwd,
                                  preexec_fn=(lambda: os.nice(nice)) if nice else None)

    @property
    def pid(self) -> int:
        return self.p.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if needle in self.text():
                return
            if self.p.poll() is not None:
                break
            time.sleep(0.1)
        raise InputError(f"{self.what} did not print {needle!r} (log {self.log}):\n{self.text()[-3000:]}")

    def rss_bytes(self) -> int:
        """Resident set size now (0 once the process is gone)."""
        try:
            for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        """Send `sig` and wait; kill after `timeout`. Returns the exit status."""
        if self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self._fh.close()
        return self.p.returncode


class NodeProcess(LoggedProcess):
    """`litevlm drive --params FILE [--set NAME=VALUE ...]` as a child process. The venv's
    bootstrapper re-executes Python in place (execve), so the pid is the node's for /proc reads;
    `python -m` imports litevlm_runtime from `cwd` first, where there is one."""

    what = "the node"

    def __init__(self, params: Path, log: Path, overrides: dict | None = None, env: dict | None = None,
                 cwd: Path | None = None, nice: int = 0):
        args = [sys.executable, "-m", "litevlm_runtime.cli", "drive", "--params", str(params)]
        for k, v in (overrides or {}).items():
            args += ["--set", f"{k}={v}"]
        super().__init__(args, log, env, cwd, nice)


# --------------------------------------------------------------------------------------------
# Playback and monitor
class DDSClient:
    """A ROS node in its own context: publishes camera frames and queries to the node's topics
    (its parameters say which) and collects every Answer, spinning in a background thread."""

    def __init__(self, params: dict, domain_id: int | None = None, name: str = "litevlm_soak"):
        import rclpy
        from litevlm_msgs.msg import Answer, Query
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import HistoryPolicy, QoSProfile, ReliabilityPolicy
        from rclpy.signals import SignalHandlerOptions
        from sensor_msgs.msg import CompressedImage, Image
        from std_msgs.msg import String


        use_large_data_profile()
        self._answer_row = answer_row
        self.Query = Query
        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx, domain_id=domain_id, signal_handler_options=SignalHandlerOptions.NO)
        self.node = rclpy.create_node(name, context=self.ctx)
        keep_all = QoSProfile(history=HistoryPolicy.KEEP_ALL, reliability=ReliabilityPolicy.RELIABLE)
        self.camera_pubs = {}
        for cam, topic in zip(CAMERAS, params["camera_topics"]):
            msg_type = CompressedImage if topic.rstrip("/").endswith("/compressed") else Image
            self.camera_pubs[cam] = self.node.create_publisher(msg_type, topic, QoSProfile(
                depth=10, reliability=ReliabilityPolicy.RELIABLE))
        self.query_pub = self.node.create_publisher(Query, params["query_topic"], keep_all)
        self.answer_topic = params["answer_topic"]
        self._lock = threading.Lock()
        self.rows: list[dict] = []
        self.node.create_subscription(Answer, self.answer_topic, self._on_answer, keep_all)
        # The JSON mirror carries what the typed Answer does not (the pipeline's CPU and GC time).
        self.mirrored: dict[str, dict] = {}
        self.node.create_subscription(String, params["answer_json_topic"], self._on_json, keep_all)
        self.executor = SingleThreadedExecutor(context=self.ctx)
        self.executor.add_node(self.node)
        self._spinner = threading.Thread(target=self._spin, name="litevlm-soak-spin", daemon=True)
        self._spinner.start()

    def _spin(self) -> None:
        while self.ctx.ok():
            try:
                self.executor.spin_once(timeout_sec=0.05)
            except Exception:  # noqa: BLE001 - the context went away under us: done
                if self.ctx.ok():
                    raise
                return

    def _on_answer(self, msg) -> None:
        row = self._answer_row(msg, time.time_ns())
        with self._lock:
            self.rows.append(row)

    def _on_json(self, msg) -> None:
        d = json.loads(msg.data)
        with self._lock:
            self.mirrored[d["query_id"]] = {k: d[k] for k in ("cpu_ms", "gc_ms") if k in d}

    def now_ns(self) -> int:
        return time.time_ns()

    def answers(self) -> list[dict]:
        """The Answer rows received so far, with the JSON mirror's extra fields where it came."""
        with self._lock:
            return [{**r, **self.mirrored.get(r["query_id"], {})} for r in self.rows]

    def wait_for_node(self, timeout: float = 30.0) -> None:
        """Until the node's query subscription and answer publisher are matched with ours."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if (self.query_pub.get_subscription_count() > 0
                    and self.node.count_publishers(self.answer_topic) > 0
                    and all(p.get_subscription_count() > 0 for p in self.camera_pubs.values())):
                time.sleep(0.3)       # discovery completes on both sides
                return
            time.sleep(0.05)
        raise InputError(f"no node answered on {self.answer_topic} within {timeout:.0f} s")

    def publish_frames(self, frames: dict, stamp_ns: int) -> None:
        """frames: camera -> (sensor_msgs message, offset_ns <= 0 within its set)."""
        for cam, (msg, offset_ns) in frames.items():
            t = stamp_ns + offset_ns
            msg.header.stamp.sec, msg.header.stamp.nanosec = t // S, t % S
            self.camera_pubs[cam].publish(msg)

    def publish_query(self, query_id: str, text: str, stamp_ns: int | None = None, deadline_ns: int = 0) -> None:
        msg = self.Query(id=query_id, text=text)
        t = self.now_ns() if stamp_ns is None else stamp_ns
        msg.header.stamp.sec, msg.header.stamp.nanosec = t // S, t % S
        if deadline_ns:
            msg.deadline.sec, msg.deadline.nanosec = deadline_ns // S, deadline_ns % S
        self.query_pub.publish(msg)

    def wait_for_answers(self, ids, timeout: float, quiet_s: float = 0.0) -> list[dict]:
        """Until every id in `ids` has an answer (then `quiet_s` more, to see duplicates), or
        `timeout` seconds without a new answer."""
        want = set(ids)
        last_n, last_change = -1, time.monotonic()
        while True:
            rows = self.answers()
            if want <= {r["query_id"] for r in rows}:
                time.sleep(quiet_s)
                return self.answers()
            if len(rows) != last_n:
                last_n, last_change = len(rows), time.monotonic()
            elif time.monotonic() - last_change > timeout:
                return rows
            time.sleep(0.02)

    def close(self) -> None:
        import rclpy

        self.node.destroy_node()
        if self.ctx.ok():
            rclpy.shutdown(context=self.ctx)
        self._spinner.join(5)


# --------------------------------------------------------------------------------------------
# The workload: a bag's frame sets and questions
@dataclass
class Workload:
    frame_sets: list[dict]           # camera -> (rclpy message, offset_ns within the set)
    questions: list[str]


def workload_from_bag(bag: Path, params: dict) -> Workload:
    from rclpy.serialization import deserialize_message


    topics = dict(zip(params["camera_topics"], CAMERAS))
    types = bag_topics(bag)
    per_camera: dict[str, list] = defaultdict(list)
    questions: list[str] = []
    wanted = [*topics, params["query_topic"], params["question_topic"]]
    for _, topic, msgtype, raw, reader in read_bag(bag, wanted):
        if topic in topics:              # published as they are: rclpy messages
            per_camera[topics[topic]].append(deserialize_message(raw, rclpy_type(msgtype)))
        else:                            # only the text is used: read with the bag's own definition
            msg = reader.deserialize(raw, msgtype)
            questions.append(msg.text if topic == params["query_topic"] else msg.data)
    missing = [c for c in CAMERAS if not per_camera[c]]
    if missing:
        raise InputError(f"{bag}: no frames on the node's camera topics for {', '.join(missing)} "
                         f"(the bag has {', '.join(types)})")
    if not questions:
        raise InputError(f"{bag}: no questions on {params['query_topic']} or {params['question_topic']}")
    n = min(len(v) for v in per_camera.values())
    sets = []
    for k in range(n):
        stamps = {c: per_camera[c][k].header.stamp.sec * S + per_camera[c][k].header.stamp.nanosec for c in CAMERAS}
        newest = max(stamps.values())
        sets.append({c: (per_camera[c][k], stamps[c] - newest) for c in CAMERAS})
    return Workload(sets, questions)


# --------------------------------------------------------------------------------------------
# Soak
@dataclass
class SoakResult:
    rate: float
    sent: list[tuple[str, str]]                  # (query id, question) in order
    rows: list[dict]                             # every answer received
    set_of_stamp: dict[int, int]                 # CAM_FRONT stamp -> frame set index
    rss: list[tuple[int, int]]                   # (queries sent so far, RSS bytes)
    warmup: int
    duration_s: float
    pipeline: str = ""
    warmup_ids: frozenset = None         # default: the first `warmup` of `sent` (pooled runs: each run's)

    def __post_init__(self):
        if self.warmup_ids is None:
            self.warmup_ids = frozenset(qid for qid, _ in self.sent[:self.warmup])

    # ---- accounting
    @property
    def by_id(self) -> dict[str, list[dict]]:
        d = defaultdict(list)
        for r in self.rows:
            d[r["query_id"]].append(r)
        return d

    @property
    def lost(self) -> list[str]:
        got = self.by_id
        return [qid for qid, _ in self.sent if qid not in got]

    @property
    def duplicated(self) -> list[str]:
        return [qid for qid, rs in self.by_id.items() if len(rs) > 1]

    @property
    def status_counts(self) -> Counter:
        return Counter(r["status"] for r in self.rows)

    def measured(self) -> list[dict]:
        """ok answers after the warm-up queries."""
        return [r for r in self.rows if r["status"] == "ok" and r["query_id"] not in self.warmup_ids]

    def determinism(self) -> tuple[int, list[str]]:
        """(how many (question, frame set) pairs were answered more than once, those whose
        answers differ)."""
        answers = defaultdict(set)
        counts = Counter()
        for r in self.rows:
            if r["status"] != "ok":
                continue
            key = (r["question"], frame_set_of(r, self.set_of_stamp))
            answers[key].add(tuple(r["token_ids"]))
            counts[key] += 1
        repeated = [k for k, n in counts.items() if n > 1]
        differ = [f"{q[:40]!r} on frame set {s}: {len(answers[(q, s)])} different answers"
                  for q, s in repeated if len(answers[(q, s)]) > 1]
        return len(repeated), differ

    def rss_summary(self) -> tuple[float, float, float, float]:
        """(MB at the end of the warm-up, MB at the end, growth MB, slope MB per 1000 queries
        by least squares over the samples after the warm-up)."""
        after = [(n, b) for n, b in self.rss if n >= self.warmup and b > 0]
        if len(after) < 2:
            return (float("nan"),) * 4
        n, b = np.array([x[0] for x in after], float), np.array([x[1] for x in after], float) / 2**20
        slope = float(np.polyfit(n, b, 1)[0] * 1000) if np.ptp(n) > 0 else 0.0
        return float(b[0]), float(b[-1]), float(b[-1] - b[0]), slope

    # ---- report
    def latency_rows(self) -> list[tuple[str, float, float, float, int]]:
        ok = self.measured()
        rows = []
        for name in ("total", "cpu", "not running", "gc", "queue", "e2e", *STAGES):
            if name == "total":
                v = [r["total_ms"] for r in ok]
            elif name == "cpu":
                v = [r["cpu_ms"] for r in ok if "cpu_ms" in r]
            elif name == "not running":
                v = [r["total_ms"] - r["cpu_ms"] for r in ok if "cpu_ms" in r]
            elif name == "gc":
                v = [r["gc_ms"] for r in ok if "gc_ms" in r]
            elif name == "queue":
                v = [r["queue_ms"] for r in ok]
            elif name == "e2e":
                v = [r["e2e_ms"] for r in ok]
            else:
                v = [r["stage_ms"][name] for r in ok if name in r["stage_ms"]]
            if v:
                rows.append((name, *percentiles(v), len(v)))
        return rows

    def per_question_rows(self) -> list[tuple[str, float, float, int]]:
        by_q = defaultdict(list)
        for r in self.measured():
            by_q[r["question"]].append(r["total_ms"])
        return [(q, *percentiles(v, (50, 99)), len(v)) for q, v in by_q.items()]

    def table(self) -> str:
        lines = [f"soak: {len(self.sent)} queries at {self.rate:g}/s in {self.duration_s:.0f} s "
                 f"({self.pipeline or 'pipeline unknown'}); statistics after the first {self.warmup}",
                 f"{'ms':<14}{'p50':>10}{'p90':>10}{'p99':>10}{'p99/p50':>9}{'n':>7}"]
        names = {"total": "pipeline", "e2e": "end-to-end", "cpu": " its CPU time", "not running": " not running",
                 "gc": " in GC"}
        for name, p50, p90, p99, n in self.latency_rows():
            ratio = p99 / p50 if p50 > 0 else float("nan")
            lines.append(f"{names.get(name, name):<14}{p50:>10.1f}{p90:>10.1f}{p99:>10.1f}{ratio:>9.2f}{n:>7}")
        pq = self.per_question_rows()
        if pq:
            worst = max(pq, key=lambda x: x[2] / x[1] if x[1] > 0 else 0)
            lines.append(f"per question: {len(pq)} questions; pipeline p99/p50 within one question "
                         f"<= {worst[2] / worst[1]:.2f} ({worst[0][:40]!r}, n {worst[3]}); "
                         f"question medians {min(x[1] for x in pq):.1f}..{max(x[1] for x in pq):.1f} ms")
        groups, n, wall99, cpu99 = identical_work_tail(self.measured())
        lines.append(f"identical work ({groups} groups of the same question, cameras, reused cameras and decode steps; "
                     f"{n} answers): p99 of latency / its group's median: wall {wall99:.2f}, CPU {cpu99:.2f}")
        start, end, growth, slope = self.rss_summary()
        lines.append(f"RSS: {start:.1f} MB after the warm-up, {end:.1f} MB at the end: growth {growth:+.1f} MB "
                     f"({slope:+.2f} MB per 1000 queries)")
        statuses = ", ".join(f"{s} {n}" for s, n in sorted(self.status_counts.items()))
        lines.append(f"answers: {len(self.sent)} sent, {len(self.by_id)} answered, {len(self.lost)} lost, "
                     f"{len(self.duplicated)} duplicated; statuses: {statuses or 'none'}")
        repeated, differ = self.determinism()
        lines.append(f"determinism: {repeated} (question, frame set) pairs answered more than once, "
                     f"{len(differ)} with differing answers" + "".join(f"\n  DIFF {d}" for d in differ[:10]))
        return "\n".join(lines)

    def ok(self) -> bool:
        return not self.lost and not self.duplicated and not self.determinism()[1]

    @classmethod
    def pooled(cls, results: list["SoakResult"]) -> "SoakResult":
        """Several runs (ids made distinct by their prefixes) as one; RSS of the first run."""
        if len(results) == 1:
            return results[0]
        first = results[0]
        return cls(first.rate, [s for r in results for s in r.sent], [x for r in results for x in r.rows],
                   {k: v for r in results for k, v in r.set_of_stamp.items()}, first.rss, first.warmup,
                   sum(r.duration_s for r in results), first.pipeline,
                   frozenset().union(*(r.warmup_ids for r in results)))



def comparison_table(results: dict[str, "SoakResult"], rounds: int) -> str:
    """One row per configuration, ratios against the baseline (the first) of the same run."""
    def stats(res):
        ok = res.measured()
        total = [r["total_ms"] for r in ok]
        cpu = [r["cpu_ms"] for r in ok if "cpu_ms" in r]
        idle = [r["total_ms"] - r["cpu_ms"] for r in ok if "cpu_ms" in r]
        p50, _, p99 = percentiles(total)
        c50, _, c99 = percentiles(cpu)
        return p50, p99, c50, c99, percentiles(idle)[2], percentiles([r["e2e_ms"] for r in ok])[2], len(ok)
    base = stats(next(iter(results.values())))
    lines = [f"soak comparison ({rounds} round{'s' * (rounds > 1)}, runs alternating; pipeline ms)",
             f"{'config':<16}{'p50':>8}{'p99':>8}{'p99/p50':>9}{'cpu p50':>9}{'cpu p99':>9}{'cpu p99/p50':>12}"
             f"{'not running p99':>16}{'e2e p99':>9}{'p99 vs base':>12}{'n':>6}"]
    for label, res in results.items():
        p50, p99, c50, c99, idle99, e2e99, n = stats(res)
        lines.append(f"{label or 'baseline':<16}{p50:>8.1f}{p99:>8.1f}{p99 / p50:>9.2f}{c50:>9.1f}{c99:>9.1f}"
                     f"{c99 / c50:>12.2f}{idle99:>16.1f}{e2e99:>9.1f}{p99 / base[1]:>12.2f}{n:>6}")
    return "\n".join(lines)


def identical_work_tail(rows: list[dict], min_group: int = 5) -> tuple[int, int, float, float]:
    """The runtime's own tail, without the mix of work: ok answers grouped by what they did (question,
    cameras selected, cameras reused, decode steps), each divided by its group's median; returns
    (groups, answers, p99 of that ratio for the wall time, for the serving thread's CPU time)."""
    groups = defaultdict(list)
    for r in rows:
        if r["status"] == "ok":
            key = (r["question"], tuple(r["cameras"]), tuple(r.get("reused_cameras", ())), r["decode_steps"])
            groups[key].append(r)
    groups = {k: v for k, v in groups.items() if len(v) >= min_group}
    if not groups:
        return 0, 0, float("nan"), float("nan")

    def tail(field):
        ratios = [x[field] / np.median([y[field] for y in g]) for g in groups.values() for x in g if field in x]
        return percentiles(ratios, (99,))[0] if ratios else float("nan")
    return len(groups), sum(len(g) for g in groups.values()), tail("total_ms"), tail("cpu_ms")


def frame_set_of(row: dict, set_of_stamp: dict[int, int]) -> int:
    """The workload frame set an answer was given on (by its CAM_FRONT stamp as published), -1 if
    none the harness published."""
    return set_of_stamp.get(row["frame_stamps_ns"].get("CAM_FRONT", -1), -1)


class Playback:
    """Frames at `frame_rate` from a background thread, re-stamped to now; queries from the
    caller. RSS is sampled with every frame set."""

    def __init__(self, client: DDSClient, work: Workload, frame_rate: float, node: NodeProcess | None = None):
        self.client, self.work, self.frame_rate, self.node = client, work, frame_rate, node
        self.set_of_stamp: dict[int, int] = {}
        self.rss: list[tuple[int, int]] = []
        self.sent = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._frames, name="litevlm-soak-frames", daemon=True)

    def start(self) -> "Playback":
        self.publish_set(0)
        self._thread.start()
        return self

    def publish_set(self, k: int) -> None:
        frames = self.work.frame_sets[k % len(self.work.frame_sets)]
        t = self.client.now_ns()
        self.set_of_stamp[t + frames["CAM_FRONT"][1]] = k % len(self.work.frame_sets)
        self.client.publish_frames(frames, t)
        if self.node is not None:
            self.rss.append((self.sent, self.node.rss_bytes()))

    def _frames(self) -> None:
        k, t0 = 1, time.monotonic()
        while not self._stop.wait(max(0.0, t0 + k / self.frame_rate - time.monotonic())):
            self.publish_set(k)
            k += 1

    def send(self, count: int, rate: float, prefix: str, every_s: float = 0.0, on_every=None,
             concurrency: int = 1) -> list[tuple[str, str]]:
        """`count` queries `{prefix}{i}` at `rate` per second on an absolute schedule (no
        drift), cycling through the questions; `on_every(i)` about every `every_s` seconds.
        `concurrency` N: N clients asking at once, i.e. N queries together every N / rate
        seconds. Returns the (id, question) pairs."""
        sent = []
        t0 = last = time.monotonic()
        for i in range(count):
            delay = t0 + (i // concurrency) * concurrency / rate - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            text = self.work.questions[i % len(self.work.questions)]
            qid = f"{prefix}{i}"
            self.client.publish_query(qid, text)
            sent.append((qid, text))
            self.sent += 1
            if on_every is not None and time.monotonic() - last >= every_s:
                on_every(i + 1)
                last = time.monotonic()
        return sent

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


def pipeline_of(node: NodeProcess | None) -> str:
    """What the node says it serves (its configure log line)."""
    if node is None:
        return ""
    for line in node.text().splitlines():
        if "serving " in line:
            return line.split("serving ", 1)[1].strip()
    return ""


def soak(client: DDSClient, work: Workload, count: int, rate: float, frame_rate: float = 2.0,
         warmup: int = 10, grace_s: float = 30.0, node: NodeProcess | None = None, prefix: str = "soak",
         progress=print, concurrency: int = 1) -> SoakResult:
    play = Playback(client, work, frame_rate, node).start()
    time.sleep(0.5)                  # the first frame set arrives before the first question
    try:
        t0 = time.monotonic()

        def report(n: int) -> None:
            progress(f"soak: {n}/{count} sent, {len(client.answers())} answered, node RSS "
                     f"{(node.rss_bytes() / 2**20) if node else float('nan'):.1f} MB")
        sent = play.send(count, rate, prefix, every_s=30.0, on_every=report, concurrency=concurrency)
        rows = client.wait_for_answers([q for q, _ in sent], timeout=grace_s, quiet_s=1.0)
        duration = time.monotonic() - t0
    finally:
        play.stop()
    return SoakResult(rate, sent, rows, dict(play.set_of_stamp), list(play.rss), warmup, duration, pipeline_of(node))


# --------------------------------------------------------------------------------------------
# Peak rate
@dataclass
class Trial:
    rate: float
    sent: int
    ok: int
    queue_full: int
    other: int
    lost: int

    @property
    def queue_full_fraction(self) -> float:
        return self.queue_full / self.sent if self.sent else 0.0


@dataclass
class PeakResult:
    trials: list[Trial] = field(default_factory=list)
    peak: float = 0.0
    max_queue_full: float = 0.05
    bracket: tuple[float, float] = (0.0, 0.0)
    concurrency: int = 1
    rows: list[dict] = field(default_factory=list)            # every answer of every trial
    set_of_stamp: dict[int, int] = field(default_factory=dict)
    lone_rows: list[dict] = field(default_factory=list)       # queries asked one at a time (lone latency)
    frame_sets: int = 0                                      # in the workload (lone query i: set i mod this)

    def answers(self) -> dict[tuple[str, int], list[tuple[int, ...]]]:
        """(question, frame set) -> the token ids of every ok answer to it."""
        out = defaultdict(list)
        for r in self.rows + self.lone_rows:
            if r["status"] == "ok":
                key = (r["question"], frame_set_of(r, self.set_of_stamp))
                out[key].append(tuple(r["token_ids"]))
        return out

    def lone_p50(self) -> float:
        return percentiles(list(self.lone_ms().values()), (50,))[0]

    def lone_answered(self) -> dict[str, dict]:
        """lone_i -> the row of lone query i (question i on frame set i) answered ok on its frames
        (`lone_i_againK`: the same query asked again after its frames came late; the last one counts)."""
        out = {}
        for r in self.lone_rows:
            i = int(r["query_id"].split("_")[1])
            if r["status"] == "ok" and frame_set_of(r, self.set_of_stamp) == i % max(1, self.frame_sets):
                out[f"lone_{i}"] = r
        return out

    def lone_ms(self) -> dict[str, float]:
        """lone_i -> pipeline ms of lone query i (lone_answered)."""
        return {k: r["total_ms"] for k, r in self.lone_answered().items()}

    def to_json(self) -> dict:
        return {"peak_rate": self.peak, "bracket": list(self.bracket), "concurrency": self.concurrency,
                "max_queue_full": self.max_queue_full,
                "trials": [vars(t) | {"queue_full_fraction": t.queue_full_fraction} for t in self.trials],
                "lone_pipeline_p50_ms": self.lone_p50(),
                "answers": [{"query_id": r["query_id"], "question": r["question"], "status": r["status"],
                             "frame_set": frame_set_of(r, self.set_of_stamp),
                             "answer": r.get("answer", ""), "token_ids": list(r["token_ids"]),
                             "total_ms": r["total_ms"], "queue_ms": r["queue_ms"], "stage_ms": r.get("stage_ms", {}),
                             "decode_steps": r.get("decode_steps", 0), "accepted_length": r.get("accepted_length", 0.0)}
                            for r in self.rows + self.lone_rows]}

    def table(self) -> str:
        lines = [f"peak: highest query rate with under {self.max_queue_full:.0%} queue_full",
                 f"{'rate/s':>10}{'sent':>7}{'ok':>7}{'queue_full':>12}{'fraction':>10}{'other':>7}{'lost':>6}  verdict"]
        for t in self.trials:
            verdict = "pass" if t.queue_full_fraction < self.max_queue_full and not t.lost else "fail"
            lines.append(f"{t.rate:>10.2f}{t.sent:>7}{t.ok:>7}{t.queue_full:>12}{t.queue_full_fraction:>10.3f}"
                         f"{t.other:>7}{t.lost:>6}  {verdict}")
        lo, hi = self.bracket
        lines.append(f"peak rate: {self.peak:.2f} queries/s (passes; {hi:.2f}/s fails)" if hi else
                     f"peak rate: >= {self.peak:.2f} queries/s (the highest rate tried passed)")
        at_peak = self.at_peak()
        if at_peak:
            lines.append(f"at the peak rate ({len(at_peak)} ok answers), ms:")
            lines.append(f"{'':<14}{'p50':>10}{'p99':>10}")
            for name in ("total", "queue", "e2e", *STAGES):
                v = [r["total_ms"] if name == "total" else r[f"{name}_ms"] if name in ("queue", "e2e")
                     else r["stage_ms"].get(name, 0.0) for r in at_peak]
                p50, p99 = percentiles(v, (50, 99))
                lines.append(f"{'pipeline' if name == 'total' else name:<14}{p50:>10.1f}{p99:>10.1f}")
        lone = list(self.lone_answered().values())
        if lone:            # where a lone query's time goes (the lone-p50 comparison's stages)
            lines.append(f"lone queries ({len(lone)} ok on their frames), p50 ms: " + ", ".join(
                f"{name} {percentiles([r['stage_ms'].get(name, 0.0) for r in lone], (50,))[0]:.1f}"
                for name in STAGES) + f"; decode steps {percentiles([r.get('decode_steps', 0) for r in lone], (50,))[0]:.0f}, "
                f"answers with more than one token per pass (EAGLE-2 accepted) "
                f"{sum(r.get('accepted_length', 0.0) > 1.0 for r in lone)}/{len(lone)}")
        return "\n".join(lines)

    def at_peak(self) -> list[dict]:
        """The ok answers of the trial at the peak rate."""
        index = next((i for i, t in enumerate(self.trials) if t.rate == self.peak), None)
        if index is None:
            return []
        prefix = f"peak{index + 1}_"
        return [r for r in self.rows if r["status"] == "ok" and r["query_id"].startswith(prefix)]


LONE_SETTLE_S = (0.3, 1.0, 3.0)     # waits for a lone query's frames to reach the node (DDS orders no topics)


def peak(client: DDSClient, work: Workload, lo: float = 0.5, hi: float = 64.0, steps: int = 6,
         trial_count: int = 60, max_queue_full: float = 0.05, frame_rate: float = 2.0,
         grace_s: float = 30.0, progress=print, concurrency: int = 1, lone: int = 0) -> PeakResult:
    """Bisection for the highest rate with under max_queue_full queue_full answers: first `hi`
    (if it passes, that is the answer), then `lo` (if it fails, the search goes down by halves),
    then `steps` geometric midpoints. `concurrency` N: queries come N at once (N clients);
    `lone` > 0: afterwards that many queries one at a time, each after the last was answered
    (a lone query's latency)."""
    play = Playback(client, work, frame_rate).start()
    time.sleep(0.5)
    result = PeakResult(max_queue_full=max_queue_full, concurrency=concurrency, frame_sets=len(work.frame_sets))
    n_trial = [0]

    def trial(rate: float) -> bool:
        n_trial[0] += 1
        prefix = f"peak{n_trial[0]}_"
        sent = play.send(trial_count, rate, prefix, concurrency=concurrency)
        rows = client.wait_for_answers([q for q, _ in sent], timeout=grace_s)
        mine = [r for r in rows if r["query_id"].startswith(prefix)]
        result.rows += mine
        statuses = Counter(r["status"] for r in mine)
        answered = {r["query_id"] for r in mine}
        t = Trial(rate, len(sent), statuses["ok"], statuses["queue_full"],
                  sum(n for s, n in statuses.items() if s not in ("ok", "queue_full")),
                  sum(1 for q, _ in sent if q not in answered))
        result.trials.append(t)
        passed = t.queue_full_fraction < max_queue_full and not t.lost
        progress(f"peak: {rate:.2f}/s: {t.queue_full}/{t.sent} queue_full -> {'pass' if passed else 'fail'}")
        return passed

    try:
        if trial(hi):
            result.peak, result.bracket = hi, (hi, 0.0)
            return result
        while not trial(lo):
            hi, lo = lo, lo / 2
            if lo < 1e-3:
                raise InputError("peak: even 0.001 queries/s gives queue_full answers")
        for _ in range(steps):
            mid = math.sqrt(lo * hi)
            if trial(mid):
                lo = mid
            else:
                hi = mid
        result.peak, result.bracket = lo, (lo, hi)
        # One at a time, each after the last was answered, on frames published for it: lone query
        # i asks question i on frame set i in every configuration, so their p50s compare the same
        # work (on the playback's running sets, the pairs differed from run to run, and a query's
        # cost varies 4x with its cameras and answer).
        play.stop()
        n_sets = len(work.frame_sets)
        for i in range(lone):
            # The query may overtake its frames (a loaded machine): asked again, after a longer wait.
            for attempt, settle in enumerate(LONE_SETTLE_S):
                qid = f"lone_{i}" + (f"_again{attempt}" if attempt else "")
                play.publish_set(i)
                time.sleep(settle)
                client.publish_query(qid, work.questions[i % len(work.questions)])
                row = {r["query_id"]: r for r in client.wait_for_answers([qid], timeout=grace_s)}.get(qid)
                if row is None or frame_set_of(row, play.set_of_stamp) == i % n_sets:
                    break
        result.lone_rows = [r for r in client.answers() if r["query_id"].startswith("lone_")]
        return result
    finally:
        result.set_of_stamp = dict(play.set_of_stamp)
        play.stop()


def peak_comparison(results: dict[str, PeakResult]) -> dict:
    """Each configuration against the first (the baseline) of the same run: peak rate ratio,
    greedy answers to the same (question, frame set) pairs (every answer of either run to a pair
    must be the one token sequence), and a lone query's pipeline time: each configuration's p50,
    and the median of the per-query ratios (lone query i is the same question on the same frames
    in every configuration; one pair's time varies by +-30% between runs on a shared machine, and
    the ratio of two p50s of 16 mixed queries, 2 to 14 tokens long, more than the paired median)."""
    labels = list(results)
    base = results[labels[0]]
    base_answers = base.answers()
    rows, differing, compared = [], [], 0
    lines = [f"peak comparison (concurrency {base.concurrency}; ratios against {labels[0] or 'baseline'})",
             f"{'config':<16}{'peak/s':>9}{'x base':>8}{'lone p50 ms':>13}{'x base':>8}{'lone paired':>13}"
             f"{'pairs compared':>16}{'differ':>8}"]
    for label in labels:
        res = results[label]
        pairs = res.answers()
        common = [k for k in pairs if k in base_answers]
        diff = [k for k in common if len(set(pairs[k]) | set(base_answers[k])) > 1]
        if label != labels[0]:
            compared += len(common)
            differing += [f"{label}: {q[:40]!r} on frame set {s}" for q, s in diff]
        ratio = res.peak / base.peak if base.peak else float("nan")
        lone = res.lone_p50() / base.lone_p50() if base.lone_p50() else float("nan")
        mine, theirs = res.lone_ms(), base.lone_ms()
        paired = [mine[q] / theirs[q] for q in mine if theirs.get(q)]
        paired_ratio = statistics.median(paired) if paired else float("nan")
        rows.append({"config": label or "baseline", "peak_rate": res.peak, "peak_vs_base": ratio,
                     "lone_p50_ms": res.lone_p50(), "lone_p50_vs_base": lone, "lone_paired_vs_base": paired_ratio,
                     "pairs_compared": len(common), "pairs_differing": len(diff)})
        lines.append(f"{label or 'baseline':<16}{res.peak:>9.2f}{ratio:>8.2f}{res.lone_p50():>13.1f}{lone:>8.2f}"
                     f"{paired_ratio:>13.2f}{len(common):>16}{len(diff):>8}")
    lines += [f"  DIFF {d}" for d in differing[:10]]
    return {"rows": rows, "pairs_compared": compared, "differing": differing, "table": "\n".join(lines)}
