"""Query ids of a replayed bag: unique per replay.

A bag carries fixed query ids, and the node refuses an id it has seen (duplicate_id, for the
last 65,536 ids), so replaying one bag twice into a running node answered the second replay
entirely duplicate_id. `bag replay` therefore publishes each Query's id as `ID@replay-TAG`, TAG
new for every replay; within one replay a repeated id stays repeated, so duplicate_id still
catches a real duplicate in one stream. `bag record` writes the bag's own id back into
`query_id` (and the tag into `replay`), so `bag compare` against `bag eval` matches answers by
the ids of the bag.
"""

from __future__ import annotations

import os
import time

SEPARATOR = "@replay-"


def replay_tag() -> str:
    """New for every replay: milliseconds since the epoch and the process id, in base 36."""
    return f"{_base36(time.time_ns() // 1_000_000)}{_base36(os.getpid())}"


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if not n:
            return out


def tagged(query_id: str, tag: str) -> str:
    """The id a replay publishes (an empty id stays empty: the node numbers it)."""
    return f"{query_id}{SEPARATOR}{tag}" if query_id else query_id


def split(query_id: str) -> tuple[str, str]:
    """(the bag's id, the replay's tag or '')."""
    base, sep, tag = query_id.rpartition(SEPARATOR)
    return (base, tag) if sep else (query_id, "")
