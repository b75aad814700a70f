"""In-flight batching (batching.py) in process, on the bundled model's deployed configuration
(view selector, token selector, EAGLE-2): greedy answers of queries decoded together, whatever
their arrival pattern, are token for token those of the same queries served one at a time; each
query keeps its own cap and sampling seed; the arena is not reallocated."""

import batching_fixtures
import pytest
from batching_fixtures import serve
from helpers import options

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.pipeline.batching import BatchDecoder, batch_speculates
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.pipeline.runtime import batch_capacity

pipe, frames = batching_fixtures.pipe, batching_fixtures.frames      # the module fixtures both files serve

QUESTIONS = ["What is in front of the ego vehicle?", "Is there a pedestrian behind the ego car?",
             "What should the ego vehicle do next?", "Are there cars on the front left?",
             "What is the status of the truck?", "Describe the traffic behind the ego car."]


@pytest.fixture(scope="module")
def one_at_a_time(pipe, frames):
    """Every (frame set, question) answered alone by Pipeline.answer (today's path)."""
    return {(i, q): pipe.answer(frames[i], q, frame_keys={c: i for c in frames[i]}).token_ids
            for i in range(len(frames)) for q in QUESTIONS}


@pytest.mark.parametrize("pattern", ["together", "staggered", "burst_then_trickle", "more_than_capacity"])
def test_batched_greedy_answers_equal_one_at_a_time(pipe, frames, one_at_a_time, pattern):
    qs = [(i, q) for i in range(2) for q in QUESTIONS]
    if pattern == "together":
        arrivals = [(0, i, q) for i, q in qs[:4]]
    elif pattern == "staggered":
        arrivals = [(3 * k, i, q) for k, (i, q) in enumerate(qs[:6])]
    elif pattern == "burst_then_trickle":
        arrivals = [(0, *qs[0]), (0, *qs[7]), (1, *qs[3]), (5, *qs[10]), (9, *qs[5])]
    else:
        arrivals = [(0, i, q) for i, q in qs]              # 12 queries, 4 regions
    answers, widest = serve(pipe, frames, arrivals)
    assert set(answers) == {(i, q) for _, i, q in arrivals}
    for key, ans in answers.items():
        assert ans.token_ids == one_at_a_time[key], key
    assert widest >= 2                                      # they did run together
    if pattern in ("together", "more_than_capacity"):
        assert any(a.batched_steps for a in answers.values())


def test_each_query_keeps_its_own_cap(pipe, frames, one_at_a_time):
    batch = BatchDecoder(pipe)
    for n, q in zip((2, 5, 64), QUESTIONS[:3]):
        batch.admit(frames[0], QueryRequest(q, max_new_tokens=n), frame_keys={c: 0 for c in frames[0]}, tag=(n, q))
    got = {r.tag: a for r, a in batch.run()}
    for (n, q), ans in got.items():
        assert ans.token_ids == one_at_a_time[(0, q)][:n]


def test_sampling_keeps_each_querys_seed(frames):
    """A sampled answer depends on its own seed and temperature only, not on what it was batched
    with (plain steps: EAGLE-2's speculative sampling draws differently, with the same distribution)."""
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__max_batch=4, decoding__mode="greedy"))

    def sampled(others, seed):
        batch = BatchDecoder(pipe)
        keys = {c: 0 for c in frames[0]}
        batch.admit(frames[0], QueryRequest(QUESTIONS[2], temperature=1.5, seed=seed), frame_keys=keys, tag="x")
        for q in others:
            batch.admit(frames[0], q, frame_keys=keys, tag=q)
        return {r.tag: a for r, a in batch.run()}["x"].token_ids

    alone = sampled([], 7)
    assert sampled(QUESTIONS[:3], 7) == alone
    assert any(sampled([], s) != alone for s in (8, 9, 10))       # the seed matters


def test_the_arena_is_sized_once(pipe, frames):
    a = pipe.rt.arena
    assert a.k_regions.shape[0] == 4 and a.k_cache.data_ptr() == a.k_regions.data_ptr()
    before = {k: t.untyped_storage().data_ptr() for k, t in a.buffers().items()}
    serve(pipe, frames, [(0, 0, q) for q in QUESTIONS])
    assert {k: t.untyped_storage().data_ptr() for k, t in a.buffers().items()} == before


def test_max_batch_one_is_one_region_and_fastv_stays_unbatched():
    one = Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__max_batch=1))
    assert one.rt.arena.k_regions.shape[0] == 1 and one.rt.arena.k_cache.shape == one.rt.arena.k_regions.shape[1:]
    for backend in ("torch", "torch-compile", "torch-cudagraph"):
        assert batch_capacity(options(serving__max_batch=4, backend__name=backend)) == 4
    assert batch_capacity(options(serving__max_batch=4, backend__name="onnxruntime")) == 1    # no bundle given
    assert batch_capacity(options(serving__max_batch=4, fastv__ratio=0.5)) == 1


def test_batch_policy_from_measured_costs(pipe):
    import copy

    costs = copy.deepcopy(pipe.rt.costs)
    assert batch_speculates(costs, 1, 6) is True and batch_speculates(None, 4, 6) is False
    costs.rounds = 0              # no round yet: the best a perfectly accepted chain could do
    chain, _ = costs.best_chain_rate(6)
    assert batch_speculates(costs, 4, 6) == (chain > 4 / costs.verify(4))
    costs.rounds, costs.speed = 10, 1.3          # realised: 1.3 plain steps' worth of tokens per step
    assert batch_speculates(costs, 4, 6) == (1.3 / costs.step_ms > 4 / costs.verify(4))


def test_a_query_stopped_for_a_join_teaches_the_speculation_policy(frames):
    """A query decoding alone stops when another arrives and ends in batched steps: its whole
    answer cannot teach the answer-level policy (spec_policy.py), but what it decoded alone does,
    so that a batching node's policy settles as a max_batch 1 node's does (docs/serving.md)."""
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__max_batch=4, decoding__mode="eagle",
                                                           max_new_tokens=24))
    costs = pipe.rt.costs
    first = "What are the important objects in the current scene?"           # a long answer
    taught = sum(costs.answers.values())
    answers, widest = serve(pipe, frames, [(0, 0, first), (3, 1, QUESTIONS[1])])
    assert widest == 2 and answers[(0, first)].batched_steps > 0       # stopped alone, then batched
    assert sum(costs.answers.values()) == taught + 1 + (answers[(1, QUESTIONS[1])].batched_steps == 0)
