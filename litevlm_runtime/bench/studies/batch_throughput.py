"""What in-flight batching can give on this machine, without the node: the engine's own throughput
serving queries one at a time (`Pipeline.answer`, what serving.max_batch 1 runs) against a
BatchDecoder kept full (serving.max_batch N: a query admitted as soon as a region is free), in one
process, no DDS, no queue, no arrival pattern (docs/serving.md).

    litevlm bench --study batch_throughput [--model DIR] [--frames DIR] [--sets 9] [--per-set 4] [--rounds 3]
                                       [--set NAME=VALUE ...]

The workload is the questions of `litevlm bench` over the frame sets of --frames (default the
DriveLM sample when present), --per-set questions on each frame set, in order, with frame keys so
that a frame set's later questions reuse its cameras (the feature cache), as the node's do. Rounds
alternate one at a time and batched, each with fresh frame keys (every round encodes its cameras
anew), so a shared machine's load hits both alike. Prints queries per second per round, the
median ratio, how many greedy answers are identical between the two, and decode's share of the
one-at-a-time pipeline time (the most a free batched step could give: 1 / (1 - share)).

A node's peak rate under bursts (`litevlm bag peak`) cannot exceed what this ratio allows: a
batched step makes decoding cheaper, nothing else.
"""

from __future__ import annotations

import litevlm_runtime  # noqa: F401 - before torch, so that its threads sleep when idle (threads.py)

# isort: split
# (libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it)
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.frames import load_frame_sets
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.report import table

SAMPLE = Path(__file__).resolve().parents[4] / "shared" / "drivelm_sample" / "samples"


def one_at_a_time(pipe, work, frame_sets, keys) -> dict:
    return {i: pipe.answer(frame_sets[s], q, frame_keys=keys(s)) for i, (s, q) in enumerate(work)}


def batched(pipe, work, frame_sets, keys) -> dict:
    """A BatchDecoder kept full: admit while a region is free, then one decode pass; a lone query
    stops speculating when another waits (as the node's worker runs it)."""
    batch, out, todo = BatchDecoder(pipe), {}, list(enumerate(work))
    while todo or len(batch):
        while todo and batch.has_room:
            i, (s, q) = todo.pop(0)
            batch.admit(frame_sets[s], q, frame_keys=keys(s), tag=i)
        for running, ans in batch.step(lambda: bool(todo) and batch.has_room):
            out[running.tag] = ans
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--frames", type=Path, default=SAMPLE if SAMPLE.is_dir() else None)
    p.add_argument("--sets", type=int, default=9, help="frame sets (at most what --frames holds)")
    p.add_argument("--per-set", type=int, default=4, help="questions asked on each frame set")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a pipeline option")
    args = p.parse_args(argv)
    for name in ("sets", "per_set", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    flat = dict(kv.split("=", 1) for kv in args.set)
    pipe = Pipeline.from_pretrained(args.model, options_from_flat(flat))
    frame_sets = load_frame_sets(args.frames, args.sets)
    work = [(s, DEFAULT_QUESTIONS[(args.per_set * s + j) % len(DEFAULT_QUESTIONS)])
            for s in range(len(frame_sets)) for j in range(args.per_set)]
    in_flight = BatchDecoder(pipe).capacity
    pipe.warm_up(frame_sets[0])
    runs = {"one at a time": one_at_a_time, f"batched, up to {in_flight}": batched}
    rates: dict[str, list[float]] = {name: [] for name in runs}
    answers: dict[str, dict] = {}           # each configuration's last round: query index -> Answer
    alone: list = []                         # every round's one-at-a-time Answers (decode's share)
    n = 0
    with torch.inference_mode():
        for r in range(args.rounds):
            for name, run in runs.items():
                n += 1
                keys = lambda s, n=n: {c: (n, s) for c in frame_sets[s]}      # noqa: E731 - fresh per round
                t0 = time.perf_counter()
                answers[name] = run(pipe, work, frame_sets, keys)
                rates[name].append(len(work) / (time.perf_counter() - t0))
                if run is one_at_a_time:
                    alone += answers[name].values()
                print(
                    f"round {r + 1}/{args.rounds}  {name:<20} {rates[name][-1]:6.2f} q/s", file=sys.stderr, flush=True
                )
    base, other = (statistics.median(v) for v in rates.values())
    single, many = answers.values()
    same = sum(single[i].token_ids == many[i].token_ids for i in single)
    print(f"{len(work)} queries ({len(frame_sets)} frame sets x {args.per_set}), {pipe.name}, "
          f"backend {pipe.rt.engines.backend}, threads {torch.get_num_threads()}")
    print(table(["serving", "q/s (median)", "rounds", "x one at a time"],
                [[name, statistics.median(v), " ".join(f"{x:.2f}" for x in v), statistics.median(v) / base]
                 for name, v in rates.items()]))
    print(f"greedy answers identical: {same}/{len(work)}   ratio {other / base:.2f}x")
    share = sum(a.stage_ms["decode"] for a in alone) / sum(a.total_ms for a in alone)
    print(f"one at a time, decode is {share:.0%} of the pipeline's time: a batched step that cost nothing "
          f"would give at most {1 / (1 - share):.2f}x")
    return 0 if same == len(work) else 1


if __name__ == "__main__":
    sys.exit(main())
