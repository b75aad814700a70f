"""What explanations cost a serving node, over real DDS, as paired ratios within one run (issue 33).

One node (`litevlm drive`, the shipped parameters on the bundled model, visual reuse off so that every
query runs every stage) answers DriveLM questions one at a time, each on its own key frame's six
images published just before it. Each question is asked twice in a row, once with the node's live
`explain` parameter at `never` (nothing is explained, nothing is checked: the baseline) and once at
`subscribed` (the default), in alternating order, in three blocks per round:

    same           `never` twice (A/A): how far two back-to-back answers differ on this machine now,
                   the noise the other ratios are to be read against
    nobody         no subscriber on ~/explanation: the per-query cost of the feature when unused
                   (one subscription count per query)
    subscriber     a subscriber on ~/explanation: the `subscribed` answer is explained after it is
                   published; the next query is sent once its picture has arrived

Printed: per block the medians of the answers' pipeline time (total and per stage, the Answer's own
stage_ms) and end-to-end time (receipt - query stamp) under each setting, with the median over the
pairs of (subscribed / never), the same question back to back, so that the load of a shared machine
hits both alike, and its interquartile range; then each part of the explanation (the node's /diagnostics medians: view
probabilities, token scores, the attention pass, drawing, JPEG) against the answer's pipeline median,
how long after its answer a picture arrives; and the objects parsed into every Answer (a regex,
timed here on the answers received).

    python scripts/studies/explain_serving.py [--rounds 3] [--per-round 6] [--set NAME=VALUE ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from litevlm_runtime.bench.soak import DDSClient, NodeProcess
from litevlm_runtime.explain.capture import drivelm_questions
from litevlm_runtime.kernels.cpuinfo import read_cpuinfo
from litevlm_runtime.pipeline.answer import STAGES, object_fields
from litevlm_runtime.report import table
from litevlm_runtime.ros.params_file import config_dir, load_node_params
from litevlm_runtime.timing import percentile

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "drivelm_sample"
EXPLANATION_TOPIC = "/litevlm_drive/explanation"
BLOCKS = ("same", "nobody", "subscriber")
MODES = ("never", "subscribed")
PARTS = ("views", "token_scores", "attention", "draw", "jpeg", "total")


class Pictures:
    """A subscriber to ~/explanation in the client's context, made and destroyed per round."""

    def __init__(self, client: DDSClient):
        import rclpy
        from rclpy.qos import QoSProfile, ReliabilityPolicy
        from sensor_msgs.msg import CompressedImage

        self.client, self.received = client, {}
        self.lock = threading.Lock()
        self.node = rclpy.create_node("litevlm_explain_bench_pictures", context=client.ctx)
        self.sub = self.node.create_subscription(CompressedImage, EXPLANATION_TOPIC, self._on_picture,
                                                 QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE))
        client.executor.add_node(self.node)
        wait_until(lambda: self.sub.get_publisher_count() > 0, 30, "the node's ~/explanation publisher")
        time.sleep(1.0)                                   # (the node's side of the match)

    def _on_picture(self, msg) -> None:
        with self.lock:
            self.received[msg.header.frame_id] = (time.time_ns(), len(msg.data))

    def close(self) -> None:
        self.client.executor.remove_node(self.node)
        self.node.destroy_node()
        wait_until(lambda: self.client.node.count_subscribers(EXPLANATION_TOPIC) == 0, 30, "the subscriber to go")
        time.sleep(1.0)


