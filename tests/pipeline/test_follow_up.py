"""Follow-up questions in process (pipeline/conversation.py), on the bundled model's deployed
configuration (view selector, token selector r=0.8, EAGLE-2, max_batch 4): a follow-up's answer is
the answer to the same conversation given in one go (`history=`, a full prefill), its vision stage
is skipped and its first rows' KV come from the turn it follows, also inside a batch; the reused
prefix gives the logits of a full prefill within 1e-5 (float32); the bounds and errors name what
they are about; per-query temperature and seed."""

import helpers.batching as batching_fixtures
import pytest
import torch
from helpers import options

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.decoding.greedy import Decoded, step_one
from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.pipeline import (
    Pipeline,
    assemble_prompt,
    encode,
    extend,
    prefill,
    preprocess,
    prompt_ids,
    prompt_rows,
)
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.stages.prompt import prompt_digest

pipe, frames = batching_fixtures.pipe, batching_fixtures.frames      # the module fixtures both files serve

Q1 = "What is in front of the ego vehicle?"
FOLLOW = ["Is it moving?", "What should the ego vehicle do then?", "Why?"]
OTHERS = ["Is there a pedestrian behind the ego car?", "Are there cars on the front left?",
          "What is the status of the truck?"]


def keys(i, frames):
    return {c: i for c in frames[i]}


def test_follow_ups_equal_the_conversation_from_scratch(pipe, frames):
    """Three turns: each follow-up's prompt is the conversation (its digest that of the ids built
    with history=), its answer that of the conversation computed from scratch, its vision skipped
    and all but its new rows reused."""
    first = pipe.answer(frames[0], QueryRequest(Q1, query_id="t1", keep_turn=True), frame_keys=keys(0, frames))
    history, previous = [(Q1, first.text)], first
    for n, question in enumerate(FOLLOW[:2], start=2):
        got = pipe.answer(
            frames[0],
            QueryRequest(question, follow_up_of=f"t{n - 1}", query_id=f"t{n}", keep_turn=True),
            frame_keys=keys(0, frames),
        )
        scratch = pipe.answer(frames[0], QueryRequest(question, history=history))
        assert got.token_ids == scratch.token_ids and got.text == scratch.text
        assert got.prompt_sha256 == scratch.prompt_sha256 == prompt_digest(prompt_ids(pipe.rt, got.cameras, question,
                                                                                      history)[0])
        assert got.turn == scratch.turn == n and scratch.reused_tokens == 0
        assert got.cameras == scratch.cameras == first.cameras == got.reused_cameras
        assert got.stage_ms["vision"] == got.stage_ms["preprocess"] == 0.0
        assert got.kept_tokens == first.kept_tokens                     # the first question's selection
        # every row up to the previous turn's answer is reused; prefill ran the rest
        assert previous.input_tokens + previous.reused_tokens <= got.reused_tokens
        assert got.reused_tokens + got.input_tokens == scratch.input_tokens
        history.append((question, got.text))
        previous = got


def test_reused_prefix_gives_the_logits_of_a_full_prefill(frames):
    """float32: the follow-up's KV (the turn's rows copied, the new rows run by `extend`) and its
    first answer token's logits against a full prefill of the same conversation: within 1e-5."""
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(decoding__mode="greedy", dtype="float32"))
    rt, a = pipe.rt, pipe.rt.arena
    first = pipe.answer(frames[0], QueryRequest(Q1, query_id="t1", keep_turn=True), frame_keys=keys(0, frames))
    turn = rt.conversations.follow("t1", keys(0, frames))
    cams = list(turn.cameras)
    with torch.inference_mode():
        visual = encode(rt, preprocess(rt, frames[0], cams), cams, {}, cams)
        layout = assemble_prompt(rt, cams, FOLLOW[0], visual, turn.history)
        full = prefill(rt, rt.region(0), layout, turn.keep)                   # every row, no conversation
        n = full.length
        k_full, v_full = a.k_cache[:, :, :n].clone(), a.v_cache[:, :, :n].clone()
        logits_full = rt.engines.head.run(full.hidden[-1:]).clone()
        a.k_cache.zero_(), a.v_cache.zero_()
        reused = rt.conversations.restore(turn, prompt_rows(rt, n), a.k_cache, a.v_cache)
        hidden = extend(rt, rt.region(0), a.embeds[reused:n], a.positions[reused:n], reused)
        logits = rt.engines.head.run(hidden[-1:])
    assert first.input_tokens < reused < n
    assert (logits - logits_full).abs().max().item() <= 1e-5
    assert (a.k_cache[:, :, :n] - k_full).abs().max().item() <= 1e-5
    assert (a.v_cache[:, :, :n] - v_full).abs().max().item() <= 1e-5


