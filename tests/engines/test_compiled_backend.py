"""The torch-compile backend against eager torch: stage numerics (fp32, relative error <= 1e-5),
whole greedy answers token for token, alone and in-flight batched, and no recompilation once
every bucket is compiled (the batched step's, and each KV region's step bindings, included).

Metric: max |compiled - eager| / max |eager| over the whole output tensor. The model is the tiny
lively checkpoint with a few small buckets (compiling on 2 loaded cores takes most of this
file's time; inductor's FX graph cache makes a rerun on the same machine fast).
"""

from __future__ import annotations

import pytest
import torch
from helpers import options, random_frames, relative_error
from helpers.batching import serve
from helpers.export import MAX_NEW_TOKENS, lively_checkpoint

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.engines.compiled import compile_counters
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest

# Compiling every bucket takes 1-4 minutes on CI's 2 cores: run with -m slow (the suite's 20-minute budget).
pytestmark = pytest.mark.slow

TOLERANCE = 1e-5
# One batch bucket of 3 (serving.max_batch 3): 2 queries run in it with a padding row. Step
# graphs over the first 64 and 160 cache columns and over the whole cache.
BUCKETS = "vision=6;prefill=256;step=1,8;head=1,8;batch=3;cache=64,160"


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    model = lively_checkpoint(tmp_path_factory.getbasetemp())
    common = dict(max_new_tokens=MAX_NEW_TOKENS, backend__threads=1, pipeline="baseline", serving__max_batch=3)
    eager = Pipeline.from_pretrained(model, options(**common))
    compiled = Pipeline.from_pretrained(
        model, options(backend__name="torch-compile", backend__buckets=BUCKETS, **common)
    )
    return eager, compiled


def test_every_bucket_compiled_at_start_up(pipes):
    _, compiled = pipes
    seconds = compiled.rt.engines.decoder.compile_seconds
    assert compiled.rt.engines.backend == "torch-compile"
    assert set(seconds) == {"decoder", "head", "decoder_batch"}     # the prompt and vision run eager on the CPU
    assert compiled.rt.engines.decoder.prefill_sizes == ()
    assert compiled.rt.engines.vision.backend == "torch"
    assert all(s > 0 for s in seconds.values())
    assert compiled.rt.engines.batch.sizes == (3,) and compiled.rt.engines.batch.backend == "torch-compile"
    decoder = compiled.rt.engines.decoder
    assert decoder.cache_sizes == (64, 160, compiled.rt.arena.max_len) > (64, 160, 161)
    assert set(decoder.step_runners) == {(t, n) for t in (1, 8) for n in decoder.cache_sizes}


