"""The answer's objects as data in every form a user reads (issue 33): the record's fields, its JSON,
the ROS Answer message (serialized to CDR and read back by rclpy, and by rosbags as the bag tools
read it) and the fleet's Parquet row, on every question and answer of the DriveLM sample: every tag
found, none invented, malformed tags ignored and named."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import asdict, is_dataclass

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_objects import _drivelm_texts

from litevlm_runtime.fleet.dataset import SCHEMA, record_json, row_from_record
from litevlm_runtime.fleet.sources import BagRef
from litevlm_runtime.pipeline.answer import object_fields
from litevlm_runtime.serving.record import AnswerRecord

# Appended to every third answer: tag-like text that names no object (an unknown camera; three fields).
MALFORMED = " Also <c7,CAM_BAK,12.0,3.0> and <c8,CAM_FRONT,12.0>."
TAGS_IN_SAMPLE = 246            # the sample as shipped (tests/base/test_objects.py counts them the same way)


def _pairs(drivelm_dir):
    """(question, answer) of every QA item of the sample (test_objects.py reads them in that order)."""
    texts = iter(text for _, text in _drivelm_texts(drivelm_dir))
    return zip(texts, texts)


def _by_hand(text: str) -> list[tuple]:
    """Every tag of a DriveLM text with str methods only (DriveLM writes '<' nowhere but in a tag):
    (object_id, camera, x, y, tag) in text order."""
    out = []
    for piece in text.split("<")[1:]:
        tag = "<" + piece[:piece.index(">") + 1]
        object_id, camera, x, y = tag[1:-1].split(",")
        out.append((object_id, camera, float(x), float(y), tag))
    return out


def _dicts(objects) -> list[dict]:
    return [asdict(o) if is_dataclass(o) else dict(o) for o in objects]


def _records(drivelm_dir) -> tuple[list[AnswerRecord], list[str]]:
    """An answered record per QA item of the sample (the reference answer as its text, every third
    with MALFORMED appended), and each one's answer as DriveLM wrote it."""
    records, written = [], []
    for i, (question, answer) in enumerate(_pairs(drivelm_dir)):
        text = answer + (MALFORMED if i % 3 == 0 else "")
        records.append(AnswerRecord(query_id=f"q{i}", question=question, text=text, turn=1,
                                    **object_fields(question, text)))
        written.append(answer)
    return records, written


def _forms(records: list[AnswerRecord], tmp_path) -> dict[str, list[tuple]]:
    """Form name -> per record (question_objects, objects, malformed_tags) as that form gives them back."""
    def triple(r):
        return (r["question_objects"], r["objects"], r["malformed_tags"]) if isinstance(r, dict) else \
            (r.question_objects, r.objects, r.malformed_tags)

    forms = {"record": [triple(r) for r in records]}
    rows = [json.loads(json.dumps(r.to_json())) for r in records]
    forms["json"] = [triple(r) for r in rows]
    table = pa.Table.from_pylist([row_from_record(r, BagRef(path="b", key="b"), i, None, WORKER, 1)
                                  for i, r in enumerate(rows)], schema=SCHEMA)
    pq.write_table(table, tmp_path / "part-0.parquet")
    forms["parquet"] = [triple(record_json(r)) for r in pq.read_table(tmp_path / "part-0.parquet").to_pylist()]
    try:
        from litevlm_msgs.msg import Answer
    except ImportError:
        return forms                      # (no ROS here: the message forms are checked where it is)
    from rclpy.serialization import deserialize_message, serialize_message

    from litevlm_runtime.bag.io import typestore
    from litevlm_runtime.ros.messages import record_from_msg, record_to_msg

    cdr = [serialize_message(record_to_msg(r)) for r in records]
    forms["message"] = [triple(record_from_msg(deserialize_message(b, Answer))) for b in cdr]
    store = typestore()                   # what bag record's bags and the bag tools read with
    forms["rosbags"] = [triple(record_from_msg(store.deserialize_cdr(b, "litevlm_msgs/msg/Answer"))) for b in cdr]
    return forms


WORKER = {"host": "h", "pid": 1, "model_sha256": "m", "project_version": "v", "project_commit": "c"}


def test_drivelm_objects_in_every_form(drivelm_dir, tmp_path):
    records, written = _records(drivelm_dir)
    forms = _forms(records, tmp_path)
    assert {"record", "json", "parquet"} <= set(forms)
    assert {"message", "rosbags"} <= set(forms) or importlib.util.find_spec("litevlm_msgs") is None
    for name, form in forms.items():
        found = named_malformed = 0
        for i, (rec, answer, (asked, answered, malformed)) in enumerate(zip(records, written, form)):
            # Every tag found and none invented: exactly the tags written by hand, fields and order.
            for objects, text in ((asked, rec.question), (answered, answer)):
                got = _dicts(objects)
                assert [(o["object_id"], o["camera"], o["x"], o["y"], o["tag"]) for o in got] == _by_hand(text), \
                    (name, text)
                assert all(text[o["start"]:o["end"]] == o["tag"] and o["tag"] in o["phrase"] for o in got), name
                found += len(got)
            # The same objects in every form, phrase and span included.
            assert _dicts(answered) == _dicts(records[i].objects) and _dicts(asked) == _dicts(
                records[i].question_objects
            )
            # Malformed tags are ignored (no object above comes from them) and named, with where and why.
            if i % 3 == 0:
                assert len(malformed) == 2, (name, malformed)
                assert malformed[0].startswith("answer '<c7,CAM_BAK,12.0,3.0>': unknown camera CAM_BAK")
                assert malformed[1].startswith("answer '<c8,CAM_FRONT,12.0>': 3 fields")
                named_malformed += 2
            else:
                assert list(malformed) == [], (name, malformed)
        assert found == TAGS_IN_SAMPLE and named_malformed == 2 * len(range(0, len(records), 3)), name


def test_a_bag_of_an_older_answer_message_reads_without_objects():
    """An Answer message from before the objects (a message type without those fields, as a bag
    recorded then deserializes) reads back with empty objects, not an error."""
    pytest.importorskip("litevlm_msgs.msg")
    from litevlm_runtime.ros.messages import record_from_msg

    class Old:           # the fields an old Answer has that matter here
        query_id, question, answer, token_ids, status = "q1", "Is <c1,CAM_BACK,1,2> moving?", "No.", [1], 0

    rec = record_from_msg(Old())
    assert (rec.query_id, rec.objects, rec.question_objects, rec.malformed_tags) == ("q1", [], [], [])