def wait_until(cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise TimeoutError(f"no {what} within {timeout:.0f} s")
        time.sleep(0.05)


def set_parameter(client: DDSClient, name: str, value: str) -> None:
    from rcl_interfaces.srv import SetParameters
    from rclpy.parameter import Parameter

    service = client.node.create_client(SetParameters, "/litevlm_drive/set_parameters")
    try:
        wait_until(service.service_is_ready, 30, "parameter service")
        future = service.call_async(SetParameters.Request(parameters=[Parameter(name, value=value).to_parameter_msg()]))
        wait_until(future.done, 30, f"answer to setting {name}")
        result = future.result().results[0]
        if not result.successful:
            raise RuntimeError(f"{name}={value!r} refused: {result.reason}")
    finally:
        client.node.destroy_client(service)


def diagnostics_of(client: DDSClient) -> dict:
    """The node's newest /diagnostics key-values."""
    from diagnostic_msgs.msg import DiagnosticArray

    got = []
    sub = client.node.create_subscription(DiagnosticArray, "/diagnostics", got.append, 10)
    try:
        wait_until(lambda: got, 15, "/diagnostics")
    finally:
        client.node.destroy_subscription(sub)
    return {kv.key: kv.value for kv in got[-1].status[0].values}


def frame_messages(images: dict) -> dict:
    from sensor_msgs.msg import CompressedImage

    return {cam: (CompressedImage(format="jpeg", data=path.read_bytes()), 0) for cam, path in images.items()}


def ask(client: DDSClient, q, query_id: str, pictures: Pictures | None) -> dict:
    """One question on its own frames; with `pictures`, also waiting for its picture."""
    now = client.now_ns()
    frames = frame_messages(q.images)
    client.publish_frames(frames, now - 1_000_000)
    client.publish_query(query_id, q.question, now)
    client.publish_frames(frames, now + 1_000_000)
    answered = [r for r in client.wait_for_answers([query_id], timeout=300) if r["query_id"] == query_id]
    if not answered or answered[0]["status"] != "ok":
        raise RuntimeError(f"{query_id}: {answered[0]['status_message'] if answered else 'no answer'}")
    row = dict(answered[0], question_text=q.question)
    if pictures is not None:
        wait_until(lambda: query_id in pictures.received, 300, f"picture of {query_id}")
        row["picture_after_ms"] = (pictures.received[query_id][0] - row["received_ns"]) / 1e6
        row["picture_bytes"] = pictures.received[query_id][1]
    print(f"  {query_id}: pipeline {row['total_ms']:.0f} ms, e2e {row['e2e_ms']:.0f} ms"
          + (f", picture {row['picture_after_ms']:.0f} ms after it" if "picture_after_ms" in row else ""), flush=True)
    return row


def ask_pairs(client: DDSClient, questions, prefix: str, pictures: Pictures | None,
              same: bool = False) -> list[tuple[dict, dict]]:
    """Each question under `never` and under `subscribed` (`same`: `never` twice), back to back, the
    order alternating: [(never's row, subscribed's row)]."""
    pairs = []
    for i, q in enumerate(questions):
        rows = {}
        for side in ((0, 1) if i % 2 == 0 else (1, 0)):
            mode = "never" if same else MODES[side]
            set_parameter(client, "explain", mode)
            rows[side] = ask(client, q, f"{prefix}{i}{side}", pictures if mode == "subscribed" else None)
        pairs.append((rows[0], rows[1]))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=SAMPLE / "qa_scene_n008.json")
    ap.add_argument("--frames", type=Path, default=SAMPLE)
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs both blocks in turn")
    ap.add_argument("--per-round", type=int, default=6, help="questions per block and round (each asked twice)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a node parameter")
    ap.add_argument("--domain-id", type=int, default=77)
    args = ap.parse_args()
    if args.rounds < 1 or args.per_round < 1:
        raise SystemExit("--rounds and --per-round must be at least 1")
    everything = drivelm_questions(args.data, args.frames)
    step = max(1, len(everything) // args.per_round)
    questions = everything[::step][:args.per_round]
    # Each query is matched to the frame set published just before it, as the node matches a camera
    # stream (frame_match as_asked, shipped): the newest set stamped at or before the question, once
    # every camera has sent a later frame (the same images again, just after the question), however
    # late a loaded machine delivers them.
    overrides = {"frame_match": "as_asked", "match_wait_s": "10.0", "max_frame_age_s": "30.0",
                 "serving.feature_cache": "false", "explain": "never",
                 **dict(s.split("=", 1) for s in args.set)}
    params = load_node_params(config_dir() / "drive.yaml", overrides)
    os.environ["ROS_DOMAIN_ID"] = str(args.domain_id)
    log = Path(tempfile.mkdtemp(prefix="litevlm_explain_bench_")) / "node.log"
    print(
        f"explain_serving: {len(questions)} DriveLM questions x 2 settings x {len(BLOCKS)} blocks x "
        f"{args.rounds} rounds; "
        f"node log {log}\nload average {open('/proc/loadavg').read().split()[:3]}; CPU flags: "
        + ", ".join(f for f in ('avx2', 'fma', 'f16c', 'avx512f', 'amx_tile') if f in (read_cpuinfo() or ('', []))[1]),
        flush=True,
    )
    node = NodeProcess(config_dir() / "drive.yaml", log, overrides, dict(os.environ))
    results = {b: [] for b in BLOCKS}              # block -> [(never's row, subscribed's row)]
    try:
        node.wait_for("ready (", timeout=600)
        client = DDSClient(params, domain_id=args.domain_id)
        client.wait_for_node()
        for i, q in enumerate(questions[:2]):
            ask(client, q, f"warm{i}", None)
        for r in range(args.rounds):
            for block in (BLOCKS if r % 2 == 0 else BLOCKS[::-1]):       # (order alternating too)
                print(f"round {r + 1}, {block}", flush=True)
                pictures = Pictures(client) if block == "subscriber" else None
                try:
                    results[block] += ask_pairs(client, questions, f"r{r}{block}", pictures, block == "same")
                finally:
                    if pictures is not None:
                        pictures.close()
        diag = diagnostics_of(client)
        client.close()
    finally:
        node.stop()
    print(report(results, diag))
    print(f"load average after: {open('/proc/loadavg').read().split()[:3]}")


def report(results: dict, diag: dict) -> str:
    keys = {"pipeline": lambda r: r["total_ms"], "e2e": lambda r: r["e2e_ms"],
            **{s: (lambda r, s=s: r["stage_ms"][s]) for s in STAGES}}
    rows = []
    for block, pairs in results.items():
        for mode, side in (("never", 0), ("never" if block == "same" else "subscribed", 1)):
            cells = [f"{statistics.median(k(p[side]) for p in pairs):.1f}" for k in keys.values()]
            rows.append([block, mode, len(pairs)] + cells)
        ratios = [[k(b) / max(k(a), 1e-9) for a, b in pairs] for k in keys.values()]
        rows.append([block, "ratio", len(pairs)] + [f"{statistics.median(r):.3f} [{percentile(r, 25):.2f}-"
                                                    f"{percentile(r, 75):.2f}]" for r in ratios])
    out = ["", "answers: median ms per setting, then the median [interquartile range] over pairs of the second / the "
               "first (the same question back to back)",
           table(["block", "explain", "n"] + [f"{k} ms" for k in keys], rows)]
    explained = [b for _, b in results["subscriber"]]
    answer_ms = statistics.median(keys["pipeline"](r) for r in explained)
    parts = [
        [
            p,
            f"{float(diag[f'explanation_ms.{p}.p50']):.1f}",
            f"{float(diag[f'explanation_ms.{p}.p50']) / answer_ms:.3f}",
        ]
        for p in PARTS
        if f"explanation_ms.{p}.p50" in diag
    ]
    after = statistics.median(r["picture_after_ms"] for r in explained)
    parts.append(["picture received after its answer", f"{after:.1f}", f"{after / answer_ms:.3f}"])
    parts.append(["picture size (kB)", f"{statistics.median(r['picture_bytes'] for r in explained) / 1e3:.0f}", ""])
    out += ["", f"explanations with a subscriber ({diag.get('explanations.explained')} explained, "
                f"{diag.get('explanations.dropped')} dropped; the node's medians), against the explained answers' "
                f"pipeline median {answer_ms:.1f} ms", table(["part", "median ms", "x answer"], parts)]
    every = [r for pairs in results.values() for pair in pairs for r in pair]
    t0 = time.perf_counter()
    for r in every:
        object_fields(r["question_text"], r["answer"])
    parse_us = (time.perf_counter() - t0) / len(every) * 1e6
    out += ["", f"objects as data (Answer.objects, question_objects, malformed_tags; every answer): {parse_us:.1f} us "
                f"per answer, {parse_us / 1e3 / statistics.median(keys['pipeline'](r) for r in every):.2e} x the "
                f"pipeline median"]
    return "\n".join(out)


if __name__ == "__main__":
    main()
