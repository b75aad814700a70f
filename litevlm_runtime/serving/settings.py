"""The query server's settings, in one place: the server reads them, the node declares each as a
parameter of the same name with the same default, range and liveness (ros/parameters.py's
NodeSettings extends this class), and `bag eval` builds them from the node's parameters field by
field (`from_values`), so the three can no longer drift apart."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

from ..cameras import CAMERAS
from ..errors import InputError
from ..options import _Validated, setting
from .frame_store import PAST_TOLERANCE

OVERFLOW_POLICIES = ("reject_new", "drop_oldest")
FRAME_MATCH = ("as_asked", "newest")
EXPLAIN_MODES = ("never", "subscribed", "always")       # explainer.py (not off/on: YAML booleans)


@dataclass(frozen=True)
class ServerSettings(_Validated):
    cameras: tuple = setting(tuple(CAMERAS), "the cameras served, rig order", ros=False)
    max_skew_s: float = setting(0.1, "the six stamps of a frame set lie within this (s; nuScenes rig ~0.045)",
                                lo=0.0, hi=60.0, live=True)
    max_frame_age_s: float = setting(1.0, "every frame of the set younger than this when the query arrives (s)",
                                     lo=0.001, hi=3600.0, live=True)
    # How far back a question's stamp may lie (frame_store.py, "The window"): queued and flooded
    # queries are matched seconds after their stamps; a stamp older than the window gets too_old.
    frame_window_s: float = setting(5.0, "each camera's frames of the last this many seconds (by their stamps) are "
                                         "kept, so that a question stamped up to this far back (or taken that late "
                                         "from a flood) is answered from the frames at or before its stamp; bounded "
                                         "by frame_memory_mb (s)", lo=0.0, hi=600.0)
    frame_history: int = setting(0, "frames kept per camera at most, besides frame_window_s and frame_memory_mb "
                                    "(0: no count limit)", lo=0, hi=100000)
    # The frame store's memory, bounded per camera whatever the cameras send (frame_store.py).
    frame_memory_mb: float = setting(256.0, "the frames held per camera take at most this much memory (MB, 10^6 "
                                            "bytes): the oldest are dropped to make room (counted per camera on "
                                            "/diagnostics), and a frame larger than this alone is refused on arrival "
                                            "(bad_image)", lo=0.001, hi=1e6)
    # The frames a query needs may still be in flight (a large frame published before the
    # question can arrive after it): a failed match is retried this long before it is refused.
    match_wait_s: float = setting(0.2, "a query whose frames are missing, stale or out of sync is retried this long "
                                       "before its error answer (s; frames may still be in flight)",
                                  lo=0.0, hi=60.0, live=True)
    # Which frames answer a query (frame_store.py). as_asked: the newest set stamped at or before the
    # question's stamp, taken once every camera has delivered a frame from after it (or match_wait_s
    # has passed): the same set whenever frames and question arrived, so a bag replayed twice, or
    # under load, is answered as `bag eval` answers it; a live query waits for the cameras' next
    # frame (at most one frame interval, ~83 ms at nuScenes' 12 Hz). newest: the newest set when the
    # query arrives (no wait; which set depends on delivery timing).
    frame_match: str = setting("as_asked", "frames of a query: as_asked (the newest set stamped at or before the "
                                           "question, once every camera has sent a later frame or match_wait_s has "
                                           "passed: deterministic for a replayed bag) | newest (the newest set when "
                                           "the query arrives: no wait, but replays may differ under load)",
                               choices=FRAME_MATCH, live=True)
    max_future_s: float = setting(0.5, "a frame stamped more than this ahead of the node's clock is refused "
                                       "(bad_stamp, counted per camera on /diagnostics) (s)", lo=0.0, hi=3600.0)
    queue_size: int = setting(4, "queries queued for the pipeline, at most", lo=1, hi=10000, live=True)
    overflow_policy: str = setting("reject_new", "a query to a full queue: reject_new (it gets queue_full) | "
                                                 "drop_oldest (the oldest queued one does)",
                                   choices=OVERFLOW_POLICIES, live=True)
    max_question_chars: int = setting(2000, "longer questions are answered bad_question", lo=1, hi=1_000_000,
                                      live=True)
    # Answers you can see (docs/explain.md): computed after the answer is published, and only when wanted.
    explain: str = setting("subscribed", "which answers are explained (their picture published on ~/explanation "
                                         "after the answer): subscribed (those whose Query asks, and every one "
                                         "while ~/explanation has a subscriber) | always (every answer) | never (none, "
                                         "a Query's explain flag included)", choices=EXPLAIN_MODES, live=True)
    # 4 s: the whole stop ends inside `ros2 launch`'s sigterm_timeout (5 s after its own SIGINT).
    drain_timeout_s: float = setting(4.0, "on SIGINT/SIGTERM or lifecycle shutdown the stop takes at most this long "
                                          "(s): queued queries are answered shutting_down at once, the running one is "
                                          "waited for until 0.5 s before it, the answers' acknowledgements until it",
                                     lo=0.0, hi=3600.0)

    # Standing questions (standing.py): asked on new frame sets, answered when the cameras they need
    # changed; their answers on ~/standing/NAME, at the lowest priority.
    standing_questions: tuple = setting((), "questions the node asks itself on new frame sets, each 'NAME: QUESTION' "
                                            "(NAME: letters, digits and _, not first a digit); answered only when the "
                                            "cameras it needs changed by standing_change, on ~/standing/NAME "
                                            "(litevlm_msgs/Answer), at the lowest priority (docs/serving.md)")
    standing_rate_hz: float = setting(2.0, "standing questions are asked on new frame sets at most this often, by "
                                           "their stamps (0: off)", lo=0.0, hi=100.0, live=True)
    standing_change: float = setting(0.05, "a standing question is answered again when a camera it needs changed by "
                                           "at least this since its last answer: mean relative L2 distance of the "
                                           "camera's visual tokens (the feature cache's; 0: on every set)",
                                     lo=0.0, hi=10.0, live=True)
    standing_frames: int = setting(0, "frame sets a standing question asks for (0: temporal.frames; the time "
                                      "selector may use fewer)", lo=0, hi=16)

    def __post_init__(self):
        super().__post_init__()
        standing_questions(self.standing_questions)      # InputError naming the bad entry

    @classmethod
    def from_values(cls, values: dict, cameras=CAMERAS) -> "ServerSettings":
        """The server's settings out of a mapping that holds them by name (the node's parameters,
        NodeSettings' fields): every field but `cameras` taken from it when present."""
        return cls(cameras=tuple(cameras), **{f.name: tuple(values[f.name]) if isinstance(values[f.name], list)
                                               else values[f.name] for f in fields(cls)
                                               if f.name != "cameras" and f.name in values})


