"""What one EAGLE-2 draft step costs against one target decoder step, per decoder depth.

    OMP_NUM_THREADS=1 litevlm bench --study draft_cost [--layers 3,4,6,8,10,12]
        [--model DIR] [--context 516] [--threads 1]

A target step is what greedy decoding runs per token: the decoder over one new token against a
KV cache of `--context` tokens (516 is the bundled model's six-camera prompt), its final norm and
the LM head. A draft step is what EAGLE-2 runs per tree level: the draft head (fc over
[embedding, feature], one decoder layer against its own cache of the same length) and the shared
LM head, for 1 token (the first level) and for `--topk` tokens (each further level). Both are the
modules the pipeline's torch engines call. Random weights at the model's shapes (the bundled
preset, or `--model`'s config at each depth): the cost of a step does not depend on the values.
The EAGLE-2 tree pays only where draft levels x draft cost stays well below the target steps
the accepted tokens save; the issue asks for one draft step <= 1/8 of a target step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch

from litevlm_runtime.models.eagle import DraftHead
from litevlm_runtime.models.internvl import DECODERS
from litevlm_runtime.weights.checkpoint import read_config
from litevlm_runtime.weights.presets import preset


def median_ms(fns: dict, reps: int, warmup: int = 20) -> dict:
    """Median milliseconds of each function, timed in turns (one call of each per round), so that
    load from other processes on the machine falls on all of them alike."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


@torch.inference_mode()
def measure(llm_cfg, context: int, topk: int, reps: int) -> dict:
    torch.manual_seed(0)
    max_len = context + 64
    lm = DECODERS[llm_cfg.architecture](llm_cfg, max_len).eval()
    draft = DraftHead(llm_cfg, max_len).eval()
    shape = (llm_cfg.num_key_value_heads, max_len, llm_cfg.head_dim)
    k_cache = torch.randn(llm_cfg.num_hidden_layers, *shape)
    v_cache = torch.randn(llm_cfg.num_hidden_layers, *shape)
    draft_k, draft_v = torch.randn(1, *shape), torch.randn(1, *shape)
    d = llm_cfg.hidden_size

    def target_step():
        embeds = lm.embed(torch.tensor([5]))
        hidden = lm(embeds, torch.tensor([context]), torch.tensor([context]),
                    torch.ones(1, context + 1, dtype=torch.bool), k_cache, v_cache)
        return lm.head(hidden)

    def draft_step(n: int):
        tokens = torch.arange(n) + 5
        feature = torch.randn(n, d)
        mask = torch.ones(n, context + n, dtype=torch.bool)
        hidden = draft(lm.embed(tokens), feature, torch.full((n,), context), torch.arange(context, context + n),
                       mask, draft_k, draft_v)
        return torch.log_softmax(lm.head(hidden).float(), dim=-1).topk(topk, dim=-1)

    ms = median_ms({"target": target_step, "draft1": lambda: draft_step(1), "draftk": lambda: draft_step(topk)}, reps)
    return {"layers": llm_cfg.num_hidden_layers} | ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="3,4,6,8,10,12", help="decoder depths to measure")
    p.add_argument("--model", help="model folder whose decoder shapes to use (default: the bundled preset)")
    p.add_argument("--context", type=int, default=516, help="KV cache length (prompt tokens)")
    p.add_argument("--topk", type=int, default=4, help="tokens per further draft level (the tree's top-k)")
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = read_config(args.model).llm if args.model else preset("bundled", vocab_size=1024).llm
    rows = [measure(replace(base, num_hidden_layers=int(n)), args.context, args.topk, args.reps)
            for n in args.layers.split(",")]
    print(f"decoder width {base.hidden_size}, vocab {base.vocab_size}, KV length {args.context}, "
          f"{torch.get_num_threads()} thread(s), median of {args.reps}")
    print(f"| decoder layers | target step ms | draft step ms (1 token) | draft / target | "
          f"draft level ms ({args.topk} tokens) | level / target |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layers']} | {r['target']:.3f} | {r['draft1']:.3f} | 1/{r['target'] / r['draft1']:.1f} | "
              f"{r['draftk']:.3f} | 1/{r['target'] / r['draftk']:.1f} |")


if __name__ == "__main__":
    main()
