"""A damaged bag (truncated by a recorder that died, a bad copy, a wrong file) ends a bag tool with
one line naming the bag and what is wrong, never a traceback or a hang. rosbags raises its own
errors for some damage and plain Python ones (struct.error, KeyError, zstandard/lz4 errors,
sqlite3.DatabaseError, ...) for the rest, at open, while iterating or while deserializing: each is
turned into an InputError here, which the CLI prints as `litevlm bag ...: error: BAG: ...`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ..errors import InputError


def describe(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def damaged(path: Path, what: str, exc: BaseException) -> InputError:
    return InputError(f"{path}: damaged or truncated bag ({what}: {describe(exc)})")


def guarded(path: Path, messages: Iterator, what: str = "reading its messages") -> Iterator:
    """`messages` (rosbags' reader.messages) with every error while reading turned into one
    InputError naming the bag."""
    try:
        yield from messages
    except InputError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the storage plugin raises on bad bytes
        raise damaged(path, what, exc) from None


def decode(path: Path, topic: str, t_ns: int, fn, *args):
    """fn(*args) (a deserialization), an InputError naming the bag, the topic and the time on failure."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - a message whose bytes do not parse as its type
        raise damaged(path, f"message on {topic} at {t_ns / 1e9:.3f} s does not deserialize", exc) from None