def test_extend_in_calls_of_a_step_bucket_equals_one_call(pipe, frames):
    """A graph backend runs at most its largest step bucket per call: the new rows in several
    calls give the same last row as one call (the engine here is eager; `sizes` is what extend reads)."""
    rt, a = pipe.rt, pipe.rt.arena
    pipe.answer(frames[0], QueryRequest(Q1, query_id="e1", keep_turn=True), frame_keys=keys(0, frames))
    turn = rt.conversations.follow("e1")
    with torch.inference_mode():
        layout = assemble_prompt(rt, list(turn.cameras), "Describe everything you can see around the ego car in "
                                 "detail, camera by camera.", [None] * len(turn.cameras), turn.history)
        n = prefill(
            rt, rt.region(0), layout, turn.keep, turn
        ).length  # fills the arena's rows (the KV is restored again below)
        start = rt.conversations.restore(turn, prompt_rows(rt, n), a.k_cache, a.v_cache)
        assert n - start > 8
        one = extend(rt, rt.region(0), a.embeds[start:n], a.positions[start:n], start)[-1:].clone()
        rt.engines.decoder.sizes = (1, 4)
        try:
            chunked = extend(rt, rt.region(0), a.embeds[start:n], a.positions[start:n], start)[-1:]
        finally:
            del rt.engines.decoder.sizes
    assert (one - chunked).abs().max().item() <= 1e-4


def forced(tokens):
    """Pipeline.answer's `decoder`: emit `tokens`, each fed to the decoder as greedy feeds its
    own, so the KV holds an answer whose ids are not how its text tokenizes again."""
    def decode(rt, q, prompt, max_new, on_tokens=None):
        for i, t in enumerate(tokens):
            step_one(rt, t, prompt.length + i, prompt.next_pos + i, q.region)
        return Decoded(list(tokens), len(tokens))
    return decode


def test_reuse_stops_where_the_answer_tokenizes_differently(pipe, frames):
    """A first answer decoded as single characters: the follow-up's prompt has the answer as its
    text tokenizes, so the reused rows stop inside it, and the answer is still the one from scratch."""
    tok = pipe.rt.tok
    text = "Yes, the white truck."
    chars = [tok.encode(ch)[0] for ch in text]
    assert tok.decode(chars) == text and chars != tok.encode(text)
    first = pipe.answer(
        frames[0], QueryRequest(Q1, query_id="f1", keep_turn=True), frame_keys=keys(0, frames), decoder=forced(chars)
    )
    assert first.text == text
    got = pipe.answer(frames[0], QueryRequest(FOLLOW[0], follow_up_of="f1"), frame_keys=keys(0, frames))
    scratch = pipe.answer(frames[0], QueryRequest(FOLLOW[0], history=[(Q1, text)]))
    assert first.input_tokens <= got.reused_tokens < first.input_tokens + len(chars)
    assert got.token_ids == scratch.token_ids


def test_follow_ups_inside_a_batch(pipe, frames):
    """First turns of three conversations decoded together; their follow-ups admitted beside a new
    question and while others decode (each in whichever region is free, not the one its turn used):
    every follow-up equals its conversation from scratch, and they were batched."""
    batch = BatchDecoder(pipe)
    questions = [Q1, *OTHERS[:2]]
    for i, q in enumerate(questions):
        batch.admit(
            frames[0], QueryRequest(q, query_id=f"c{i}", keep_turn=True), frame_keys=keys(0, frames), tag=f"c{i}"
        )
    firsts = {r.tag: a for r, a in batch.run()}
    batch.admit(frames[1], OTHERS[2], frame_keys=keys(1, frames), tag="new")
    batch.admit(frames[0], QueryRequest(FOLLOW[0], follow_up_of="c2"), frame_keys=keys(0, frames), tag="c2+")
    done = batch.step()
    batch.admit(frames[0], QueryRequest(FOLLOW[0], follow_up_of="c0"), frame_keys=keys(0, frames), tag="c0+")
    batch.admit(frames[0], QueryRequest(FOLLOW[1], follow_up_of="c1"), frame_keys=keys(0, frames), tag="c1+")
    answers = {r.tag: a for r, a in done + batch.run()}
    assert set(answers) == {"new", "c0+", "c1+", "c2+"}
    for i, q in enumerate(questions):
        got = answers[f"c{i}+"]
        scratch = pipe.answer(frames[0], QueryRequest(got.question, history=[(q, firsts[f"c{i}"].text)]))
        assert got.token_ids == scratch.token_ids, q
        assert got.reused_cameras == got.cameras and got.stage_ms["vision"] == 0.0 and got.reused_tokens > 0
    assert answers["new"].token_ids == pipe.answer(frames[1], OTHERS[2]).token_ids
    assert any(a.batched_steps for t, a in answers.items() if t.endswith("+"))


