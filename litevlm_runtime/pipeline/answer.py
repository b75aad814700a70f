"""The result of one query: what the pipeline says and what it cost, stage by stage.

Its fields are the one list every form of an answer is derived from: the query server's record
adds the serving envelope to them (serving/record.py: `AnswerRecord(Answer)`), and the record's
JSON, the ROS `Answer` message (ros/messages.py), `bag record`'s rows and the fleet's Parquet
columns are all made from the record's fields (tests/serving/test_answer_fields.py fails when one of
them, or litevlm_msgs/msg/Answer.msg, lacks a field the others have). The JSON form is
`to_dict()`: what `litevlm ask --json` prints, and what the record's JSON is made of.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass

from ..cameras import CAMERAS
from ..objects import ObjectRef, parse_objects

# The stages of one query, in execution order. Every Answer reports all of them.
STAGES = ("view_select", "preprocess", "vision", "token_select", "prefill", "decode")
# Field names that differ on the wire (JSON, ROS message, Parquet) from the dataclass's.
WIRE_NAMES = {"text": "answer"}
# What every form of an answer carries beside its fields, computed from them (the properties of
# the same names): name -> type.
TOTALS = {"total_ms": float, "budget_met": bool}


@dataclass
class Answer:
    question: str = ""
    text: str = ""                      # the answer (JSON and the ROS message call it `answer`)
    token_ids: list[int] = field(default_factory=list)
    stage_ms: dict[str, float] = field(default_factory=dict)   # stage name -> milliseconds, in STAGES order
    cameras: list[str] = field(default_factory=list)           # cameras the view selector kept, rig order
    visual_tokens: int = 0              # visual tokens produced by the vision encoder
    kept_tokens: int = 0                # visual tokens left after token selection
    input_tokens: int = 0               # prompt length fed to prefill (text + kept visual)
    decode_steps: int = 0               # decoder forward passes after prefill
    accepted_length: float = 1.0        # mean tokens accepted per decode step (EAGLE-2; 1 for greedy)
    pipeline: str = ""                  # which pipeline served: "baseline" or "litevlm[views,tokens@0.8,eagle]"
    reused_cameras: list[str] = field(default_factory=list)   # visual features from an earlier query's frames
    degraded: list[str] = field(default_factory=list)         # what a latency budget cut ("views 3->1", ...)
    budget_ms: float = 0.0              # the latency budget planned for (0: none)
    turn: int = 1  # its turn in a conversation (1: a first question; follow-ups 2, 3, ...)
    reused_tokens: int = 0  # prompt rows whose KV came from the turn it follows (prefill ran input_tokens after them)
    prompt_sha256: str = ""  # of its prompt's ids (stages/prompt.py prompt_digest; `litevlm prompt` prints it)
    batched_steps: int = 0              # decode steps taken together with other queries (in-flight batching)
    # The object tags of the answer and of the question as data (objects.py; every answer, a regex's
    # microseconds), and tag-like text of either that names no object, with why ("answer '<c1,CAM_BAK,1,2>':
    # unknown camera CAM_BAK ..."): a planner or a display reads objects without parsing text.
    objects: list[ObjectRef] = field(default_factory=list)            # the answer's, in text order
    question_objects: list[ObjectRef] = field(default_factory=list)   # the question's, in text order
    malformed_tags: list[str] = field(default_factory=list)
    # Frame sets over time (issue 45): the frame sets per camera it was answered from (1: the newest
    # only), the (camera, frame) views the vision stage encoded and those the feature cache held, and
    # the visual tokens kept per frame set, oldest first.
    frames: int = 1
    encoded_views: int = 0
    reused_views: int = 0
    kept_per_frame: list[int] = field(default_factory=list)
    # Diagnostics of this process only (EAGLE-2's rounds): in no record, message or row.
    extra: dict = field(default_factory=dict, metadata={"wire": False})
    # What its explanation reads (pipeline/explanation.py QueryTrace), taken only when the request asked
    # for one (QueryRequest.explain); None otherwise. In no record, message or row.
    trace: object = field(default=None, repr=False, compare=False, metadata={"wire": False})

    @property
    def budget_met(self) -> bool:
        return not self.budget_ms or self.total_ms <= self.budget_ms

    @property
    def total_ms(self) -> float:
        return float(sum(self.stage_ms.values()))

    def to_dict(self) -> dict:
        """The JSON form: every wire field (all but those marked wire=False: this process's
        diagnostics and the trace) under its wire name, then TOTALS."""
        out = {wire_name(f.name): plain(getattr(self, f.name)) for f in fields(self) if f.metadata.get("wire", True)}
        out.update({name: kind(getattr(self, name)) for name, kind in TOTALS.items()})
        return out


def wire_name(name: str) -> str:
    return WIRE_NAMES.get(name, name)


def plain(value):
    """A field's value as plain JSON (copies of lists and dicts; ints and floats as Python's; a
    dataclass such as an ObjectRef as the dict of its fields)."""
    if is_dataclass(value):
        return plain(asdict(value))
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def object_fields(question: str, text: str, cameras=CAMERAS) -> dict:
    """The Answer's object fields for a question and its answer's text (objects.parse_objects on
    each): `objects`, `question_objects`, and `malformed_tags` naming where each was and why."""
    asked, answered = parse_objects(question, cameras), parse_objects(text, cameras)
    return {"objects": list(answered.objects), "question_objects": list(asked.objects),
            "malformed_tags": [f"{where} {m.text!r}: {m.reason}" for where, parsed in (("question", asked),
                                                                                       ("answer", answered))
                               for m in parsed.malformed]}
