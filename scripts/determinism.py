"""Do greedy answers depend only on question, frames and parameters? Each question answered one
at a time (plain greedy steps, and EAGLE-2), and inside batches of different compositions
(BatchDecoder, the node's in-flight batching, in two shuffled orders): prints how many answers
differ from the plain greedy one, per way of decoding, and the first differing token of each.

    python scripts/determinism.py --data QA.json --frames ROOT [--questions 200] [--model DIR]

Why it can differ at all: a batched step runs the decoder's GEMMs over B rows and its attention
over the batch's longest live cache; one query alone runs them over 1 row and its own columns;
EAGLE-2 verifies T tree rows in one pass. The float sums are reassociated (1e-5 relative at
float32 here), which flips an argmax only at a near tie."""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import litevlm_runtime  # noqa: F401  (first: the OpenMP wait policy before torch loads)
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.decoding.greedy import greedy
from litevlm_runtime.decoding.speculative import eagle2
from litevlm_runtime.evaluation.data import frame_images, load_frames
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.pipeline import Pipeline


def batched(pipe: Pipeline, items: list, order: list[int]) -> dict[int, list[int]]:
    """Token ids of each item decoded through one BatchDecoder, admitted in `order` as regions free."""
    batch, out, pending = BatchDecoder(pipe), {}, list(order)
    while pending or len(batch):
        while batch.has_room and pending:
            i = pending.pop(0)
            images, question = items[i]
            batch.admit(images, question, tag=i)
        for r, ans in batch.step(lambda: bool(pending) and batch.has_room):
            out[r.tag] = ans.token_ids
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    p.add_argument("--data", type=Path, required=True, help="DriveLM-format QA json")
    p.add_argument("--frames", type=Path, required=True, help="the folder its image paths are relative to")
    p.add_argument("--questions", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    pipe = Pipeline.from_pretrained(args.model, options_from_flat({}))      # the shipped configuration
    items = []
    for frame in load_frames(args.data):
        images = {c: path.read_bytes() for c, path in frame_images(args.frames, frame).items()}
        items += [(images, q.question) for q in frame.questions]
    items = items[:args.questions]
    print(f"{len(items)} questions, {pipe.options.label()}, batch capacity {pipe.rt.arena.limits.batch}",
          file=sys.stderr)
    plain = [pipe.answer(im, q, decoder=greedy).token_ids for im, q in items]
    ways = {"eagle-2 alone": [pipe.answer(im, q, decoder=eagle2).token_ids for im, q in items]
            if pipe.rt.draft is not None else None}
    rng = random.Random(args.seed)
    for k in range(2):
        order = list(range(len(items)))
        rng.shuffle(order)
        got = batched(pipe, items, order)
        ways[f"batched, order {k}"] = [got[i] for i in range(len(items))]
    print(f"{'decoded':<20}{'answers':>9}{'differ':>8}  first differences (question: token index)")
    for name, answers in ways.items():
        if answers is None:
            continue
        diff = [i for i, (a, b) in enumerate(zip(plain, answers)) if a != b]
        where = ", ".join(
            f"{i}: {next(j for j, (x, y) in enumerate(zip(plain[i] + [-1], answers[i] + [-1])) if x != y)}"
            for i in diff[:5]
        )
        print(f"{name:<20}{len(answers):>9}{len(diff):>8}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
