"""Follow-up questions: a query may continue the conversation of an earlier answered query on the
same frames (`Query.follow_up_of`), as upstream's `chat(..., history=)` continues one: the images
in the first user turn, every earlier answer an assistant turn (stages/prompt.py builds the ids).

    turns = Conversations(arena.k_turns, arena.v_turns, max_turns)
    turn = turns.follow("q1", frame_keys)           the answered turn a follow-up continues
    reused = turns.restore(turn, rows, k, v)        its KV rows that the follow-up's prompt begins with
    turns.keep("q2", Turn(...), k, v)               an answered turn, for follow-ups of its own

What a follow-up reuses, and why it is exact:
- Views and visual tokens: the first question chose them (view selector, token selector), and
  every turn of the conversation keeps that choice. The follow-up's visual rows are therefore the
  same rows at the same positions as its conversation's first turn's: no vision stage, no token
  selection.
- KV: each kept turn's slot holds the KV rows of its prompt and of the answer tokens that entered
  the cache while it was decoded (all of them when the answer ended at the end token, all but the
  last when the cap cut it). The follow-up's prompt is re-tokenized from text as upstream's is (the
  earlier answer as its text); its first rows that equal the slot's rows, token id and position
  both, are copied into the follow-up's KV region and prefill runs over the rest. Where the
  re-tokenized answer differs from the ids decoded (a tokenizer joins "assistant\\n" with the
  answer's first characters differently, a leading space the text dropped), the copy stops at the
  first different row: what is reused is exactly what a full prefill would compute, up to
  floating-point summation order (tests/pipeline/test_follow_up.py: 1e-5 in float32).
- Not kept: EAGLE-2's draft cache (one per arena, overwritten by every speculating answer; the
  follow-up's prefill has features of its new rows only), so a follow-up decodes with plain steps:
  token for token the greedy answer EAGLE-2 gives (pipeline.py, plan_follow_up).

Memory: `serving.conversations` slots in the arena, each one KV region (the arena's max_len
rows), allocated once; the least recently used turn is evicted first, and its id then answers
"expired". Working regions belong to the batch (graph backends bind them by address, and a
batched step reads regions [0, B) in place), so a turn's rows are copied out when it finishes
and back in when a follow-up starts: a copy of its live rows each way. A turn already at
`serving.max_turns` is not kept (nothing may follow it): only its id is remembered, so that a
follow-up of it is told the limit rather than "unknown".
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Hashable

import torch

from ..errors import InputError


@dataclass
class Turn:
    """An answered query, as a follow-up continues it."""
    history: tuple[tuple[str, str], ...]   # (question, answer text) of every turn so far, this one last
    cameras: tuple[str, ...]  # the conversation's views (its first question chose them), rig order
    keep: list[torch.Tensor]  # per view (camera, and frame set within), the kept visual token indices
    keep_ratio: float
    frame_keys: Mapping | None             # what identifies its frames: a follow-up uses the same
    rows: list[tuple[int, int]]            # (token id, position) of each KV row its slot holds, slot order
    slot: int = -1                         # its KV region in arena.k_turns / v_turns
    frames: int = 1                        # frame sets its prompt holds per camera (their rows are in its KV)


def common_rows(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """The length of the longest common prefix of two row lists."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Conversations:
    def __init__(self, k_turns: torch.Tensor, v_turns: torch.Tensor, max_turns: int):
        self.k, self.v = k_turns, v_turns        # [slots, layers, kv_heads, max_len, head_dim] arena regions
        self.max_turns = max_turns
        self.turns: OrderedDict[Hashable, Turn] = OrderedDict()     # id -> Turn, least recently used first
        self.ended: OrderedDict[Hashable, int] = OrderedDict()      # id -> turns, of answers at max_turns (not kept)
        self.lock = threading.Lock()             # follow() also runs on the node's executor thread (submit)

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def keeps(self, turns: int) -> bool:
        """Whether an answered turn of a conversation of `turns` turns is kept: a follow-up may come."""
        return bool(self.capacity) and turns < self.max_turns

    def follow(self, turn_id: Hashable, frame_keys: Mapping | None = None) -> Turn:
        """The answered turn `turn_id` that a follow-up continues; InputError (about "follow_up")
        naming the id when follow-ups are off, the id is unknown or expired, its conversation is at
        serving.max_turns, or `frame_keys` are not its frames'."""
        what = f"follow_up_of {turn_id!r}"
        if not self.capacity:
            raise InputError(f"{what}: follow-up questions are off (serving.conversations is 0 or "
                             f"serving.max_turns is 1)", about="follow_up")
        with self.lock:
            turn = self.turns.get(turn_id)
            if turn is not None:
                self.turns.move_to_end(turn_id)
            ended = self.ended.get(turn_id)
        if ended is not None:
            raise InputError(f"{what}: its conversation has {ended} turns; serving.max_turns is {self.max_turns}",
                             about="follow_up")
        if turn is None:
            raise InputError(f"{what}: no answered query with that id among the last {self.capacity} kept "
                             f"(serving.conversations): unknown, not answered (ok) yet, or expired", about="follow_up")
        if frame_keys is not None and turn.frame_keys is not None:
            other = [c for c in turn.cameras if frame_keys.get(c) != turn.frame_keys.get(c)]
            if other:
                raise InputError(f"{what}: a follow-up is about the frames of the turn it follows; camera "
                                 f"{other[0]}'s frame differs", about="follow_up")
        return turn

    def get(self, turn_id: Hashable) -> Turn | None:
        """The kept turn `turn_id`, or None (a look-up: `follow` is the check that names why not)."""
        with self.lock:
            return self.turns.get(turn_id)

    def restore(self, turn: Turn, rows: list[tuple[int, int]], k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
        """Copy into a KV region (k_cache [layers, kv_heads, max_len, head_dim]) the rows of `turn`'s
        slot that the follow-up's prefill rows `rows` begin with; returns how many (at most all but
        the last row: prefill must run at least one row, for the first answer token's logits)."""
        n = min(common_rows(turn.rows, rows), len(rows) - 1)
        k_cache[:, :, :n] = self.k[turn.slot, :, :, :n]
        v_cache[:, :, :n] = self.v[turn.slot, :, :, :n]
        return n

    def keep(self, turn_id: Hashable, turn: Turn, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Keep an answered turn for follow-ups: its KV rows copied from its region into a slot (the
        least recently used turn's, when every slot is taken). A turn at max_turns is not kept."""
        with self.lock:
            self.turns.pop(turn_id, None)           # (an id used again: its newer answer replaces it)
            self.ended.pop(turn_id, None)
            if not self.keeps(len(turn.history)):      # only its id is remembered, to name the limit
                if self.capacity:
                    self.ended[turn_id] = len(turn.history)
                    if len(self.ended) > self.capacity:
                        self.ended.popitem(last=False)
                return
            free = sorted(set(range(self.capacity)) - {t.slot for t in self.turns.values()})
            turn.slot = free[0] if free else self.turns.popitem(last=False)[1].slot     # else: evict the oldest
            n = len(turn.rows)
            self.k[turn.slot, :, :, :n] = k_cache[:, :, :n]
            self.v[turn.slot, :, :, :n] = v_cache[:, :, :n]
            self.turns[turn_id] = turn

    def clear(self) -> None:
        with self.lock:
            self.turns.clear()
            self.ended.clear()
