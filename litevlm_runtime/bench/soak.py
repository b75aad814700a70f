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

This module is the harness (the node's process, playback, the soak and the bisection);
`dds_client.py` the DDS side, `soak_workload.py` the bag's frames and questions, `soak_stats.py`
the accounting and tables. `DDSClient`, `NodeProcess` and `LoggedProcess` are also what the DDS
tests drive the node with.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .dds_client import DDSClient
from .soak_stats import PeakResult, SoakResult, Trial, frame_set_of
from .soak_workload import Workload


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
# Playback
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


@dataclass(frozen=True)
class SoakPlan:
    """A soak (`bag soak`'s flags): `count` queries at `rate` per second, `concurrency` at once, with
    query ids starting `prefix`; frame sets published at `frame_rate`; the first `warmup` answers left
    out of the statistics; answers awaited for `grace_s` after the last is sent."""
    count: int
    rate: float
    frame_rate: float = 2.0
    warmup: int = 10
    grace_s: float = 30.0
    prefix: str = "soak"
    concurrency: int = 1


def soak(client: DDSClient, work: Workload, plan: SoakPlan, node: NodeProcess | None = None,
         progress=print) -> SoakResult:
    count, rate = plan.count, plan.rate
    play = Playback(client, work, plan.frame_rate, node).start()
    time.sleep(0.5)                  # the first frame set arrives before the first question
    try:
        t0 = time.monotonic()

        def report(n: int) -> None:
            progress(f"soak: {n}/{count} sent, {len(client.answers())} answered, node RSS "
                     f"{(node.rss_bytes() / 2**20) if node else float('nan'):.1f} MB")
        sent = play.send(count, rate, plan.prefix, every_s=30.0, on_every=report, concurrency=plan.concurrency)
        rows = client.wait_for_answers([q for q, _ in sent], timeout=plan.grace_s, quiet_s=1.0)
        duration = time.monotonic() - t0
    finally:
        play.stop()
    return SoakResult(rate, sent, rows, dict(play.set_of_stamp), list(play.rss), plan.warmup, duration,
                      pipeline_of(node))


# --------------------------------------------------------------------------------------------
# Peak rate
LONE_SETTLE_S = (0.3, 1.0, 3.0)     # waits for a lone query's frames to reach the node (DDS orders no topics)


@dataclass(frozen=True)
class PeakPlan:
    """A peak-rate search (`bag peak`'s flags): rates between `lo` and `hi` per second, `steps`
    bisections, `trial_count` queries a trial, a trial passing under `max_queue_full` queue_full
    answers; frame sets at `frame_rate`, answers awaited `grace_s`; `concurrency` queries at once;
    `lone` queries one at a time afterwards."""
    lo: float = 0.5
    hi: float = 64.0
    steps: int = 6
    trial_count: int = 60
    max_queue_full: float = 0.05
    frame_rate: float = 2.0
    grace_s: float = 30.0
    concurrency: int = 1
    lone: int = 0


def peak(client: DDSClient, work: Workload, plan: PeakPlan = PeakPlan(), progress=print) -> PeakResult:
    """Bisection for the highest rate with under max_queue_full queue_full answers: first `hi`
    (if it passes, that is the answer), then `lo` (if it fails, the search goes down by halves),
    then `steps` geometric midpoints. `concurrency` N: queries come N at once (N clients);
    `lone` > 0: afterwards that many queries one at a time, each after the last was answered
    (a lone query's latency)."""
    lo, hi, max_queue_full, grace_s, concurrency = plan.lo, plan.hi, plan.max_queue_full, plan.grace_s, plan.concurrency
    play = Playback(client, work, plan.frame_rate).start()
    time.sleep(0.5)
    result = PeakResult(max_queue_full=max_queue_full, concurrency=concurrency, frame_sets=len(work.frame_sets))
    n_trial = [0]

    def trial(rate: float) -> bool:
        n_trial[0] += 1
        prefix = f"peak{n_trial[0]}_"
        sent = play.send(plan.trial_count, rate, prefix, concurrency=concurrency)
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
        for _ in range(plan.steps):
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
        for i in range(plan.lone):
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
