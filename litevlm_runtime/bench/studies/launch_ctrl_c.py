"""Ctrl-C of the real `ros2 launch litevlm drive.launch.py`, as a terminal sends it, N times.

    litevlm bench --study launch_ctrl_c --setup WS/env.sh [--count 20] [--profile] [--json OUT]
    litevlm bench --study launch_ctrl_c --setup WS/env.sh --during-configure 1.0 [--model DIR] [--count 3]
    litevlm bench --study launch_ctrl_c --setup WS/env.sh --shutdown-during-configure 1.0 [--model DIR]

WS/env.sh is what `bash scripts/ros2_cli.sh WS` writes (the ros2 CLI, launch and this package
built with colcon; docs/ros.md). Each run starts `ros2 launch litevlm drive.launch.py` with the
default launch arguments (the shipped parameters and the bundled model; `--profile` adds
fastdds_profile:=<the package's fastdds_large_data.xml>, `--model DIR` model_dir:=DIR) in a
process group of its own with `ros2 launch` as its leader, as an interactive shell with job control
runs a foreground job, so that Ctrl-C (SIGINT to the group) reaches both launch and the node, and
launch forwards its own SIGINT to the node on top. The node runs in an environment without a Fast
DDS profile unless --profile is given; the client side (this script, `ros2`, `litevlm bag record`)
uses the package's.

Queued questions (the default): once the node is active, `ros2 param set` max_frame_age_s 600 and
queue_size 16 (live), `litevlm bag record` listens (a reliable subscriber in its own process), frame
sets are published on the six camera topics (five, 0.1 s apart), then --queries Queries at once, and
--delay s later SIGINT to the group. A run passes when every question is answered exactly once, the
node logged its summary line and one drain, launch reported "process has finished cleanly" (never "process has
died") and exited 0; the node's warnings about unacknowledged answers are counted.

--during-configure S: SIGINT to the group S s after the node logged "configure: loading". Passes
when launch exits 0 within --within s of the signal, the node logged that configure was cancelled,
and launch neither escalated to SIGTERM nor reported "process has died".
--shutdown-during-configure S: `ros2 lifecycle set /litevlm_drive shutdown` S s into configure
instead: the CLI says "Transitioning successful" and the node ends (exit 0) within --within s.

Prints one line per run and a table; exit 0 when every run passed. tests/ros/test_ros_launch_real.py
runs it (a few runs in the suite, 20 when slow tests run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

NAME = "/litevlm_drive"
ROOT = Path(__file__).resolve().parents[3]
PROFILE = ROOT / "config" / "fastdds_large_data.xml"


def ros2(setup: str, args: str) -> list[str]:
    return ["bash", "-c", f'source "{setup}" && exec ros2 {args}']


class Launch:
    """`ros2 launch litevlm drive.launch.py ARGS` as the leader of its own process group."""

    def __init__(self, setup: str, args: str, env: dict, log: Path):
        self.log_path = log
        self.log = log.open("w")
        self.p = subprocess.Popen(ros2(setup, f"launch litevlm drive.launch.py {args}"), env=env, stdout=self.log,
                                  stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.p.poll() is None:
            if needle in self.text():
                return True
            time.sleep(0.05)
        return needle in self.text()

    def ctrl_c(self) -> float:
        """SIGINT to the whole group (the terminal's Ctrl-C); the time it was sent."""
        os.killpg(self.p.pid, signal.SIGINT)
        return time.monotonic()

    def wait(self, timeout: float) -> int | None:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
        self.log.close()


class Client:
    """Camera and query publishers (rclpy, in this process)."""

    def __init__(self, domain: int):
        import rclpy
        from litevlm_msgs.msg import Query
        from rclpy.qos import QoSProfile, ReliabilityPolicy, qos_profile_sensor_data
        from sensor_msgs.msg import CompressedImage

        from litevlm_runtime.cameras import CAMERAS

        self.ctx = rclpy.Context()
        rclpy.init(context=self.ctx, domain_id=domain)
        self.node = rclpy.create_node("launch_ctrl_c", context=self.ctx)
        self.cameras = {c: self.node.create_publisher(CompressedImage, f"/{c.lower()}/image_raw/compressed",
                                                      qos_profile_sensor_data) for c in CAMERAS}
        self.query = self.node.create_publisher(Query, "/litevlm/query",
                                                QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE))

    def connected(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.query.get_subscription_count() and all(p.get_subscription_count() for p in self.cameras.values()):
                return True
            time.sleep(0.05)
        return False

    def frames(self, seed: int) -> None:
        import io

        import numpy as np
        from builtin_interfaces.msg import Time
        from PIL import Image
        from sensor_msgs.msg import CompressedImage

        stamp = self.node.get_clock().now().nanoseconds
        for i, pub in enumerate(self.cameras.values()):
            rng = np.random.default_rng(seed * 10 + i)
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (108, 192, 3), dtype=np.uint8)).save(buf, format="JPEG")
            msg = CompressedImage(format="jpeg", data=buf.getvalue())
            msg.header.stamp = Time(sec=stamp // 10 ** 9, nanosec=stamp % 10 ** 9)
            pub.publish(msg)

    def ask(self, ids: list[str]) -> None:
        from litevlm_msgs.msg import Query

        for qid in ids:
            msg = Query(id=qid, text=f"What is in front of the car ({qid})?")
            msg.header.stamp = self.node.get_clock().now().to_msg()
            self.query.publish(msg)

    def close(self) -> None:
        import rclpy

        self.node.destroy_node()
        rclpy.shutdown(context=self.ctx)


def client_env(domain: int) -> dict:
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED="1", FASTDDS_DEFAULT_PROFILES_FILE=str(PROFILE))
    env.pop("ROS_AUTOMATIC_DISCOVERY_RANGE", None)
    return env


