"""Same inputs, same answer: a greedy answer depends only on question, frames and parameters, not on
how it was decoded. Each DriveLM sample question (its key frame's six images, the bundled model, the
shipped configuration) answered one at a time with plain greedy steps, with EAGLE-2 (lossless when
greedy), and inside in-flight batches of two shuffled compositions (BatchDecoder, what the node runs
at serving.max_batch > 1): the token ids must be the plain greedy ones. (Was scripts/determinism.py.)

Why it could differ at all: a batched step runs the decoder's GEMMs over B rows and its attention over
the batch's longest live cache; one query alone runs them over 1 row and its own columns; EAGLE-2
verifies T tree rows in one pass. The float sums are reassociated (1e-5 relative at float32 here),
which would flip an argmax only at a near tie; a difference names the question and the first token."""

from __future__ import annotations

import random

import pytest

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.decoding.greedy import greedy
from litevlm_runtime.decoding.speculative import eagle2
from litevlm_runtime.evaluation.data import frame_images, load_frames
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.pipeline import Pipeline

pytestmark = pytest.mark.slow      # every sample question four ways: minutes on 2 cores


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


def first_difference(a: list[int], b: list[int]) -> int:
    return next(j for j, (x, y) in enumerate(zip(a + [-1], b + [-1])) if x != y)


def test_greedy_answers_do_not_depend_on_how_they_were_decoded(drivelm_dir):
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options_from_flat({}))      # the shipped configuration
    assert pipe.rt.arena.limits.batch > 1 and pipe.rt.draft is not None        # both ways are really taken
    items = []
    for frame in load_frames(drivelm_dir / "qa_scene_n008.json"):
        images = {c: path.read_bytes() for c, path in frame_images(drivelm_dir, frame).items()}
        items += [(images, q.question) for q in frame.questions]
    plain = [pipe.answer(im, q, decoder=greedy).token_ids for im, q in items]
    ways = {"eagle-2 alone": [pipe.answer(im, q, decoder=eagle2).token_ids for im, q in items]}
    rng = random.Random(0)
    for k in range(2):
        order = list(range(len(items)))
        rng.shuffle(order)
        got = batched(pipe, items, order)
        ways[f"batched, order {k}"] = [got[i] for i in range(len(items))]
    differ = {name: [(i, first_difference(plain[i], a)) for i, a in enumerate(answers) if a != plain[i]]
              for name, answers in ways.items()}
    assert all(len(answers) == len(items) for answers in ways.values())
    assert differ == {name: [] for name in ways}, f"(question, first differing token) per way: {differ}"
