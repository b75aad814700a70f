"""Reliability of the node over real DDS on loopback (issue 14): `litevlm drive` as a child
process on its own ROS_DOMAIN_ID, fed and watched by the soak harness's DDS client in this
process. SIGINT/SIGTERM with queued queries, a 1,000-query burst in one second, and frames
stamped in the future."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest
from helpers.ros import PROFILE, ROOT, domain_id, jpeg, ros_env, write_params

from litevlm_runtime.bench.dds_client import DDSClient
from litevlm_runtime.bench.soak import NodeProcess
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.ros.params_file import load_node_params

S = 1_000_000_000


def frame_set(seed: int = 0) -> dict:
    """camera -> (sensor_msgs/CompressedImage of a random JPEG, offset 0)."""
    from sensor_msgs.msg import CompressedImage

    return {
        cam: (CompressedImage(format="jpeg", data=jpeg(10 * seed + i, (160, 90))), 0) for i, cam in enumerate(CAMERAS)
    }


@pytest.fixture
def graph(tmp_path, tiny_model, monkeypatch):
    """start(k, **params) -> (node process, DDS client) on a private domain; stopped afterwards."""
    monkeypatch.setenv("FASTDDS_DEFAULT_PROFILES_FILE", str(PROFILE))
    started = []

    def start(k: int, **over):
        values = dict(model_dir=str(tiny_model), max_new_tokens=4, queue_size=4, max_frame_age_s=60.0)
        values.update(over)
        params = write_params(tmp_path / f"drive{k}.yaml", **values)
        domain = domain_id(k)
        node = NodeProcess(params, tmp_path / f"node{k}.log", env=ros_env(domain), cwd=ROOT)
        started.append(node)
        node.wait_for("ready (active)", timeout=120)
        client = DDSClient(load_node_params(params), domain_id=domain)
        started.append(client)
        client.wait_for_node()
        return node, client

    yield start
    for thing in reversed(started):
        if isinstance(thing, DDSClient):
            thing.close()
        else:
            thing.stop(signal.SIGINT, timeout=30)    # (SIGKILL left each node's DDS segment in /dev/shm)


def answered_once(rows, ids):
    counts = Counter(r["query_id"] for r in rows)
    return {q for q in ids if counts[q] == 1}, [q for q, n in counts.items() if n > 1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_with_queued_queries_answers_every_query(graph, sig):
    k = 11 if sig == signal.SIGINT else 12
    node, client = graph(k, max_new_tokens=32, queue_size=16)
    client.publish_frames(frame_set(), client.now_ns())
    time.sleep(0.3)
    ids = [f"s{i}" for i in range(16)]
    for qid in ids:
        client.publish_query(qid, f"What is in front of the car {qid}?")
    end = time.monotonic() + 60
    while not client.answers() and time.monotonic() < end:
        time.sleep(0.005)
    assert node.stop(sig, timeout=30) == 0, node.text()[-3000:]     # the first is answered: stop now
    rows = client.wait_for_answers(ids, timeout=5, quiet_s=0.5)
    once, twice = answered_once(rows, ids)
    assert once == set(ids) and not twice, (sorted(set(ids) - once), twice, node.text()[-3000:])
    statuses = Counter(r["status"] for r in rows)
    assert set(statuses) <= {"ok", "shutting_down"} and statuses["ok"] >= 1, statuses
    assert statuses["shutting_down"] >= 1, statuses                 # some were still queued
    log = node.text()
    assert "Failed to publish" not in log and "context is invalid" not in log
    assert (
        f"summary: 16 answered ({statuses['shutting_down']} errors: shutting_down {statuses['shutting_down']})" in log
    )


def test_a_burst_of_1000_queries_in_one_second_gets_1000_answers(graph):
    node, client = graph(13)
    client.publish_frames(frame_set(), client.now_ns())
    time.sleep(0.3)
    ids = [f"b{i}" for i in range(1000)]
    t0 = time.monotonic()
    for i, qid in enumerate(ids):
        delay = t0 + i / 1000 - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        client.publish_query(qid, f"Burst question {i}?")
    sent_s = time.monotonic() - t0
    rows = client.wait_for_answers(ids, timeout=30, quiet_s=0.5)
    answered_s = time.monotonic() - t0
    once, twice = answered_once(rows, ids)
    statuses = Counter(r["status"] for r in rows)
    print(f"burst: 1000 sent in {sent_s:.2f} s, answered in {answered_s:.2f} s: {dict(statuses)}")
    assert len(once) == 1000 and not twice, (1000 - len(once), twice[:5])
    assert set(statuses) <= {"ok", "queue_full"} and statuses["ok"] >= 4, statuses
    # It really was a burst: the 4-deep queue overflowed (a correctness observable; how long the
    # publisher took depends on the machine's load and is only printed).
    assert statuses["queue_full"] >= 1, statuses


def test_future_stamped_frames_are_not_served(graph):
    from diagnostic_msgs.msg import DiagnosticArray

    node, client = graph(14, max_frame_age_s=1.0)
    diags = []
    client.node.create_subscription(DiagnosticArray, "/diagnostics", diags.append, 10)
    client.publish_frames(frame_set(), client.now_ns() + 5 * S)        # every camera 5 s ahead
    time.sleep(0.3)
    client.publish_query("future", "What is in front?")
    rows = client.wait_for_answers(["future"], timeout=10)
    assert [(r["query_id"], r["status"]) for r in rows] == [("future", "bad_stamp")]
    assert "ahead of the node's clock" in rows[0]["status_message"] and "CAM_FRONT" in rows[0]["status_message"]
    client.publish_frames(frame_set(1), client.now_ns())                 # correctly stamped: served at once
    time.sleep(0.3)
    client.publish_query("now", "What is in front?")
    rows = client.wait_for_answers(["future", "now"], timeout=10)
    assert rows[-1]["query_id"] == "now" and rows[-1]["status"] == "ok", rows[-1]
    end = time.monotonic() + 10
    while time.monotonic() < end:
        values = {kv.key: kv.value for d in diags[-1:] for kv in d.status[0].values}
        if values.get("status.ok") == "1":
            break
        time.sleep(0.1)
    assert values["camera.CAM_FRONT.bad_stamp"] == "1" and values["bad_stamp_frames"] == "6"
    assert values["status.bad_stamp"] == "1"


# Six cameras at 5 Hz in a process of their own, as cameras are (argv: the first stamp, how many sets):
# set k stamped base + k * 200 ms, published at that time, each camera its own image (frame_set(k)).
CAMERAS_5HZ = """
import sys, time, rclpy
from rclpy.qos import QoSProfile, ReliabilityPolicy
from sensor_msgs.msg import CompressedImage
from helpers.ros import jpeg
from litevlm_runtime.cameras import CAMERAS
base, count = int(sys.argv[1]), int(sys.argv[2])
rclpy.init()
node = rclpy.create_node("cameras_5hz")
qos = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
pubs = [node.create_publisher(CompressedImage, f"/{c.lower()}/image_raw/compressed", qos) for c in CAMERAS]
sets = [[jpeg(10 * k + i, (160, 90)) for i in range(len(CAMERAS))] for k in range(count)]
for k, images in enumerate(sets):
    t = base + k * 200_000_000
    delay = (t - time.time_ns()) / 1e9
    if delay > 0:
        time.sleep(delay)
    for pub, data in zip(pubs, images):
        msg = CompressedImage(format="jpeg", data=data)
        msg.header.stamp.sec, msg.header.stamp.nanosec = t // 10**9, t % 10**9
        pub.publish(msg)