STANDING_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def standing_questions(entries) -> dict[str, str]:
    """standing_questions' entries ('NAME: QUESTION') as {name: question}, in order; InputError naming
    the entry that is not one, or a name given twice."""
    out: dict[str, str] = {}
    for entry in entries:
        name, sep, question = str(entry).partition(":")
        name, question = name.strip(), question.strip()
        if not sep or not STANDING_NAME.match(name) or not question:
            raise InputError(f"standing_questions: {entry!r} is not 'NAME: QUESTION' (NAME: letters, digits and _, "
                             f"not first a digit; it names the topic ~/standing/NAME)")
        if name in out:
            raise InputError(f"standing_questions: {name!r} is named twice")
        out[name] = question
    return out


def check_window(settings: ServerSettings, temporal) -> None:
    """The frame store must hold what a query over temporal.max_frames sets needs (frame_store.py):
    its window reaches back max_frames x stride_s, and the stride is long enough that two steps of
    max_skew_s never share a frame. InputError naming both settings when they cannot agree."""

    need = temporal.max_frames * temporal.stride_s
    if temporal.max_frames > 1 and settings.frame_window_s < need:
        raise InputError(f"frame_window_s {settings.frame_window_s:g} cannot hold temporal.max_frames "
                         f"{temporal.max_frames} frame sets temporal.stride_s {temporal.stride_s:g} s apart: it needs "
                         f"at least {need:g} s (raise frame_window_s or lower temporal.max_frames / temporal.stride_s)")
    if temporal.max_frames > 1 and temporal.stride_s * (1 - PAST_TOLERANCE) <= settings.max_skew_s:
        raise InputError(f"temporal.stride_s {temporal.stride_s:g} s is too short for max_skew_s "
                         f"{settings.max_skew_s:g} s: a past frame set is matched within {PAST_TOLERANCE:g} of the "
                         f"stride, and two steps must not share a frame (stride_s above max_skew_s / "
                         f"{1 - PAST_TOLERANCE:g})")
    if settings.standing_frames > temporal.max_frames:
        raise InputError(f"standing_frames {settings.standing_frames} is above temporal.max_frames "
                         f"{temporal.max_frames}")
