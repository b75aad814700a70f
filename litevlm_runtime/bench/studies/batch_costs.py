"""What in-flight batching costs on this device and backend (docs/serving.md), one table:

  step B rows      one batched decode step over B queries (each over its own KV region of
                   `--context` rows), against B single-query steps
  prefill T        a prompt of T rows alone, and with B decode rows added to the same pass (what a
                   mixed prefill/decode step would run, attention of the decode rows not counted:
                   a lower bound on its cost), against prefill T then a batched step of B rows
  speculation      tokens per ms of B greedy rows in one pass, B / verify(B), against the best a
                   perfectly accepted EAGLE-2 chain gives one query (the batch policy's inputs)

Every row is the median of `--repeats` interleaved repetitions (the machine's load hits all alike).
`--set NAME=VALUE` chooses another backend (the steps then run its engines; the prefill rows, a
torch-only comparison, are left out), e.g. ONNX Runtime's batched step graph:

    litevlm bench --study batch_costs [--model DIR] [--context 300] [--prompt 300] [--repeats 30]
    litevlm bench --study batch_costs --set backend.name=onnxruntime --set backend.bundle=BUNDLE
"""

from __future__ import annotations

import litevlm_runtime  # noqa: F401 - before torch, so that its threads sleep when idle (threads.py)

# isort: split
# (libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it)
import argparse
import statistics
import time

import numpy as np
import torch

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.decoding.greedy import step_one
from litevlm_runtime.decoding.speculative import eagle2
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.batching import BatchDecoder, batch_speculates
from litevlm_runtime.pipeline.pipeline import Pipeline

QUESTIONS = ["What is in front of the ego vehicle?", "What should the ego vehicle do next?",
             "Describe the traffic behind the ego car.", "Are there cars on the front left?"]


def random_frames(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {cam: rng.integers(0, 256, (270, 480, 3), dtype=np.uint8) for cam in CAMERAS}


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--context", type=int, default=300, help="cache rows each decoding query has")
    ap.add_argument("--prompt", type=int, default=300, help="rows of the prompt being prefilled")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a pipeline setting")
    return ap


@torch.inference_mode()
def median_ms(runs: dict, repeats: int) -> dict[str, float]:
    """Each run's median ms over `repeats` rounds, the runs in turn within a round (after one warm call each)."""
    times = {k: [] for k in runs}
    for f in runs.values():
        f()
    for _ in range(repeats):
        for k, f in runs.items():
            t0 = time.perf_counter()
            f()
            times[k].append((time.perf_counter() - t0) * 1e3)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    settings = dict(s.split("=", 1) for s in args.set)
    pipe = Pipeline.from_pretrained(args.model, options_from_flat({"serving.max_batch": args.max_batch, **settings}))
    rt, a = pipe.rt, pipe.rt.arena
    batch = BatchDecoder(pipe)
    d, ctx, t = rt.cfg.llm.hidden_size, args.context, args.prompt
    x = torch.zeros(t + args.max_batch, d, dtype=rt.dtype)
    causal = torch.ones(t + args.max_batch, t + args.max_batch, dtype=torch.bool).tril()
    positions = torch.arange(t + args.max_batch)

    def batched(b):
        def run():
            a.batch_mask[:b, :ctx] = True
            a.batch_slots[:b] = ctx
            hidden = batch.engine.step(rt.lm.embed(a.batch_tokens[:b]), a.batch_positions[:b], a.batch_slots[:b],
                                       a.batch_mask[:b, :ctx], a.batch_eye[:b, :b])
            rt.engines.head.run(hidden).argmax(-1)
        return run

    def singles(b):
        def run():
            for _ in range(b):
                rt.engines.head.run(step_one(rt, 5, ctx, ctx)).argmax(-1)
        return run

    def prefill(rows):
        return lambda: rt.lm(x[:rows], positions[:rows], causal[:rows, :rows])

    runs = {}
    for b in range(1, args.max_batch + 1):
        runs[f"step {b} rows batched"] = batched(b)
        runs[f"step {b} rows as {b} single steps"] = singles(b)
    eager = rt.engines.backend == "torch"
    if eager:
        runs[f"prefill {t}"] = prefill(t)
        for b in range(1, args.max_batch + 1):
            runs[f"prefill {t} + {b} decode rows (mixed, lower bound)"] = prefill(t + b)
    ms = median_ms(runs, args.repeats)

    print(
        f"batch costs: {pipe.name}, {rt.options.backend.name.value} on {rt.device}, {torch.get_num_threads()} threads, "
        f"context {ctx}, prompt {t}, median of {args.repeats}"
    )
    print(f"{'':<52}{'ms':>9}{'vs':>9}")
    for b in range(1, args.max_batch + 1):
        one, many = ms[f"step {b} rows batched"], ms[f"step {b} rows as {b} single steps"]
        print(f"{f'step {b} rows batched (vs {b} single steps)':<52}{one:>9.2f}{one / many:>9.2f}")
    if eager:
        base = ms[f"prefill {t}"]
        print(f"{f'prefill {t}':<52}{base:>9.2f}{1.0:>9.2f}")
        for b in range(1, args.max_batch + 1):
            mixed = ms[f"prefill {t} + {b} decode rows (mixed, lower bound)"]
            join = base + ms[f"step {b} rows batched"]
            print(f"{f'mixed prefill {t} + {b} rows (vs prefill then step)':<52}{mixed:>9.2f}{mixed / join:>9.2f}")
    costs = rt.costs
    if costs is not None:
        depth = rt.options.decoding.eagle.depth
        chain, best = costs.best_chain_rate(depth)
        images = random_frames()
        for q in QUESTIONS:                     # EAGLE-2 rounds, so that the realised acceptance is measured
            pipe.answer(images, q, decoder=eagle2)
        print(f"speculation: verify(T) ms {', '.join(f'{k}: {v:.2f}' for k, v in sorted(costs.verify_ms.items()))}; "
              f"a perfect EAGLE-2 chain {chain:.3f} tokens/ms (depth {best}); realised over {costs.rounds} rounds "
              f"{costs.speed / costs.step_ms:.3f} tokens/ms ({costs.speed:.2f} plain steps' worth per step)")
        for b in range(2, args.max_batch + 1):
            print(f"  batch of {b}: greedy rows {b / costs.verify(b):.3f} tokens/ms -> "
                  f"{'EAGLE-2' if batch_speculates(costs, b, depth) else 'batched greedy'}")


if __name__ == "__main__":
    main()
