"""What the DDS tests share: an own ROS_DOMAIN_ID per test, the environment for child processes,
a child process with its log, and a client node that does what `ros2 lifecycle`, `ros2 param`
and `ros2 topic` do (the same services and topics; the real ros2 CLI, which is not a wheel, drives
the node in test_ros_launch_real.py when built)."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from litevlm_runtime.bag.compare import read_jsonl
from litevlm_runtime.bench.soak import LoggedProcess

ROOT = Path(__file__).resolve().parents[2]
PROFILE = ROOT / "config" / "fastdds_large_data.xml"


def domain_id(k: int) -> int:
    """Own DDS domain per test and per test run. k: 1..49, one per test, never shared: 1..3
    test_ros_replay, 4 test_bag_replay, 5..9 the node tests, 10..14 test_ros_reliability, 15..17
    the bag tools agreeing, 18 lifecycle services, 19 explanations, 22 batching, 23 follow-ups,
    24..31 reconfigure, memory, bags as they come, shutdown, the real launch, 32 partials, 33 and
    37 the node serving OpenVINO and int4 (test_node_backends), 34..35 frame sets over time and
    standing questions, 36 priority, 39 a sequence bag into the real launch, 40..44 the soak/peak
    harness, 45..46 callback faults, 47 a lost change_state reply. Concurrent suites on one
    machine (the pid's residue picks one of four blocks of 50) collide only if their pids do mod 4."""
    if not 1 <= k < 50:
        raise ValueError(f"domain_id({k}): k is 1..49 (one per test)")
    return 1 + (os.getpid() % 4) * 50 + k


def ros_env(domain: int, **extra) -> dict:
    env = dict(os.environ)
    env.update(ROS_DOMAIN_ID=str(domain), FASTDDS_DEFAULT_PROFILES_FILE=str(PROFILE), PYTHONUNBUFFERED="1", **extra)
    env.pop("ROS_AUTOMATIC_DISCOVERY_RANGE", None)      # it would override the profile (ENVIRONMENT.md)
    return env


class Proc(LoggedProcess):
    """A child process (by default `python -m litevlm_runtime.cli ARGS`) with its output in a log file."""

    def __init__(self, args: list[str], env: dict, log: Path, cmd: list[str] | None = None, cwd: Path = ROOT):
        super().__init__(cmd or [sys.executable, "-m", "litevlm_runtime.cli", *args], log, env, cwd)

    def wait(self, timeout: float) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{self.log.name} still running after {timeout} s:\n{self.text()[-3000:]}") from None

    def alive(self) -> bool:
        return self.p.poll() is None

    def stop(self) -> int:
        return super().stop(signal.SIGINT, timeout=15)


def shm_segments() -> set[str]:
    """The names in /dev/shm (Fast DDS's shared-memory transport segments, port queues and
    data-sharing pools live there; the lock files and semaphores beside them are left out)."""
    root = Path("/dev/shm")
    return {p.name for p in root.iterdir() if not p.name.endswith("_el") and not p.name.startswith("sem.")} \
        if root.is_dir() else set()


def unmapped(names: set[str]) -> set[str]:
    """Those of `names` that no running process maps: what an exited process left behind."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped |= {line.rsplit("/dev/shm/", 1)[1].strip() for line in maps.read_text().splitlines()
                       if "/dev/shm/" in line}
        except OSError:                     # a process that ended while we read
            continue
    return {n for n in names if n not in mapped and (Path("/dev/shm") / n).exists()}


def write_params(path: Path, **values) -> Path:
    """A params file for the node in any namespace (`/**/litevlm_drive`, as config/drive.yaml)."""
    lines = ["/**/litevlm_drive:", "  ros__parameters:"]
    for k, v in values.items():
        lines.append(f"    {k}: {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


def jpeg(seed: int, size=(192, 108)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(buf, format="JPEG")
    return buf.getvalue()


class RosClient:
    """A plain rclpy node in its own context on `domain`, spun by the test's own thread."""

    def __init__(self, domain: int, name: str = "test_client"):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor

        os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(PROFILE)
        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx, domain_id=domain)
        self.node = rclpy.create_node(name, context=self.ctx)
        self.executor = SingleThreadedExecutor(context=self.ctx)
        self.executor.add_node(self.node)

    def close(self) -> None:
        import rclpy

        self.node.destroy_node()
        rclpy.shutdown(context=self.ctx)

    def spin_until(self, cond, timeout: float) -> bool:
        end = time.time() + timeout
        while not cond() and time.time() < end:
            self.executor.spin_once(timeout_sec=0.05)
        return bool(cond())

    def spin_for(self, seconds: float) -> None:
        self.spin_until(lambda: False, seconds)

    def call(self, srv_type, name: str, request, timeout: float = 30.0, resend_s: float | None = 5.0):
        """One service call, as the ros2 CLI makes it: wait for the service, call, wait for the answer
        (`ask` on a client made for this call)."""
        client = self.node.create_client(srv_type, name)
        try:
            return self.ask(client, request, timeout, resend_s)
        finally:
            self.node.destroy_client(client)

    def ask(self, client, request, timeout: float = 30.0, resend_s: float | None = 5.0, unless=lambda: False):
        """The answer to `request` on a service client the caller keeps; None when `unless()` turned
        true before it came.

        `service_is_ready` can turn true before the server's reply writer has matched this
        client's reply reader; a request sent in that window is served and its reply is lost
        (seen once in CI: get_state unanswered for 30 s). Idempotent calls are therefore sent
        again every `resend_s` until one is answered; resend_s=None sends once, after a grace
        period for discovery to finish (for change_state, which must not run twice)."""
        end = time.time() + timeout
        assert self.spin_until(client.service_is_ready, timeout), f"service {client.srv_name} not available"
        if resend_s is None:
            self.spin_for(1.0)
        while True:
            future = client.call_async(request)
            attempt = timeout if resend_s is None else min(resend_s, max(end - time.time(), 0.0))
            if self.spin_until(lambda: future.done() or unless(), attempt) and future.done():
                return future.result()
            client.remove_pending_request(future)          # unanswered: a late reply has no one to reach
            if unless():
                return None
            assert resend_s is not None and time.time() < end, f"no answer from {client.srv_name}"

    # `ros2 lifecycle set|get NODE ...`
    def lifecycle_set(self, node: str, transition: str) -> bool:
        from lifecycle_msgs.msg import Transition
        from lifecycle_msgs.srv import ChangeState

        req = ChangeState.Request()
        known = getattr(Transition, f"TRANSITION_{transition.upper()}", None)
        if known is None:              # shutdown: one transition per state, asked by its label as ros2 does
            req.transition.label = transition
        else:
            req.transition.id = known
        # change_state must not be sent twice, so a lost reply (the discovery race `ask` describes:
        # the server drops a reply its writer has not matched in time) would leave nothing to go on.
        # The node also publishes every transition on `transition_event`: when its final event (into
        # a primary state) has come and the reply has not followed within 5 s, the outcome is read
        # from the event: success leaves the state the transition started from, failure returns to it.
        from lifecycle_msgs.msg import State, TransitionEvent

        before = self.lifecycle_get(node)
        ended: list[tuple[float, str]] = []

        def on_event(event):
            if event.goal_state.id < State.TRANSITION_STATE_CONFIGURING:
                ended.append((time.time(), event.goal_state.label))
        events = self.node.create_subscription(TransitionEvent, f"{node}/transition_event", on_event, 10)
        client = self.node.create_client(ChangeState, f"{node}/change_state")
        try:
            reply = self.ask(client, req, timeout=300, resend_s=None,
                             unless=lambda: bool(ended) and time.time() - ended[-1][0] > 5.0)
            return reply.success if reply is not None else ended[-1][1] != before
        finally:
            self.node.destroy_client(client)
            self.node.destroy_subscription(events)

    def lifecycle_get(self, node: str) -> str:
        from lifecycle_msgs.srv import GetState

        return self.call(GetState, f"{node}/get_state", GetState.Request()).current_state.label

    # `ros2 param describe|get|set NODE NAME [VALUE]`
    def param_describe(self, node: str, names: list[str]):
        from rcl_interfaces.srv import DescribeParameters

        return self.call(
            DescribeParameters, f"{node}/describe_parameters", DescribeParameters.Request(names=names)
        ).descriptors

    def param_get(self, node: str, name: str):
        from rcl_interfaces.srv import GetParameters
        from rclpy.parameter import parameter_value_to_python

        values = self.call(GetParameters, f"{node}/get_parameters", GetParameters.Request(names=[name])).values
        return parameter_value_to_python(values[0])

    def param_set(self, node: str, name: str, value):
        """-> SetParametersResult (successful, reason)."""
        from rcl_interfaces.srv import SetParameters
        from rclpy.parameter import Parameter

        req = SetParameters.Request(parameters=[Parameter(name, value=value).to_parameter_msg()])
        return self.call(SetParameters, f"{node}/set_parameters", req).results[0]