def test_max_turns_unknown_expired_and_other_frames_are_named(frames):
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__max_turns=2, serving__conversations=1,
                                                           decoding__mode="greedy", max_new_tokens=4))
    f, k = frames[0], keys(0, frames)
    pipe.answer(f, QueryRequest(Q1, query_id="a", keep_turn=True), frame_keys=k)
    with pytest.raises(InputError, match="camera CAM_.*'s frame differs") as e:
        pipe.answer(frames[1], QueryRequest(FOLLOW[0], follow_up_of="a"), frame_keys=keys(1, frames))
    assert e.value.about == "follow_up"
    pipe.answer(f, QueryRequest(FOLLOW[0], follow_up_of="a", query_id="a2", keep_turn=True), frame_keys=k)
    with pytest.raises(InputError, match="follow_up_of 'a2': its conversation has 2 turns; serving.max_turns is 2"):
        pipe.answer(f, QueryRequest(FOLLOW[1], follow_up_of="a2"), frame_keys=k)
    pipe.answer(f, QueryRequest(OTHERS[0], query_id="b", keep_turn=True), frame_keys=k)  # the one slot: "a" is evicted
    for gone in ("a", "nope"):
        with pytest.raises(InputError, match=f"follow_up_of '{gone}': no answered query with that id among the "
                                             r"last 1 kept \(serving.conversations\)"):
            pipe.answer(f, QueryRequest(FOLLOW[0], follow_up_of=gone), frame_keys=k)
    with pytest.raises(InputError, match="a conversation of 3 turns; serving.max_turns is 2"):
        pipe.answer(f, QueryRequest(FOLLOW[1], history=[(Q1, "Yes."), (FOLLOW[0], "No.")]))
    off = Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__conversations=0, max_new_tokens=2))
    off.answer(f, QueryRequest(Q1, query_id="x", keep_turn=True))
    with pytest.raises(InputError, match=r"follow-up questions are off \(serving.conversations is 0"):
        off.answer(f, QueryRequest(FOLLOW[0], follow_up_of="x"))


def test_the_arena_is_not_reallocated_by_conversations(pipe, frames):
    a = pipe.rt.arena
    assert a.k_turns.shape[0] == pipe.options.serving.conversations == 4
    before = {k: t.untyped_storage().data_ptr() for k, t in a.buffers().items()}
    pipe.answer(frames[1], QueryRequest(Q1, query_id="m1", keep_turn=True), frame_keys=keys(1, frames))
    for n in range(2, 4):
        pipe.answer(
            frames[1],
            QueryRequest(FOLLOW[n - 2], follow_up_of=f"m{n - 1}", query_id=f"m{n}", keep_turn=True),
            frame_keys=keys(1, frames),
        )
    assert {k: t.untyped_storage().data_ptr() for k, t in a.buffers().items()} == before


def test_per_query_temperature_and_seed(frames):
    """Pipeline.answer takes a query's own temperature and seed as BatchDecoder.admit does (one code
    path: Pipeline.begin): the same draws either way, the seed matters, none is greedy."""
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(serving__max_batch=4, decoding__mode="greedy"))
    f = frames[0]
    greedy = pipe.answer(f, OTHERS[0]).token_ids
    sampled = pipe.answer(f, QueryRequest(OTHERS[0], temperature=1.5, seed=7)).token_ids
    assert pipe.answer(f, QueryRequest(OTHERS[0], temperature=1.5, seed=7)).token_ids == sampled
    assert any(
        pipe.answer(f, QueryRequest(OTHERS[0], temperature=1.5, seed=s)).token_ids != sampled for s in (8, 9, 10)
    )
    batch = BatchDecoder(pipe)
    batch.admit(f, QueryRequest(OTHERS[0], temperature=1.5, seed=7), tag="x")
    batch.admit(f, OTHERS[1], tag="y")
    assert {r.tag: a for r, a in batch.run()}["x"].token_ids == sampled
    assert pipe.answer(f, OTHERS[0]).token_ids == greedy             # the configured default is untouched


def test_a_budget_can_only_cut_a_follow_ups_answer(pipe, frames):
    """Under a latency budget a follow-up keeps its conversation's views and tokens (the planner's
    ladder is that one step): only its answer is cut, to a prefix of the unbudgeted one."""
    first = pipe.answer(frames[1], QueryRequest(Q1, query_id="u1", keep_turn=True), frame_keys=keys(1, frames))
    free = pipe.answer(frames[1], QueryRequest(FOLLOW[1], follow_up_of="u1"), frame_keys=keys(1, frames))
    tight = pipe.answer(
        frames[1], QueryRequest(FOLLOW[1], follow_up_of="u1", budget_ms=0.5), frame_keys=keys(1, frames)
    )
    assert tight.cameras == tight.reused_cameras == first.cameras and tight.kept_tokens == first.kept_tokens
    assert not any(d.startswith(("views", "tokens")) for d in tight.degraded), tight.degraded
    assert any("cannot be met" in d for d in tight.degraded)
    assert tight.token_ids == free.token_ids[:len(tight.token_ids)] and len(tight.token_ids) <= 2
