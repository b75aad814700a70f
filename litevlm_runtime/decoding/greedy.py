"""Decoding strategies as plain functions over the runtime context (as gpt-fast's `generate`):

    greedy(rt, q, prompt, max_new)              one decoder step per token over the static cache
    speculative.eagle2(rt, q, prompt, max_new)  EAGLE-2 draft trees, verified in one pass each

Both start from a `Prompt` (what prefill left in the cache) and return a `Decoded`; `q` is the
query's own decoding state (`QueryDecoding`: its KV region, temperature, generator and constraint),
so that the runtime `rt`, built once, is shared by every query and never copied. The caller
chooses the strategy per call (Pipeline.answer: options.decoding.mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..engines.base import KVRegion
from .constrain import Constraint


@dataclass
class Prompt:
    """The state prefill leaves: cache rows [0, length) hold the prompt, `first` is the first
    answer token (not yet in the cache), at position `next_pos`."""

    length: int
    next_pos: int
    first: int
    hidden: torch.Tensor | None   # [length, D] final-norm features (EAGLE-2's first draft input; None: not every row's)
    input_tokens: int             # rows prefill ran over
    kept_tokens: int  # visual tokens among them
    reused: int = 0  # rows [0, reused) whose KV came from the conversation it continues (pipeline/conversation.py)
    shared: int = 0  # rows [0, shared) whose KV came from the prompt prefix every query shares (pipeline/prefix.py)


@dataclass
class Decoded:
    tokens: list[int]             # the answer, EOS excluded
    steps: int                    # target decoder passes after prefill
    accepted: float = 1.0         # mean answer tokens per target pass
    rounds: list = field(default_factory=list)   # EAGLE-2: per round (depth, tree size, accepted) or "greedy"
    # Stopped early (`stop()`: another query wants to join a batch): (the last token of `tokens`,
    # not yet in the cache; its slot; its position), where batched steps carry on (batching.py).
    resume: tuple[int, int, int] | None = None


@dataclass
class QueryDecoding:
    """One query's decoding state: the KV region its rows live in, its sampling (temperature 0:
    argmax) with a generator of its own (the same query, the same draws, whatever else runs), and
    its constraint's matcher. Made per query (pipeline.py); the runtime is never copied for it."""

    region: KVRegion
    temperature: float = 0.0
    sampler: torch.Generator | None = None
    constraint: Constraint | None = None

    @classmethod
    def greedy(cls, rt) -> "QueryDecoding":
        """Argmax decoding in region 0, unconstrained (warm-up measurements, scripts)."""
        return cls(rt.region(0))


def choose(q: QueryDecoding, logits: torch.Tensor) -> int:
    """The next token from one row of logits [1, V]: argmax, or a draw at the query's
    temperature; under its constraint (constrain.py) among the tokens its grammar allows, which
    then advances past the token."""
    constraint = q.constraint
    if constraint is not None:
        logits = constraint.mask(logits[-1:])
    if q.temperature <= 0:
        token = int(logits[-1].argmax())
    else:
        probs = torch.softmax(logits[-1].float() / q.temperature, dim=-1)
        token = int(torch.multinomial(probs.cpu(), 1, generator=q.sampler))
    if constraint is not None:
        constraint.advance(token)
    return token


def step_one(rt, token: int, slot: int, position: int, region: KVRegion | None = None) -> torch.Tensor:
    """One plain decoder step: `token` at `slot`/`position` of KV `region` (default region 0)
    attending to every slot before it. Returns its final-norm feature [1, D]."""
    a = rt.arena
    a.token_ids[slot] = token
    a.positions[slot] = position
    a.mask_new[:1, :1] = True
    emb = rt.lm.embed(a.token_ids[slot:slot + 1])
    decoder = (region or rt.region(0)).decoder
    return decoder.step(emb, a.positions[slot:slot + 1], a.slots[slot:slot + 1], a.all_visible(1, slot),
                        a.mask_new[:1, :1])


def greedy(rt, q: QueryDecoding, prompt: Prompt, max_new: int, on_tokens=None, stop=None) -> Decoded:
    """Plain decoding over the static cache: one decoder pass per token (greedy, or sampling at
    the query's temperature). `on_tokens(tokens so far)` is called as they are emitted;
    `stop()`, checked before each pass, ends it early with `Decoded.resume` set."""
    eos = rt.tok.eos_ids
    out: list[int] = []
    token, slot, position, steps = prompt.first, prompt.length, prompt.next_pos, 0
    while token not in eos and len(out) < max_new:
        out.append(token)
        if on_tokens is not None:
            on_tokens(out)
        if len(out) == max_new:
            break
        if stop is not None and stop():
            return Decoded(out, steps, 1.0, resume=(token, slot, position))
        hidden = step_one(rt, token, slot, position, q.region)
        token = choose(q, rt.engines.head.run(hidden))
        steps, slot, position = steps + 1, slot + 1, position + 1
    return Decoded(out, steps, 1.0)
