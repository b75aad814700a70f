"""A query's input over time: the frame sets it is answered from, oldest first, the key set last.

    pipeline.answer(images, request, frame_keys=keys)                 # one frame set (K = 1), as always
    pipeline.answer([FrameSet(images_t0, keys_t0), ..., FrameSet(images, keys)],
                    QueryRequest(question, frames=4))                 # K frame sets, oldest first

Each set holds per camera its image (a path, encoded bytes or an HxWx3 array: what
stages/preprocess.load_image reads) and its frame key (what identifies that image: the frame's
header stamp in the node and `bag eval`, the file in `litevlm eval`). The key is what the feature
cache stores a camera frame's visual features under, so that a frame is encoded once however many
questions and frame windows it is part of (stages/feature_cache.py). Sets without keys still
run; a K-frame query then gets keys of its own that no later query shares (nothing is reused).

The caller finds the sets (the node's frame store matches each past set by stamps; `litevlm eval`
and `ask` read them with frames.frames_over_time): the pipeline takes the newest `request.frames`
of the sets it is given, and how many of those a question needs is the time selector's to decide
(pipeline.select_frames).
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class FrameSet:
    images: Mapping[str, object]                  # camera -> image (path, bytes, HxWx3 uint8 array)
    keys: Mapping[str, Hashable] | None = None    # camera -> frame key (stamp); None: none given


@dataclass(frozen=True)
class QueryOnly:
    """The frame key of a camera frame given without one, in a K-frame query: unique to that query,
    so its features live in the cache for the query's own use and are never found again."""
    query: int
    step: int


_unkeyed = itertools.count()


def frame_sets_of(images, frame_keys: Mapping | None = None) -> tuple[FrameSet, ...]:
    """The frame sets of a query, oldest first: one set for a camera -> image mapping (with
    `frame_keys`, as every caller passed them before frame sets existed), or the given sequence
    of FrameSets (each with its own keys; `frame_keys` must then be None)."""
    if isinstance(images, Mapping):
        return (FrameSet(images, frame_keys),)
    if frame_keys is not None:
        raise InputError("frame_keys with frame sets: each FrameSet carries its own keys", about="image")
    if not isinstance(images, Sequence) or not images or not all(isinstance(s, FrameSet) for s in images):
        raise InputError("a query's images are a camera -> image mapping or a non-empty sequence of FrameSets "
                         "(oldest first)", about="image")
    sets = tuple(images)
    if len(sets) == 1:
        return sets
    query = next(_unkeyed)           # (a camera frame without a key gets one no other query has)
    return tuple(FrameSet(s.images, {c: (s.keys or {}).get(c, QueryOnly(query, t)) for c in s.images})
                 for t, s in enumerate(sets))