@torch.inference_mode()
def test_stages_match_eager(pipes):
    eager, compiled = pipes
    g = torch.Generator().manual_seed(3)
    for p in pipes:                       # random caches: a stale column leaking through a mask shows
        a = p.rt.arena
        a.k_cache.copy_(torch.randn(a.k_cache.shape, generator=torch.Generator().manual_seed(0)))
        a.v_cache.copy_(torch.randn(a.v_cache.shape, generator=torch.Generator().manual_seed(1)))
    s, d = eager.rt.cfg.force_image_size, eager.rt.cfg.llm.hidden_size
    pixels = torch.randn(5, 3, s, s, generator=g)          # 5 tiles in the 6-tile bucket, padded
    assert relative_error(compiled.rt.engines.vision.run(pixels), eager.rt.engines.vision.run(pixels)) <= TOLERANCE
    n = 100
    prefill = (torch.randn(n, d, generator=g), torch.arange(n) * 2, torch.ones(n, n, dtype=torch.bool).tril_())
    step = (torch.randn(1, d, generator=g), torch.tensor([2 * n]), torch.tensor([n]),
            torch.ones(1, n, dtype=torch.bool), torch.ones(1, 1, dtype=torch.bool))
    tree = (
        torch.randn(5, d, generator=g),
        torch.tensor([201, 202, 202, 203, 203]),
        torch.arange(130, 135),
        torch.ones(5, n + 1, dtype=torch.bool),
        torch.eye(5, dtype=torch.bool)
        | torch.tensor([[0] * 5, [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0]]).bool(),
    )
    outs = [p.rt.engines.decoder.prefill(*prefill).clone() for p in pipes]
    assert relative_error(outs[1], outs[0]) <= TOLERANCE
    # The step over 100 live columns runs in the 160-column graph, 50 in the 64, 200 in the whole cache's.
    short = (step[0], step[1], torch.tensor([50]), torch.ones(1, 50, dtype=torch.bool), step[4])
    long = (step[0], torch.tensor([400]), torch.tensor([200]), torch.rand(1, 200, generator=g) < 0.7, step[4])
    for call in (step, tree, short, long):
        outs = [p.rt.engines.decoder.step(*call).clone() for p in pipes]
        assert outs[1].shape == outs[0].shape == (call[0].shape[0], d)
        assert relative_error(outs[1], outs[0]) <= TOLERANCE
    ka, kb = compiled.rt.arena, eager.rt.arena
    assert relative_error(ka.k_cache, kb.k_cache) <= TOLERANCE and relative_error(ka.v_cache, kb.v_cache) <= TOLERANCE
    hidden = outs[0]
    assert relative_error(compiled.rt.engines.head.run(hidden), eager.rt.engines.head.run(hidden)) <= TOLERANCE
    for p in pipes:                       # the batched step over random regions: rows of other lengths
        a = p.rt.arena
        a.k_regions.copy_(torch.randn(a.k_regions.shape, generator=torch.Generator().manual_seed(2)))
        a.v_regions.copy_(torch.randn(a.v_regions.shape, generator=torch.Generator().manual_seed(4)))
    for rows in (2, 3):                   # 2: padded in the 3-bucket
        history = torch.tensor([40, 90, 65][:rows])
        call = (torch.randn(rows, d, generator=g), history + 7, history,
                torch.arange(90)[None, :] < history[:, None], torch.eye(rows, dtype=torch.bool))
        outs = [p.rt.engines.batch.step(*call).clone() for p in pipes]
        assert relative_error(outs[1], outs[0]) <= TOLERANCE
    assert (
        relative_error(ka.k_regions, kb.k_regions) <= TOLERANCE
        and relative_error(ka.v_regions, kb.v_regions) <= TOLERANCE
    )


def test_answers_identical_and_no_recompilation(pipes):
    eager, compiled = pipes
    before = compile_counters()
    answers = []
    for i, question in enumerate(DEFAULT_QUESTIONS[:4]):
        frames = random_frames(i)
        ref, got = eager.answer(frames, question), compiled.answer(frames, question)
        assert got.token_ids == ref.token_ids, question
        answers.append(tuple(ref.token_ids))
    assert len(set(answers)) >= 3             # identical answers mean something only if they vary
    # In-flight batches (each region's step bound again by BatchDecoder): 3 together in the
    # 3-bucket; then 2 in it with a padding row, the second carrying on alone in region 1.
    frames = [random_frames(i) for i in range(2)]
    batched, widest = serve(compiled, frames, [(0, 0, q) for q in DEFAULT_QUESTIONS[:3]])
    for (i, q), ans in batched.items():
        assert ans.token_ids == eager.answer(frames[i], q).token_ids, q
    assert widest == 3 and all(a.batched_steps for a in batched.values())
    batch = BatchDecoder(compiled)
    batch.admit(frames[1], QueryRequest(DEFAULT_QUESTIONS[0], max_new_tokens=3), tag="short")
    batch.admit(frames[1], DEFAULT_QUESTIONS[1], tag="long")
    got = {r.tag: a for r, a in batch.run()}
    assert got["short"].token_ids == eager.answer(frames[1], DEFAULT_QUESTIONS[0]).token_ids[:3]
    assert got["long"].token_ids == eager.answer(frames[1], DEFAULT_QUESTIONS[1]).token_ids
    assert 0 < got["long"].batched_steps < len(got["long"].token_ids) - 1
    assert compile_counters() == before       # steady state: every call hit a compiled bucket
