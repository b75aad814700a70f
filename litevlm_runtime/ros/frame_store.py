"""Frame store: keeps the last few frames of each camera and matches a query to a frame set.

Plain Python (no ROS import) so that the node, `litevlm bag eval` and the unit tests share it.

Matching rule (DESIGN.md section 5): the newest complete set of one frame per camera whose
stamps lie within `max_skew_ns` of each other, every frame younger than `max_age_ns` at the
time the query arrives. A query that cannot be matched gets a `FrameMatchError` whose status
says why (never silence):
  no_frames     some camera has never delivered a frame
  stale_frames  some camera's newest frame is older than max_age (camera stopped, or bag gap)
  out_of_sync   every camera is fresh, but no set of frames fits within max_skew
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence


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


class FrameMatchError(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status


class FrameStore:
    """Thread-safe: cameras are added from executor callbacks, matched from query callbacks."""

    def __init__(self, cameras: Sequence[str], max_skew_ns: int, max_age_ns: int, history: int = 8):
        if max_skew_ns < 0 or max_age_ns <= 0 or history < 1:
            raise ValueError("max_skew_ns >= 0, max_age_ns > 0 and history >= 1 are required")
        self.cameras = tuple(cameras)
        self.max_skew_ns = int(max_skew_ns)
        self.max_age_ns = int(max_age_ns)
        # Per camera, frames in stamp order; old ones fall off the left end.
        self._frames: dict[str, deque[Frame]] = {c: deque(maxlen=history) for c in self.cameras}
        self._lock = threading.Lock()
        self.received = {c: 0 for c in self.cameras}
        self.out_of_order = {c: 0 for c in self.cameras}   # arrived with a stamp older than one held
        self.dropped = {c: 0 for c in self.cameras}        # discarded on arrival (duplicate, too old)

    def add(self, frame: Frame) -> None:
        if frame.camera not in self._frames:
            raise KeyError(f"unknown camera {frame.camera!r}; known: {', '.join(self.cameras)}")
        with self._lock:
            frames = self._frames[frame.camera]
            self.received[frame.camera] += 1
            if frames and frame.stamp_ns < frames[-1].stamp_ns:
                # Late delivery: insert in stamp order so matching still sees it (rare; bounded).
                self.out_of_order[frame.camera] += 1
                items = sorted([*frames, frame], key=lambda f: f.stamp_ns)
                if len(items) > frames.maxlen and items[0] is frame:
                    self.dropped[frame.camera] += 1     # older than the whole history: useless
                frames.clear()
                frames.extend(items[-frames.maxlen:])
            elif frames and frame.stamp_ns == frames[-1].stamp_ns:
                self.dropped[frame.camera] += 1
                frames[-1] = frame   # same stamp again: the newer message wins
            else:
                frames.append(frame)

    def match(self, now_ns: int) -> FrameSet:
        with self._lock:
            held = {c: list(self._frames[c]) for c in self.cameras}
        missing = [c for c in self.cameras if not held[c]]
        if missing:
            raise FrameMatchError("no_frames", f"no frame received yet from {', '.join(missing)}")
        fresh = {c: [f for f in held[c] if now_ns - f.stamp_ns <= self.max_age_ns] for c in self.cameras}
        stale = [c for c in self.cameras if not fresh[c]]
        if stale:
            ages = ", ".join(f"{c} {(now_ns - held[c][-1].stamp_ns) / 1e9:.3f} s" for c in stale)
            raise FrameMatchError(
                "stale_frames", f"newest frame older than max_frame_age {self.max_age_ns / 1e9:.3f} s: {ages}"
            )
        # Try each fresh frame as the newest member of a set, newest first; the first anchor for
        # which every camera has a frame within [anchor - skew, anchor] gives the newest set.
        # (At most cameras x history anchors: 48 with the defaults, so brute force is fine.)
        anchors = sorted((f for fs in fresh.values() for f in fs), key=lambda f: f.stamp_ns, reverse=True)
        for anchor in anchors:
            chosen = {}
            for c in self.cameras:
                candidates = [f for f in fresh[c] if anchor.stamp_ns - self.max_skew_ns <= f.stamp_ns <= anchor.stamp_ns]
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