"""


def test_stamped_questions_and_a_flood_get_the_frames_of_their_stamps_twice_alike(graph):
    """Issue 42, over DDS: six cameras at 5 Hz (each set its own images, stamped on a 200 ms grid).
    Queries stamped 2 s and 3 s back are answered ok from the newest set at or before their stamps
    (with 8 frames held they got no_frames naming every camera); one stamped 10 s back, older than
    the 5 s window, gets too_old naming its age and the window; a flood of 1,000 stamped queries in
    one second gets no no_frames (each answered from the set of its stamp, or queue_full; now and then
    the set before it, where a best-effort camera reader dropped a frame); and a second run with the
    same stamps relative to the stream gives the same answers."""
    # match_wait_s 3.0: as_asked takes a query's set once every camera has sent a frame from after its
    # stamp, or match_wait_s after the query was taken; the same set every run needs the frames to come
    # within that wait, and on this shared 2-core machine (load 5-10) the camera process's frames were
    # 0.2 s (the default) late in 1 of 4 runs, and in a full suite run beside three other processes'
    # tests more than 1 s late (a flood query stamped 11.801 s took the 11.6 s set): 3 s, so the rule is
    # what the test checks, not the load. /diagnostics' frame_delay_ms shows how late they come.
    node, client = graph(10, max_frame_age_s=1.0, max_new_tokens=6, match_wait_s=3.0)
    grid = S // 5

    def one_run(tag: str) -> dict:
        base = (client.now_ns() // grid + 10) * grid          # (the camera process starts meanwhile)
        streamer = subprocess.Popen([sys.executable, "-c", CAMERAS_5HZ, str(base), "90"], env=ros_env(domain_id(10)),
                                    cwd=ROOT / "tests")
        asked = {}                                   # id -> stamp offset from base (ns)

        def ask(qid, offset, text):
            asked[qid] = offset
            client.publish_query(qid, text, stamp_ns=base + offset)
        while client.now_ns() < base + 11 * S:        # 11 s of stream: 10 s back is before the window
            time.sleep(0.05)
        ask(f"{tag}-back2", 11 * S - 2 * S + 50_000_000, "What is in front of the car, two seconds ago?")
        ask(f"{tag}-back3", 11 * S - 3 * S + 120_000_000, "What is behind the car, three seconds ago?")
        ask(f"{tag}-back10", 11 * S - 10 * S, "What was there ten seconds ago?")
        t0 = time.monotonic()
        flood0 = 11 * S + 100_000_000
        for i in range(1000):                        # 1,000 stamped queries in one second
            delay = t0 + 0.1 + i / 1000 - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            ask(f"{tag}-f{i}", flood0 + i * 1_000_000, f"Flood question {i % 7}?")
        rows = client.wait_for_answers(list(asked), timeout=60, quiet_s=0.5)
        streamer.kill()
        streamer.wait()
        flood_rows = [r for r in rows if r["query_id"].startswith(f"{tag}-f")]
        took = (max(r["received_ns"] for r in flood_rows) - (base + flood0)) / S if flood_rows else -1
        got = {r["query_id"]: r for r in rows if r["query_id"] in asked}
        assert len(got) == len(asked), f"{len(asked) - len(got)} unanswered:\n{node.text()[-2000:]}"
        out = {}
        for qid, r in got.items():
            key = qid.split("-", 1)[1]
            if r["status"] == "ok":
                # a whole set at or before the stamp: every camera's frame from one grid step, the newest
                # such step unless the node's best-effort camera readers (sensor QoS, depth 5) dropped one
                # of its frames while the flood kept the executor busy: then the step before it
                k = asked[qid] // grid
                stamps = r["frame_stamps_ns"].values()
                taken = {(s - base) // grid for s in stamps}
                step = min(taken)
                assert len(taken) == 1 and k - 2 <= step <= k and all((s - base) % grid == 0 for s in stamps), (
                    qid, asked[qid], r["frame_stamps_ns"])
                out[key] = ("ok" if step == k else "older_set", step, r["answer"])
            else:
                out[key] = (r["status"], None, r["status_message"])
        for key in ("back2", "back3"):
            assert out[key][0] == "ok", out[key]
        status, _, message = out["back10"]
        # the age is the node's clock at matching minus the stamp: 10 s plus however long the question
        # waited (0.17 s on a loaded CI machine), so only its lower bound is the node's behaviour
        said_age = re.search(r"stamped (\d+\.\d+) s ago", message)
        assert status == "too_old" and said_age and float(said_age.group(1)) >= 10.0, out["back10"]
        assert "frame_window_s 5" in message, out["back10"]
        flood = Counter(out[f"f{i}"][0] for i in range(1000))
        odd = [(i, out[f"f{i}"]) for i in range(1000) if out[f"f{i}"][0] not in ("ok", "older_set", "queue_full")]
        assert set(flood) <= {"ok", "older_set", "queue_full"} and flood["ok"] >= 4, (flood, odd[:3], tag)
        assert flood["older_set"] <= flood["ok"], (flood, tag)      # a dropped frame now and then, not the rule
        print(f"run {tag}: flood {dict(flood)}, every answer {took:.2f} s after the first stamp; back10: {message}; "
              f"load {open('/proc/loadavg').read().split()[0]}")
        return out

    first, second = one_run("a"), one_run("b")
    both = [k for k in first if first[k][0] == "ok" and second[k][0] == "ok"]
    assert {"back2", "back3"} <= set(both), both
    assert [first[k] for k in both] == [second[k] for k in both]
