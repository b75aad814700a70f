"""What the query server publishes for every query: one AnswerRecord (the pipeline's Answer and the
serving envelope: id, status, queue time, frames), and PartialRecords while an answer streams.

The record's fields are the one list the other forms are derived from, field by field:
  to_json()             the JSON mirror topic, `bag eval`'s JSON lines: Answer.to_dict() of the
                        record's fields (wire names: Answer.text is "answer"), plus the envelope's DERIVED
  ros/messages.py       litevlm_msgs/Answer, and back (bag record's rows)
  fleet/dataset.py      the Parquet columns of a fleet run
A field is added to Answer (pipeline/answer.py) or here, and to Answer.msg; tests/serving/test_answer_fields.py
fails when any form lacks one.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field, fields, replace

from ..pipeline.answer import TOTALS, Answer, wire_name

# Status names and codes; the codes are the STATUS_* constants of litevlm_msgs/Answer.
STATUS_CODES = {
    "ok": 0,
    "no_frames": 1,
    "stale_frames": 2,
    "out_of_sync": 3,
    "bad_image": 4,
    "bad_question": 5,
    "queue_full": 6,
    "deadline_passed": 7,
    "pipeline_error": 8,
    "not_active": 9,
    "shutting_down": 10,
    "bad_stamp": 11,
    "duplicate_id": 12,
    "bad_follow_up": 13,
    "too_old": 14,
}
STATUS_NAMES = {code: name for name, code in STATUS_CODES.items()}
# What the JSON form adds, computed from the fields (the Answer's TOTALS and the envelope's): name -> type.
DERIVED = {**TOTALS, "status_code": int, "frame_offsets_ms": dict[str, float], "frame_set_offsets_ms": list[float]}


@dataclass
class PartialRecord:
    """The answer so far (litevlm_msgs/AnswerPartial): after the first token, after every decode
    pass, and a last one with final=True and the Answer's text just before the Answer."""
    query_id: str
    text: str
    token_count: int
    final: bool = False


@dataclass
class AnswerRecord(Answer):
    """The Answer's fields (defaults where no answer was computed: an error record) and the
    serving envelope."""
    query_id: str = ""
    status: str = "ok"
    status_message: str = ""
    queue_ms: float = 0.0               # time spent waiting in the request queue
    follow_up_of: str = ""              # the query it continues ("" for a first question)
    query_stamp_ns: int = 0             # when the question was asked (its header stamp, or its arrival)
    frame_stamps_ns: dict[str, int] = field(default_factory=dict)   # camera -> stamp of the frame it used
    # Each frame set's stamp (its newest camera's), oldest first, of the `frames` sets the answer was
    # computed from (the last: frame_stamps_ns's set); empty when no set was matched.
    frame_set_stamps_ns: list[int] = field(default_factory=list)
    # The served model folder's file integrity (weights/integrity.py integrity_label): "verified (manifest)", or
    # "unverified (...)": weights no manifest vouches for (require_manifest off) are said in every answer.
    model_integrity: str = ""
    # Where the pipeline's wall time went (diagnostics; not in the ROS message): CPU time of the
    # serving thread (torch's intra-op threads beyond it are not counted), and garbage
    # collection. Wall minus CPU is time the thread was not running: other processes or threads.
    cpu_ms: float = field(default=0.0, metadata={"message": False})
    gc_ms: float = field(default=0.0, metadata={"message": False})
    # An error record answered nothing: no turn, no accepted tokens.
    turn: int = 0
    accepted_length: float = 0.0

    def answered(self, answer: Answer) -> "AnswerRecord":
        """This record (its envelope) with every field of the pipeline's Answer."""
        return replace(self, **{f.name: getattr(answer, f.name) for f in fields(Answer)})

    @property
    def status_code(self) -> int:
        return STATUS_CODES[self.status]

    def to_json(self) -> dict:
        """The JSON mirror / JSON-lines form: the Answer's JSON form of every record field, then the
        envelope's derived fields. Frame stamps are also given relative to the query stamp, which
        survives the replayer's re-stamping (bag eval and a DDS replay agree)."""
        out = self.to_dict()
        out.update(status_code=self.status_code,
                   frame_offsets_ms={c: (s - self.query_stamp_ns) / 1e6 for c, s in self.frame_stamps_ns.items()},
                   frame_set_offsets_ms=[(s - self.query_stamp_ns) / 1e6 for s in self.frame_set_stamps_ns])
        return out


def wire_fields() -> list:
    """The record's fields that every form carries (dataclass Fields, declaration order)."""
    return [f for f in fields(AnswerRecord) if f.metadata.get("wire", True)]


def field_types() -> dict[str, object]:
    """Each wire field's type (the resolved annotation: str, int, list[int], dict[str, float] ...)."""
    hints = typing.get_type_hints(AnswerRecord)
    return {f.name: hints[f.name] for f in wire_fields()}


def json_types() -> dict[str, object]:
    """Every key of the JSON form and its type: the wire fields under their wire names, then DERIVED."""
    return {wire_name(name): kind for name, kind in field_types().items()} | DERIVED
