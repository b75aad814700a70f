"""One field list: the Answer's fields and the record's envelope (serving/record.py) are what the
JSON form, the ROS Answer message, `bag record`'s rows and the fleet's Parquet columns carry, and
the QueryRequest's message fields are what Query.msg declares. Each check fails when a field
exists in one form and not in another."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest

from litevlm_runtime.fleet.dataset import SCHEMA, record_json, row_from_record
from litevlm_runtime.fleet.sources import BagRef
from litevlm_runtime.objects import ObjectRef
from litevlm_runtime.pipeline.answer import STAGES, TOTALS, Answer
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.ros.convert import carried, query_fields, query_name, request_from_query
from litevlm_runtime.serving.record import DERIVED, AnswerRecord, json_types, wire_fields, wire_name

MSG_DIR = Path(__file__).resolve().parents[2] / "ros2_ws" / "src" / "litevlm_msgs" / "msg"


def msg_fields(name: str) -> set[str]:
    """The field names a .msg file declares (constants and comments left out)."""
    out = set()
    for line in (MSG_DIR / f"{name}.msg").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and "=" not in line:
            out.add(line.split()[1])
    return out


def populated() -> AnswerRecord:
    """A record with every field off its default (so that a dropped field shows)."""
    return AnswerRecord(
        question="What is behind?", text="A truck.", token_ids=[5, 6, 7],
        stage_ms={s: float(i + 1) for i, s in enumerate(STAGES)}, cameras=["CAM_BACK"], visual_tokens=64,
        kept_tokens=51, input_tokens=140, decode_steps=3, accepted_length=1.5, pipeline="litevlm[views]",
        reused_cameras=["CAM_BACK"], degraded=["views 3->1"], budget_ms=50.0, turn=2, reused_tokens=90,
        prompt_sha256="ab" * 32, batched_steps=2, frames=3, encoded_views=4, reused_views=2,
        kept_per_frame=[10, 12, 64],
        objects=[ObjectRef("c1", "CAM_BACK", 1088.3, 497.5, "It is <c1,CAM_BACK,1088.3,497.5>.",
                           "<c1,CAM_BACK,1088.3,497.5>", 6, 32)],
        question_objects=[ObjectRef("c2", "CAM_FRONT", 10.0, 20.0, "Is <c2,CAM_FRONT,10,20> moving?",
                                    "<c2,CAM_FRONT,10,20>", 3, 23)],
        malformed_tags=["answer '<c3,CAM_BAK,1,2>': unknown camera CAM_BAK"], query_id="q9", status="queue_full",
        status_message="fine", queue_ms=1.25, follow_up_of="q8", query_stamp_ns=1_700_000_000_123_456_789,
        frame_stamps_ns={"CAM_BACK": 1_700_000_000_100_000_000}, model_integrity="unverified (no manifest)",
        frame_set_stamps_ns=[1_699_999_999_100_000_000, 1_699_999_999_600_000_000, 1_700_000_000_100_000_000],
        cpu_ms=3.5, gc_ms=0.5)


def test_the_record_is_the_answer_plus_its_envelope():
    answer_fields = {f.name for f in fields(Answer) if f.metadata.get("wire", True)}
    assert answer_fields <= {f.name for f in wire_fields()}
    rec = populated()
    defaults = AnswerRecord()
    changed = {f.name for f in wire_fields() if getattr(rec, f.name) != getattr(defaults, f.name)}
    assert changed == {f.name for f in wire_fields()}, "populated() must set every field"


def test_json_has_every_field_under_its_wire_name():
    row = populated().to_json()
    assert set(row) == set(json_types()) == {wire_name(f.name) for f in wire_fields()} | set(DERIVED)
    assert row["answer"] == "A truck." and row["total_ms"] == 21.0 and row["status_code"] == 6


def test_the_answers_json_is_the_records_without_the_envelope():
    """`litevlm ask --json` prints Answer.to_dict(): the same keys, names and values as the record's
    JSON (the mirror topic, bag eval, the fleet) has for the Answer's fields, and the same totals."""
    rec = populated()
    answer = Answer(**{f.name: getattr(rec, f.name) for f in fields(Answer)})
    d = answer.to_dict()
    assert set(d) == {wire_name(f.name) for f in fields(Answer) if f.metadata.get("wire", True)} | set(TOTALS)
    row = rec.to_json()
    assert d == {k: row[k] for k in d}
    assert d["answer"] == "A truck." and d["total_ms"] == 21.0 and d["budget_met"] is True
    assert "extra" not in d and "trace" not in d and d["objects"][0]["camera"] == "CAM_BACK"


def test_the_answer_message_declares_exactly_the_record_fields():
    pytest.importorskip("litevlm_msgs.msg")
    from litevlm_runtime.ros.messages import message_fields

    assert msg_fields("Answer") == message_fields()


def test_record_message_record_round_trip():
    pytest.importorskip("litevlm_msgs.msg")
    from litevlm_runtime.ros.messages import record_from_msg, record_to_msg

    rec = populated()
    back = record_from_msg(record_to_msg(rec))
    local = {f.name for f in wire_fields() if not f.metadata.get("message", True)}    # JSON only
    assert local == {"cpu_ms", "gc_ms"}
    for f in wire_fields():
        if f.name not in local:
            assert getattr(back, f.name) == getattr(rec, f.name), f.name


def test_parquet_columns_are_the_json_form():
    columns = set(SCHEMA.names)
    row = populated().to_json()
    stage_columns = {f"ms_{s}" for s in STAGES}
    assert (set(row) - {"stage_ms"}) | stage_columns <= columns
    dataset_row = row_from_record(row, BagRef(path="b", key="b"), 0, None,
                                  {"host": "h", "pid": 1, "model_sha256": "m", "project_version": "v",
                                   "project_commit": "c"}, 1)
    assert set(dataset_row) == columns
    assert record_json(dataset_row) == row


def test_the_query_message_declares_exactly_the_request_fields():
    declared = {query_name(f.name) for f in carried()}
    assert msg_fields("Query") == declared
    request = QueryRequest("Is it moving?", query_id="q2", stamp_ns=5_000_000_123, deadline_ns=6_000_000_000,
                           budget_ms=80.0, choices=("yes", "no"), answer_schema="", temperature=0.5, seed=3,
                           follow_up_of="q1", priority=7)
    msg = _Msg(**query_fields(request, lambda ns: _Time(ns // 10**9, ns % 10**9), lambda t: _Msg(stamp=t)))
    assert request_from_query(msg) == request


class _Msg:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Time:
    def __init__(self, sec, nanosec):
        self.sec, self.nanosec = sec, nanosec


def test_msg_parser_reads_constants_apart():
    assert "status" in msg_fields("Answer") and "STATUS_OK" not in msg_fields("Answer")
    assert re.match(r"^[a-z_0-9]+$", next(iter(msg_fields("Query"))))
