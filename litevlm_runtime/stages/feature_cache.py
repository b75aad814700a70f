"""Visual reuse: each camera's vision output (decoded, resized, InternViT, pixel shuffle, mlp1) for
one frame is computed once and reused by every later query about the same frame set, whichever
cameras each selects. A driving stack asks several questions of one frame set (perception,
prediction, planning); the vision stage is then paid once per camera, not once per question.

Keyed by (camera, frame key): the frame key is what identifies the image (the node and `bag eval`
pass the frame's header stamp, `litevlm eval` the image file); the tile count and the model are
fixed per runtime, so a cache belongs to one runtime. Entries live in a fixed-size region of the
memory arena (`arena.feature_cache`, [slots, tokens per camera, D], allocated once), and the least
recently used entry is evicted first: no allocation in steady state.

Frame sets over time (a K-frame question): the cache is also the window of a query's (camera,
frame) views. It holds at least temporal.max_frames x cameras entries (runtime.feature_slots), and
a query touches each of its views (found or stored) before the next is stored, so the views of one
query never evict each other: a camera frame is encoded once while it is in the window, and a
K-frame question's vision stage encodes only the frames not there yet. With serving.feature_cache
off it is that window alone (`reuse` False: nothing is found again).

Why not the prompt prefix's KV as well: with token selection on (the deployed configuration) the
visual tokens kept depend on the question (its attention to them), so two questions about the same
cameras prefill different rows at different positions; the KV of "the same prefix" is exact only
when every token is kept, i.e. for the baseline pipeline, and it would then only save the prefix's
part of prefill. The visual features are exact for every configuration. (A follow-up question
continues one conversation, whose visual tokens its first question chose: that one does reuse
the conversation's KV, pipeline/conversation.py.)
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable

import torch


class FeatureCache:
    def __init__(self, slots: torch.Tensor, reuse: bool = True):
        self.slots = slots                                   # [n, tokens_per_camera, D] arena region
        self.index: OrderedDict[tuple, int] = OrderedDict()  # key -> slot, least recently used first
        self.reuse = reuse                                   # False: a query's window only, never found again
        self.hits = self.misses = 0

    @property
    def capacity(self) -> int:
        return self.slots.shape[0]

    def has(self, camera: str, frame_key: Hashable) -> bool:
        """Whether `get` would find it (without touching it)."""
        return self.reuse and (camera, frame_key) in self.index

    def get(self, camera: str, frame_key: Hashable) -> torch.Tensor | None:
        slot = self.index.get((camera, frame_key)) if self.reuse else None
        if slot is None:
            self.misses += 1
            return None
        self.hits += 1
        self.index.move_to_end((camera, frame_key))          # used now: evicted last
        return self.slots[slot]

    def put(self, camera: str, frame_key: Hashable, visual: torch.Tensor) -> torch.Tensor:
        """Store one camera's visual tokens [tokens_per_camera, D]; returns the cached view."""
        key = (camera, frame_key)
        if key in self.index:
            slot = self.index[key]
        elif len(self.index) < self.capacity:
            slot = len(self.index)
        else:
            _, slot = self.index.popitem(last=False)         # evict the least recently used
        self.index[key] = slot
        self.index.move_to_end(key)
        self.slots[slot].copy_(visual)
        return self.slots[slot]

    def clear(self) -> None:
        self.index.clear()
