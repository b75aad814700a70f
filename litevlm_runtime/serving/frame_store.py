"""Frame store: keeps the last few frames of each camera and matches a query to a frame set.

Plain Python (no ROS import) so that the node, `litevlm bag eval` and the unit tests share it.

Matching rule (DESIGN.md section 5): the newest complete set of one frame per camera whose
stamps lie within `max_skew_ns` of each other, every frame younger than `max_age_ns` at the
time the query arrives. A query that cannot be matched gets a `FrameMatchError` whose status
says why (never silence):
  bad_stamp     some camera delivers, but its frames are stamped ahead of the node's clock by
                more than max_future_ns, so none of them can be used (checked first: it is the
                specific diagnosis behind what would otherwise look like no_frames/stale_frames)
  no_frames     some camera has never delivered a frame
  stale_frames  some camera's newest frame is older than max_age (camera stopped, or bag gap)
  out_of_sync   every camera is fresh, but no set of frames fits within max_skew

Clock faults. Stamps are the camera's clock, ages are the node's (`clock_ns`):
  - a frame stamped more than max_future_ns ahead of the node's clock is refused on arrival and
    counted in `bad_stamp` (a frame from the future would have a negative age and never go
    stale); within the tolerance it is kept (clocks of two computers differ by a little);
  - stamps that jump back: a frame older than the newest held one is inserted in stamp order
    (late delivery). When the held frames are by then too far ahead of the node's clock (the
    node's clock stepped back), they are discarded at once. When two frames in a row are older
    than the whole held history (a camera clock that stepped back, not one late straggler, which
    is dropped), the history restarts from them. Both count in `history_resets`;
  - a held frame that is ahead of the node's clock by more than the tolerance when a query
    arrives (the node's clock stepped back) is not matched.

Memory: each camera's held frames take at most `max_bytes` (the frame_memory_mb setting) by their
payloads' sizes (payload_bytes), whatever the cameras send: a new frame makes room by dropping
the camera's oldest frames (counted in `memory_evictions`), and a frame larger than `max_bytes`
alone is refused (`refuse`: the query gets bad_image naming the camera and the setting). Without
it the bound was implicit: images.max_pixels x 8 bytes x frame_history (1 GB per camera by default).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence


@dataclass(frozen=True)
class Frame:
    camera: str
    stamp_ns: int          # header stamp: capture time on the camera's clock
    payload: Any           # undecoded image (see ros/images.py); decoded only when a query uses it


@dataclass(frozen=True)
class FrameSet:
    frames: dict[str, Frame]   # camera -> frame, one per camera

    @property
    def newest_ns(self) -> int:
        return max(f.stamp_ns for f in self.frames.values())

    @property
    def skew_ns(self) -> int:
        stamps = [f.stamp_ns for f in self.frames.values()]
        return max(stamps) - min(stamps)


def payload_bytes(payload) -> int:
    """The memory a frame's payload holds: its image bytes (serving/images.py's payloads carry them
    in .data; a bare bytes payload is its own length; anything else counts as nothing)."""
    data = getattr(payload, "data", payload)
    return len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0


def over_memory(camera: str, size: int, max_bytes: int | None) -> str | None:
    """Why a frame of `size` bytes can never be held within the per-camera bound (None: it can)."""
    if max_bytes is None or size <= max_bytes:
        return None
    return (f"{camera}: frame data of {size / 1e6:.1f} MB, above frame_memory_mb ({max_bytes / 1e6:g} MB held per "
            f"camera at most); refused on arrival, not stored")


class FrameMatchError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


# Frames in a row older than a camera's whole history before it is taken for a clock that
# stepped back (one such frame is a late straggler).
STEPS_BACK_TO_RESET = 2


class FrameStore:
    """Thread-safe: cameras are added from executor callbacks, matched from query callbacks."""

    def __init__(self, cameras: Sequence[str], max_skew_ns: int, max_age_ns: int, history: int = 8,
                 max_future_ns: int = 500_000_000, clock_ns: Callable[[], int] = time.time_ns,
                 max_bytes: int | None = None):
        if max_skew_ns < 0 or max_age_ns <= 0 or history < 1 or max_future_ns < 0 or (max_bytes or 1) < 1:
            raise ValueError("max_skew_ns >= 0, max_age_ns > 0, history >= 1, max_future_ns >= 0 and max_bytes "
                             ">= 1 (or None) are required")
        self.cameras = tuple(cameras)
        self.max_bytes = max_bytes             # per camera; None: only `history` bounds it
        self.max_skew_ns = int(max_skew_ns)
        self.max_age_ns = int(max_age_ns)
        self.max_future_ns = int(max_future_ns)
        self.clock_ns = clock_ns
        # Per camera, frames in stamp order; old ones fall off the left end.
        self._frames: dict[str, deque[Frame]] = {c: deque(maxlen=history) for c in self.cameras}
        self._lock = threading.Lock()
        self.received = {c: 0 for c in self.cameras}
        self.out_of_order = {c: 0 for c in self.cameras}   # arrived with a stamp older than one held
        self.dropped = {c: 0 for c in self.cameras}        # discarded on arrival (duplicate, too old)
        self.bad_stamp = {c: 0 for c in self.cameras}      # refused: stamped too far ahead of the node's clock
        self.history_resets = {c: 0 for c in self.cameras} # stamps jumped back: held frames discarded
        self._behind: dict[str, list[Frame]] = {c: [] for c in self.cameras}   # in a row, older than the history
        # Per camera: when (node clock) the last frame was accepted, and the last refused one
        # (arrival, how far ahead): a query names bad_stamp only while refusals are the news.
        self._accepted_at = {c: -1 for c in self.cameras}
        self._refused: dict[str, tuple[int, int] | None] = {c: None for c in self.cameras}
        # Frames refused on arrival by their header (too large for images.max_pixels ...): counted,
        # and the last one's reason (arrival, why) names the camera in a bad_image answer.
        self.bad_image = {c: 0 for c in self.cameras}
        self._refused_image: dict[str, tuple[int, str] | None] = {c: None for c in self.cameras}
        self.memory_evictions = {c: 0 for c in self.cameras}   # held frames dropped to stay within max_bytes

    def refuse(self, camera: str, why: str, now_ns: int | None = None) -> None:
        """A frame of `camera` refused before it was stored (`why` names the camera and the
        defect): a query that then finds no usable frame of that camera is answered bad_image."""
        now = self.clock_ns() if now_ns is None else now_ns
        with self._lock:
            self.received[camera] += 1
            self.bad_image[camera] += 1
            self._refused_image[camera] = (now, why)

    def add(self, frame: Frame, now_ns: int | None = None) -> None:
        if frame.camera not in self._frames:
            raise KeyError(f"unknown camera {frame.camera!r}; known: {', '.join(self.cameras)}")
        now = self.clock_ns() if now_ns is None else now_ns
        cam = frame.camera
        refused = over_memory(cam, payload_bytes(frame.payload), self.max_bytes)
        if refused:
            self.refuse(cam, refused, now)
            return
        with self._lock:
            self._insert(frame, now)
            self._fit(cam)

    def _aside(self, cam: str) -> list[Frame]:
        """Late stragglers held in _behind only (one, at most), not in the history."""
        return [f for f in self._behind[cam] if all(f is not g for g in self._frames[cam])]

    def _held(self, cam: str) -> int:
        """The bytes `cam`'s frames take: its history plus a straggler held aside."""
        return sum(payload_bytes(f.payload) for f in (*self._frames[cam], *self._aside(cam)))

    def _fit(self, cam: str) -> None:
        """Drop `cam`'s oldest frames (a straggler held aside first) until they take at most
        max_bytes; any one frame fits alone (add refused it otherwise)."""
        if self.max_bytes is None:
            return
        frames, held = self._frames[cam], self._held(cam)
        while held > self.max_bytes and (self._aside(cam) or len(frames) > 1):
            aside = self._aside(cam)
            dropped = aside[0] if aside else frames.popleft()
            self._behind[cam] = [f for f in self._behind[cam] if f is not dropped]
            held -= payload_bytes(dropped.payload)
            self.memory_evictions[cam] += 1

    def held_bytes(self) -> dict[str, int]:
        """Per camera, the bytes its frames take now (what max_bytes bounds)."""
        with self._lock:
            return {c: self._held(c) for c in self.cameras}

    def _insert(self, frame: Frame, now: int) -> None:
        """`add`'s clock and order rules (the module's docstring), under the lock."""
        cam = frame.camera
        frames = self._frames[cam]
        self.received[cam] += 1
        ahead = frame.stamp_ns - now
        if ahead > self.max_future_ns:
            self.bad_stamp[cam] += 1
            self._refused[cam] = (now, ahead)
            return
        self._accepted_at[cam] = now
        if not frames or frame.stamp_ns > frames[-1].stamp_ns:
            self._behind[cam].clear()
            frames.append(frame)
        elif frame.stamp_ns == frames[-1].stamp_ns:
            self._behind[cam].clear()
            self.dropped[cam] += 1
            frames[-1] = frame   # same stamp again: the newer message wins
        elif frames[-1].stamp_ns - now > self.max_future_ns:
            # Held frames are now too far ahead of the node's clock (it stepped back since
            # they came): they can never be matched; start again from this one.
            self.history_resets[cam] += 1
            self._behind[cam].clear()
            kept = [f for f in frames if f.stamp_ns - now <= self.max_future_ns and f.stamp_ns < frame.stamp_ns]
            frames.clear()
            frames.extend([*kept, frame])
        elif frame.stamp_ns < frames[0].stamp_ns:
            behind = self._behind[cam]
            behind.append(frame)
            if len(behind) >= STEPS_BACK_TO_RESET:
                # Frames keep coming from before the history: the camera's clock stepped back.
                self.history_resets[cam] += 1
                frames.clear()
                frames.extend(sorted(behind, key=lambda f: f.stamp_ns))
                behind.clear()
            elif len(frames) < frames.maxlen:
                self.out_of_order[cam] += 1
                frames.appendleft(frame)
            else:
                self.out_of_order[cam] += 1
                self.dropped[cam] += 1     # a late straggler older than the whole history: useless
        else:
            # Late delivery within the history: insert in stamp order so matching sees it.
            self._behind[cam].clear()
            self.out_of_order[cam] += 1
            items = sorted([*frames, frame], key=lambda f: f.stamp_ns)
            frames.clear()
            frames.extend(items[-frames.maxlen:])

    def _bad_stamp_message(self, cam: str) -> str | None:
        """Why `cam` has nothing usable, when the reason is that its frames are refused."""
        refused = self._refused[cam]
        if refused is None or refused[0] < self._accepted_at[cam]:
            return None
        return f"{cam} {refused[1] / 1e9:.3f} s"

    def complete(self, as_of_ns: int) -> bool:
        """Whether every camera has delivered a frame stamped at or after `as_of_ns` (the query's
        stamp): frames arrive in stamp order per camera, so no frame stamped before it is still in
        flight, and a match as of it is final."""
        with self._lock:
            return all(self._frames[c] and self._frames[c][-1].stamp_ns >= as_of_ns for c in self.cameras)

    def match(self, now_ns: int, as_of_ns: int | None = None) -> FrameSet:
        """The newest complete set at `now_ns` (the node's clock: frame ages, frames from the
        future); with `as_of_ns` (the query's stamp; frame_match as_asked) the newest complete set
        of frames stamped at or before it, ages taken there: the set is then a function of the
        stamps alone, whenever the frames arrived (a stamp ahead of the node's clock by more than
        max_future counts as the clock's)."""
        with self._lock:
            held = {c: list(self._frames[c]) for c in self.cameras}
            refused = {c: self._bad_stamp_message(c) for c in self.cameras}
            refused_images = {c: self._refused_image[c] for c in self.cameras if self._refused_image[c] is not None
                              and self._refused_image[c][0] >= self._accepted_at[c]}
        # Frames from the future are never matched (the node's clock may have stepped back since).
        usable = {c: [f for f in held[c] if f.stamp_ns - now_ns <= self.max_future_ns] for c in self.cameras}
        ref = now_ns if as_of_ns is None else min(as_of_ns, now_ns + self.max_future_ns)
        if as_of_ns is not None:
            usable = {c: [f for f in fs if f.stamp_ns <= ref] for c, fs in usable.items()}
        fresh = {c: [f for f in usable[c] if ref - f.stamp_ns <= self.max_age_ns] for c in self.cameras}
        for c in self.cameras:
            if held[c] and not usable[c] and as_of_ns is None:     # held, but all ahead of a clock that stepped back
                refused[c] = refused[c] or f"{c} {(held[c][0].stamp_ns - now_ns) / 1e9:.3f} s"
        bad = [refused[c] for c in self.cameras if not fresh[c] and refused[c]]
        if bad:
            raise FrameMatchError(
                "bad_stamp", f"frames stamped ahead of the node's clock by more than max_future "
                             f"{self.max_future_ns / 1e9:.3f} s: {', '.join(bad)}")
        bad_images = [refused_images[c][1] for c in self.cameras if not fresh[c] and c in refused_images]
        if bad_images:
            raise FrameMatchError("bad_image", "; ".join(bad_images))
        missing = [c for c in self.cameras if not usable[c]]
        if missing:
            when = "" if as_of_ns is None else " stamped at or before the question"
            raise FrameMatchError("no_frames", f"no frame{when} received yet from {', '.join(missing)}")
        stale = [c for c in self.cameras if not fresh[c]]
        if stale:
            ages = ", ".join(f"{c} {(ref - usable[c][-1].stamp_ns) / 1e9:.3f} s" for c in stale)
            when = "" if as_of_ns is None else " at the question's stamp"
            raise FrameMatchError(
                "stale_frames", f"newest frame older than max_frame_age {self.max_age_ns / 1e9:.3f} s{when}: {ages}"
            )
        # Try each fresh frame as the newest member of a set, newest first; the first anchor for
        # which every camera has a frame within [anchor - skew, anchor] gives the newest set.
        # (At most cameras x history anchors: 48 with the defaults, so brute force is fine.)
        anchors = sorted((f for fs in fresh.values() for f in fs), key=lambda f: f.stamp_ns, reverse=True)
        for anchor in anchors:
            chosen = {}
            for c in self.cameras:
                candidates = [
                    f for f in fresh[c] if anchor.stamp_ns - self.max_skew_ns <= f.stamp_ns <= anchor.stamp_ns
                ]
                if not candidates:
                    break
                chosen[c] = candidates[-1]    # newest within the window
            else:
                return FrameSet(frames=chosen)
        newest = {c: fresh[c][-1].stamp_ns for c in self.cameras}
        spread = (max(newest.values()) - min(newest.values())) / 1e6
        laggard = min(newest, key=newest.get)
        raise FrameMatchError(
            "out_of_sync",
            f"no set of {len(self.cameras)} frames within max_skew {self.max_skew_ns / 1e6:.1f} ms "
            f"(newest frames span {spread:.1f} ms; oldest is {laggard})",
        )

    def depth(self) -> dict[str, int]:
        with self._lock:
            return {c: len(self._frames[c]) for c in self.cameras}
