"""Where an EAGLE-2 answer's decode time goes: inside the models (target decoder, draft head, LM
head engine calls) or outside them (tree bookkeeping, small tensor ops, host reads), per policy.

    OMP_NUM_THREADS=1 litevlm bench --study eagle_overhead [--model DIR] [--frames ../shared/drivelm_sample]

Each engine call is wrapped with a wall clock; the rest of the decode stage is the overhead.
The same questions run under each policy in turns (answers are token-identical: greedy EAGLE-2 is
lossless), so load from other processes falls on all of them alike.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.frames import read_frame_set
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.pipeline import Pipeline


def timed_engines(rt) -> dict:
    """Wrap the engine calls of the decode loop; returns the accumulator (seconds in models)."""
    acc = {"model": 0.0}
    for obj, name in ((rt.engines.decoder, "step"), (rt.engines.draft, "step"), (rt.engines.head, "run")):
        fn = getattr(obj, name)

        def wrapped(*a, _fn=fn, **k):
            t0 = time.perf_counter()
            out = _fn(*a, **k)
            acc["model"] += time.perf_counter() - t0
            return out
        setattr(obj, name, wrapped)
    return acc


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--frames", type=Path, default=ROOT.parent / "shared" / "drivelm_sample")
    ap.add_argument("--questions", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args(argv)

    base = {"pipeline": "baseline", "decoding.mode": "eagle", "decoding.eagle.total": 16, "decoding.eagle.depth": 4,
            "decoding.eagle.topk": 4, "backend.threads": 1, "max_new_tokens": 48}
    runs = {}
    for policy in ("fixed", "adaptive"):
        pipe = Pipeline.from_pretrained(args.model, options_from_flat({**base, "decoding.eagle.policy": policy}))
        runs[policy] = {
            "pipe": pipe,
            "acc": timed_engines(pipe.rt),
            "decode": 0.0,
            "model": 0.0,
            "rounds": 0,
            "tokens": 0,
        }
    frames = [read_frame_set(args.frames, i) for i in range(3)]
    questions = DEFAULT_QUESTIONS[:args.questions]
    for run in runs.values():                         # warm-up answers (the adaptive policy learns here too)
        for q in questions[:2]:
            run["pipe"].answer(frames[0], q)
    work = [(frames[i % 3], q) for i, q in enumerate(questions * args.repeat)]
    for n, (frame, q) in enumerate(work, 1):
        for run in runs.values():
            run["acc"]["model"] = 0.0
            ans = run["pipe"].answer(frame, q)
            run["decode"] += ans.stage_ms["decode"]
            run["model"] += run["acc"]["model"] * 1000.0
            run["rounds"] += ans.decode_steps
            run["tokens"] += len(ans.token_ids)
        print(f"[{n}/{len(work)}]", file=sys.stderr)
    print(f"{len(work)} answers, {args.model.name}, 1 thread")
    print(f"{'policy':<10}{'decode ms':>11}{'in models':>11}{'outside':>10}{'share':>8}{'passes':>8}{'tokens':>8}")
    for policy, r in runs.items():
        out = r["decode"] - r["model"]
        print(f"{policy:<10}{r['decode']:>11.1f}{r['model']:>11.1f}{out:>10.1f}{out / r['decode']:>8.3f}"
              f"{r['rounds']:>8d}{r['tokens']:>8d}")


if __name__ == "__main__":
    main()