class Rig:
    """Camera and query publishers plus answer subscribers for one node's topics under `prefix`
    ("" or "/car1"), with the shipped names."""

    def __init__(self, client: RosClient, prefix: str = ""):
        from litevlm_msgs.msg import Answer, Query
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import CompressedImage

        from litevlm_runtime.cameras import CAMERAS

        reliable = QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE)
        self.client, self.prefix = client, prefix
        self.cameras = {c: client.node.create_publisher(CompressedImage, f"{prefix}/{c.lower()}/image_raw/compressed",
                                                        qos_profile_sensor_data) for c in CAMERAS}
        self.query = client.node.create_publisher(Query, f"{prefix}/litevlm/query", reliable)
        self.answers: list = []
        client.node.create_subscription(Answer, f"{prefix}/litevlm/answer", self.answers.append, reliable)

    def connected(self) -> bool:
        return (self.query.get_subscription_count() > 0 and self.client.node.count_publishers(
            f"{self.prefix}/litevlm/answer") > 0 and all(p.get_subscription_count() > 0 for p in self.cameras.values()))

    def frames(self, seed: int, stamp_ns: int | None = None) -> int:
        """One frame set (each camera its own image) stamped now or stamp_ns; returns the stamp."""
        from builtin_interfaces.msg import Time
        from sensor_msgs.msg import CompressedImage

        stamp = self.client.node.get_clock().now().nanoseconds if stamp_ns is None else stamp_ns
        for i, (cam, pub) in enumerate(self.cameras.items()):
            msg = CompressedImage(format="jpeg", data=jpeg(seed * 10 + i))
            msg.header.stamp = Time(sec=stamp // 10 ** 9, nanosec=stamp % 10 ** 9)
            pub.publish(msg)
        return stamp

    def ask(self, query_id: str, text: str, **fields) -> None:
        """Publish a Query stamped now; `fields`: its other fields (priority, follow_up_of, ...)."""
        from litevlm_msgs.msg import Query

        msg = Query(id=query_id, text=text, **fields)
        msg.header.stamp = self.client.node.get_clock().now().to_msg()
        self.query.publish(msg)


def run_replay(tmp_path: Path, bag: Path, params: Path, n_answers: int, domain: int, timeout: float = 150,
               node_ready_s: float = 120, served=None):
    """node (`litevlm drive --params`) + recorder + replayer; returns the recorded rows and the
    node's log. `served()`: called once every answer is recorded, before the node stops."""
    env = ros_env(domain)
    out = tmp_path / "recorded.jsonl"
    recorder = Proc(["bag", "record", "--out", str(out), "--bag", str(tmp_path / "answers_bag"),
                     "--count", str(n_answers), "--timeout", str(timeout)], env, tmp_path / "record.log")
    node = Proc(["drive", "--params", str(params)], env, tmp_path / "node.log")
    replayer = None
    try:
        node.wait_for("ready (active)", timeout=node_ready_s)
        recorder.wait_for("record: ready", timeout=60)
        replayer = Proc(["bag", "replay", str(bag), "--params", str(params)], env, tmp_path / "replay.log")
        assert replayer.wait(timeout) == 0, replayer.text()
        assert recorder.wait(timeout) == 0, recorder.text() + node.text()[-3000:]
        if served is not None:
            served()
    finally:
        for p in (replayer, recorder, node):
            if p is not None:
                p.stop()
    return read_jsonl(out), node.text()


def record_topic(tmp_path: Path, env: dict, name: str, topic: str, count: int | None = None) -> tuple[Proc, Path]:
    """`litevlm bag record` of `topic` into NAME.jsonl (until `count` answers; without one, until
    stopped), started and subscribed."""
    out = tmp_path / f"{name}.jsonl"
    until = ["--count", str(count), "--timeout", "240"] if count else []
    proc = Proc(["bag", "record", "--out", str(out), "--topic", topic, *until], env, tmp_path / f"{name}.log")
    proc.wait_for("record: ready", timeout=90)
    return proc, out


def sequence_bag(root: Path, frames: int = 4, scenes: int = 3, seed: int = 4545, query_frames: int | None = None,
                 questions: int = 2) -> Path:
    """A bag of SynthDrive in motion (`synth --frames K`, 0.5 s stride, 160 x 90, in root/synth) made
    as `bag make --from-synth --query-frames K` makes it: `questions` per key frame, each over K
    frame sets (query_frames: another Query.frames; 0: the node's temporal.frames)."""
    from litevlm_runtime.bag.io import write_bag
    from litevlm_runtime.bag.make import drivelm_contents
    from litevlm_runtime.synth.generate import SynthSpec, generate

    generate(root / "synth", SynthSpec(scenes, seed, 160, 90, val_fraction=0.0, frames=frames, stride=0.5), workers=1,
             progress=False)
    return write_bag(drivelm_contents(root / "synth", questions_per_frame=questions,
                                      query_frames=frames if query_frames is None else query_frames), root / "bag")


def replayed_as_evaluated(tmp_path: Path, env: dict, bag: Path, params: Path, evaluated: list[dict], label: str,
                          node_text=lambda: "") -> list[dict]:
    """Replay `bag` into the running node and record its answers: every query answered once, each
    as `bag eval` answered it (`evaluated`: its JSON rows). Returns the recorded rows."""
    from litevlm_runtime.bag.compare import compare_runs

    recorder, out = record_topic(tmp_path, env, label, "/litevlm/answer", len(evaluated))
    replayer = Proc(["bag", "replay", str(bag), "--params", str(params)], env, tmp_path / f"replay_{label}.log")
    try:
        assert replayer.wait(240) == 0, replayer.text()
        assert recorder.wait(240) == 0, recorder.text() + node_text()[-3000:]
    finally:
        replayer.stop()
        recorder.stop()
    rows = read_jsonl(out)
    assert sorted(r["query_id"] for r in rows) == sorted(e["query_id"] for e in evaluated)     # one answer each
    cmp = compare_runs(evaluated, rows)
    assert cmp.matched == len(evaluated) and cmp.ok, (label, cmp.differences)
    return rows
