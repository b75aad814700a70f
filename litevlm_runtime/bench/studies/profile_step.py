"""Where one decode step's time goes: torch.profiler over plain greedy steps of a model (default the
bundled one), per backend, at a fixed thread count (docs/performance.md).

    litevlm bench --study profile_step [--model DIR] [--backend torch,torch-compile] [--threads 1] [--steps 50]

A step is what decoding.greedy runs per token: the embedding row, the decoder step over the cache
(the prompt of a real query: the first DriveLM sample's frames when present), the LM head and the
argmax. Per backend it prints the operators by self time and a summary: wall-clock ms per step
without the profiler, operator calls per step, and the time inside operators against the rest
(Python and dispatch between them), as the profiler counts them (its own per-call cost lands in
the operators' share).
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
from torch.profiler import ProfilerActivity, profile

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.decoding.greedy import QueryDecoding, choose, step_one
from litevlm_runtime.frames import load_frame_sets
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.report import table

SAMPLE = Path(__file__).resolve().parents[4] / "shared" / "drivelm_sample" / "samples"


def steps_runner(pipe, context: int):
    """One greedy step at slot `context` (the slot after the prompt; rewritten every call)."""
    rt = pipe.rt

    def run():
        hidden = step_one(rt, 7, context, context)
        return choose(QueryDecoding.greedy(rt), rt.engines.head.run(hidden))
    return run


@torch.inference_mode()
def build(model: Path, backend: str, threads: int, frames, buckets: str):
    """A baseline pipeline (greedy, every camera) on `backend` with one query's prompt in its cache."""
    options = options_from_flat({"pipeline": "baseline", "backend.name": backend, "backend.threads": threads,
                                 "dtype": "float32", "backend.buckets": buckets})
    pipe = Pipeline.from_pretrained(model, options)
    ans = pipe.answer(frames, "What are the important objects in the current scene?")
    run = steps_runner(pipe, ans.input_tokens)
    for _ in range(10):
        run()
    return run, ans.input_tokens


@torch.inference_mode()
def wall_ms(runners: dict, steps: int, rounds: int) -> dict[str, float]:
    """Median ms per step of each runner over `rounds` blocks of `steps`, the runners alternating
    block by block (a shared machine's load then hits them alike)."""
    walls = {name: [] for name in runners}
    for _ in range(rounds):
        for name, run in runners.items():
            t0 = time.perf_counter()
            for _ in range(steps):
                run()
            walls[name].append((time.perf_counter() - t0) * 1000 / steps)
    return {name: statistics.median(v) for name, v in walls.items()}


@torch.inference_mode()
def profile_steps(run, steps: int) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            run()
    events = prof.key_averages()
    top = [e for e in prof.events() if e.cpu_parent is None]     # an operator's children are inside its time
    profiled_ms = (max(e.time_range.end for e in top) - min(e.time_range.start for e in top)) / 1000 / steps
    return {"profiled_ms": profiled_ms, "top_calls": len(top) / steps,
            "top_ms": sum(e.cpu_time_total for e in top) / 1000 / steps,
            "table": events.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=44)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--backend", default="torch,torch-compile")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rounds", type=int, default=7, help="alternating timing blocks per backend")
    p.add_argument("--buckets", default="vision=6;prefill=512;step=1;head=1",
                   help="compiled backends: the shape buckets to compile (default: what one six-camera query needs)")
    p.add_argument("--frames", type=Path, default=SAMPLE if SAMPLE.is_dir() else None)
    args = p.parse_args(argv)
    frames = load_frame_sets(args.frames, 1)[0]
    backends = args.backend.split(",")
    built = {b: build(args.model, b, args.threads, frames, args.buckets) for b in backends}
    load_before = Path("/proc/loadavg").read_text().split()[0]
    walls = wall_ms({b: run for b, (run, _) in built.items()}, args.steps, args.rounds)
    results = [{"backend": b, "context": ctx, "wall_ms": walls[b], **profile_steps(run, args.steps)}
               for b, (run, ctx) in built.items()]
    load_after = Path("/proc/loadavg").read_text().split()[0]
    for r in results:
        print(f"\n## {r['backend']}: operators of one decode step (self time, {args.steps} steps, "
              f"{args.threads} thread(s), context {r['context']} rows)\n")
        print(r["table"])
    print(f"\n## summary per decode step ({args.threads} thread(s); {args.rounds} alternating blocks of {args.steps} "
          f"steps; 1-min load average {load_before} before, {load_after} after)\n")
    rows = [[r["backend"], r["wall_ms"], r["profiled_ms"], r["top_calls"], r["top_ms"],
             r["profiled_ms"] - r["top_ms"], (r["profiled_ms"] - r["top_ms"]) / r["profiled_ms"]] for r in results]
    print(table(["backend", "wall ms", "profiled ms", "top-level op calls", "in ops ms", "between ops ms",
                 "between / profiled"], rows))
    base = results[0]["wall_ms"]
    for r in results[1:]:
        print(
            f"{r['backend']}: {base / r['wall_ms']:.2f}x faster per step than {results[0]['backend']} (wall, same run)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