def node_env(domain: int, profile: bool) -> dict:
    """The launch's environment: no Fast DDS profile at all, unless --profile (then launch sets it)."""
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED="1")
    for var in ("FASTDDS_DEFAULT_PROFILES_FILE", "RMW_FASTRTPS_USE_QOS_FROM_XML", "ROS_AUTOMATIC_DISCOVERY_RANGE"):
        env.pop(var, None)
    return env


def launch_args(args) -> str:
    out = []
    if args.profile:
        out.append(f"fastdds_profile:={PROFILE}")
    if args.model:
        out.append(f"model_dir:={args.model}")
    return " ".join(out)


def node_exit(text: str) -> tuple[int | None, str]:
    """(the node's exit code, launch's line about it): "process has finished cleanly [pid N]" is
    exit 0; "process has died [pid N, exit code C, cmd ...]" is C (negative: killed by signal -C)."""
    m = re.search(r"\[(INFO|ERROR)\] \[litevlm_drive_node-1\]: (process has [^\n]*)", text)
    if not m:
        return None, "(no exit line)"
    line = m.group(2)
    if line.startswith("process has finished cleanly"):
        return 0, line
    code = re.search(r"exit code (-?\d+)", line)
    return (int(code.group(1)) if code else None), line[:80]


def queued_run(args, k: int, work: Path, domain: int) -> dict:
    from litevlm_runtime.bag.compare import read_jsonl

    cenv = client_env(domain)
    launch = Launch(args.setup, launch_args(args), node_env(domain, args.profile), work / f"launch{k}.log")
    recorder = client = None
    out = work / f"answers{k}.jsonl"
    row = {"run": k, "ok": False}
    try:
        if not launch.wait_for("activate: listening", args.start_timeout):
            row["why"] = "node not active"
            return row
        for name, value in (("max_frame_age_s", "600.0"), ("queue_size", "16")):
            for _ in range(5):       # (the CLI's discovery may miss a node that just started: "Node not found")
                r = subprocess.run(ros2(args.setup, f"param set {NAME} {name} {value}"), env=cenv,
                                   capture_output=True, text=True, timeout=120)
                if "successful" in r.stdout:
                    break
            else:
                row["why"] = f"param set {name}: {r.stdout}{r.stderr}"
                return row
        # The recorder keeps listening until it is stopped (no --count): a subscriber that leaves once
        # it has every answer would spare the node's drain its wait for acknowledgements.
        recorder = subprocess.Popen([sys.executable, "-m", "litevlm_runtime.cli", "bag", "record", "--out", str(out),
                                     "--timeout", "300"], env=cenv,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in recorder.stdout:          # (its first lines, until it listens)
            if "record: ready" in line:
                break
        client = Client(domain)
        if not client.connected(60):
            row["why"] = "client not connected"
            return row
        # A camera stream, not one set: best-effort frames published before the node's reader has
        # matched the writer are dropped (1 run of 20 got no_frames for all 12 questions that way).
        for _ in range(5):
            client.frames(k)
            time.sleep(0.1)
        ids = [f"c{k}_{i}" for i in range(args.queries)]
        client.ask(ids)
        time.sleep(args.delay)
        sent = launch.ctrl_c()
        code = launch.wait(60)
        row["exit_s"] = round(time.monotonic() - sent, 2)
        time.sleep(1.0)                      # (answers still in flight to the recorder)
        recorder.send_signal(signal.SIGINT)
        recorder.wait(30)
        rows = read_jsonl(out) if out.exists() else []
        got = Counter(r["query_id"] for r in rows)
        text = launch.text()
        node_code, exit_line = node_exit(text)
        row.update(code=code, node_code=node_code, answered=sum(1 for q in ids if got[q] == 1),
                   twice=sum(1 for q in ids if got[q] > 1),
                   statuses=dict(Counter(r["status"] for r in rows)), exit_line=exit_line,
                   summary="summary:" in text, drains=text.count("stopping: draining the request queue"),
                   unacked=text.count("acknowledged"), sigterm="sending signal 'SIGTERM'" in text)
        row["ok"] = (code == 0 and node_code == 0 and row["answered"] == len(ids) and not row["twice"]
                     and row["summary"] and row["drains"] == 1 and node_code == 0)
        return row
    finally:
        if client is not None:
            client.close()
        if recorder is not None and recorder.poll() is None:
            recorder.kill()
        launch.kill()


class NodeWatch:
    """When (wall clock) the node process of a launch ended: its pid from launch's "process
    started with pid [N]", polled every 10 ms."""

    def __init__(self, launch: Launch):
        m = re.search(r"process started with pid \[(\d+)\]", launch.text())
        self.pid = int(m.group(1)) if m else None
        self.ended = None
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while self.pid is not None and Path(f"/proc/{self.pid}").exists():
            time.sleep(0.01)
        self.ended = time.time()

    def wait(self, timeout: float) -> float | None:
        self._thread.join(timeout)
        return self.ended


def logged_at(text: str, needle: str) -> float | None:
    """The ROS timestamp (wall clock, s) of the node's first log line containing `needle`."""
    m = re.search(r"\[(\d+\.\d+)\] \[[^\]]+\]: " + re.escape(needle), text)
    return float(m.group(1)) if m else None


def configure_run(args, k: int, work: Path, domain: int) -> dict:
    """Ctrl-C (or a lifecycle shutdown) S s into configure: the node's end is timed from the
    signal (or from the node's log line saying it got the shutdown request: the ros2 CLI itself
    takes seconds to start on a loaded machine) to the end of its process."""
    cenv = client_env(domain)
    launch = Launch(args.setup, launch_args(args), node_env(domain, args.profile), work / f"launch{k}.log")
    row = {"run": k, "ok": False}
    try:
        if not launch.wait_for("configure: loading", args.start_timeout):
            row["why"] = "configure never began"
            return row
        watch = NodeWatch(launch)
        if args.during_configure is not None:
            time.sleep(args.during_configure)
            sent = time.time()
            launch.ctrl_c()
        else:
            time.sleep(args.shutdown_during_configure)
            try:
                r = subprocess.run(ros2(args.setup, f"lifecycle set {NAME} shutdown"), env=cenv, capture_output=True,
                                   text=True, timeout=60)
                row["cli"] = (r.stdout + r.stderr).strip()
            except subprocess.TimeoutExpired:
                row["cli"] = "(no reply in 60 s)"
            sent = logged_at(launch.text(), "configure cancelled (lifecycle shutdown")
        ended = watch.wait(30)
        code = launch.wait(30)       # (after a lifecycle shutdown the node ends, and launch, idle then, too)
        text = launch.text()
        if sent is not None and ended is not None:
            row["exit_s"] = round(ended - sent, 2)
            row["into_configure_s"] = round(sent - logged_at(text, "configure: loading"), 2)
        node_code, exit_line = node_exit(text)
        row.update(code=code, node_code=node_code, exit_line=exit_line, sigterm="sending signal 'SIGTERM'" in text,
                   cancelled="configure cancelled" in text, summary="summary:" in text)
        row["ok"] = (code == 0 and node_code == 0 and row.get("exit_s", 1e9) <= args.within and row["cancelled"]
                     and not row["sigterm"] and row.get("cli", "Transitioning successful").endswith("successful"))
        return row
    finally:
        launch.kill()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setup", default=os.environ.get("LITEVLM_ROS2_SETUP", ""),
                    help="the ROS environment script of scripts/ros2_cli.sh (default: $LITEVLM_ROS2_SETUP)")
    ap.add_argument("--count", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="launch with fastdds_profile:=config/fastdds_large_data.xml")
    ap.add_argument("--model", default="", help="model_dir:= for the launch (default: the bundled model)")
    ap.add_argument("--queries", type=int, default=12)
    ap.add_argument("--delay", type=float, default=0.3, help="seconds between the queries and Ctrl-C")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--during-configure", type=float, metavar="S", help="Ctrl-C S s into configure instead")
    mode.add_argument("--shutdown-during-configure", type=float, metavar="S",
                      help="`ros2 lifecycle set ... shutdown` S s into configure instead")
    ap.add_argument("--within", type=float, default=3.0, help="configure modes: the node must end within this (s)")
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--domain", type=int, default=100 + os.getpid() % 50)
    ap.add_argument("--json", type=Path, help="write the runs here")
    ap.add_argument("--keep", type=Path, help="keep the launch logs in this folder")
    args = ap.parse_args(argv)
    if not args.setup:
        ap.error("--setup WS/env.sh (or LITEVLM_ROS2_SETUP) is required: scripts/ros2_cli.sh builds it")
    configure = args.during_configure is not None or args.shutdown_during_configure is not None
    work = args.keep or Path(tempfile.mkdtemp(prefix="launch_ctrl_c_"))
    work.mkdir(parents=True, exist_ok=True)
    what = ("Ctrl-C" if args.during_configure is not None else "lifecycle shutdown") if configure else "Ctrl-C"
    print(f"launch_ctrl_c: {args.count} runs, {what}{' during configure' if configure else ' with queued questions'}, "
          f"{'with' if args.profile else 'without'} the Fast DDS profile, model {args.model or 'bundled'}; "
          f"load {open('/proc/loadavg').read().split()[0]}; logs in {work}", flush=True)
    rows = []
    # The domain's ros2 daemon up before the first run, as in a terminal that has used the CLI: one the
    # CLI starts itself has not discovered the node yet and answers "Node not found" (what is measured
    # here is the node's stop, not the CLI's discovery)
    subprocess.run(ros2(args.setup, "daemon start"), env=client_env(args.domain), capture_output=True, timeout=60)
    try:
        for k in range(args.count):
            row = (configure_run if configure else queued_run)(args, k, work, args.domain)
            rows.append(row)
            print(json.dumps(row), flush=True)
    finally:                                  # (the daemon the ros2 CLI started for this domain)
        subprocess.run(ros2(args.setup, "daemon stop"), env=client_env(args.domain), capture_output=True, timeout=60)
    passed = sum(r["ok"] for r in rows)
    exits = sorted(r["exit_s"] for r in rows if "exit_s" in r)
    print("\n| runs | passed | node exit code 0 | launch exit code 0 | finished cleanly | SIGTERM from launch "
          "| request -> exit, median / max |")
    print("|---|---|---|---|---|---|---|")
    print(f"| {len(rows)} | {passed} | {sum(r.get('node_code') == 0 for r in rows)} | "
          f"{sum(r.get('code') == 0 for r in rows)} | "
          f"{sum(r.get('exit_line', '').startswith('process has finished cleanly') for r in rows)} | "
          f"{sum(bool(r.get('sigterm')) for r in rows)} | "
          + (f"{exits[len(exits) // 2]:.2f} / {exits[-1]:.2f} s |" if exits else "- |"))
    if not configure:
        print(f"questions answered once: {sum(r.get('answered', 0) for r in rows)} of {args.queries * len(rows)}; "
              f"'acknowledged' warnings: {sum(r.get('unacked', 0) for r in rows)}; "
              f"load {open('/proc/loadavg').read().split()[0]}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if passed == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
