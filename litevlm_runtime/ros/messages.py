"""Outgoing messages: an AnswerRecord as litevlm_msgs/Answer and back (what `bag record` reads),
field by field from the record's one field list (serving/record.py), and partial answers.

A record field travels in the message field of the same wire name, converted to that field's
type, unless SHAPED says otherwise; TOTALS are message fields computed from the others. A field
whose items are a dataclass of NESTED (Answer.objects: ObjectRef) travels as that nested message
of litevlm_msgs, field by field under the same names.
tests/serving/test_answer_fields.py checks that this covers Answer.msg exactly.
"""

from __future__ import annotations

import typing
from dataclasses import fields

from builtin_interfaces.msg import Time
from litevlm_msgs.msg import Answer, AnswerPartial
from litevlm_msgs.msg import ObjectRef as ObjectRefMsg

from ..objects import ObjectRef
from ..pipeline.answer import TOTALS
from ..serving.record import (
    STATUS_CODES,
    STATUS_NAMES,
    AnswerRecord,
    PartialRecord,
    field_types,
    wire_fields,
    wire_name,
)
from .convert import ns_of


def time_of(ns: int) -> Time:
    return Time(sec=int(ns // 1_000_000_000), nanosec=int(ns % 1_000_000_000))


# Record fields whose message fields have another shape: (message fields, to them, from a message).
SHAPED = {
    "status": (("status",), lambda v: (STATUS_CODES[v],),
               lambda m: STATUS_NAMES.get(m.status, f"code{m.status}")),
    "stage_ms": (("stage_names", "stage_ms"), lambda d: (list(d), [float(x) for x in d.values()]),
                 lambda m: dict(zip(m.stage_names, (float(x) for x in m.stage_ms)))),
    "frame_stamps_ns": (("frame_cameras", "frame_stamps"), lambda d: (list(d), [time_of(s) for s in d.values()]),
                        lambda m: {c: ns_of(s) for c, s in zip(m.frame_cameras, m.frame_stamps)}),
    "frame_set_stamps_ns": (("frame_set_stamps",), lambda v: ([time_of(s) for s in v],),
                            lambda m: [ns_of(s) for s in m.frame_set_stamps]),
    # the query's stamp: receipt - header.stamp = end-to-end latency
    "query_stamp_ns": (("header",), None, lambda m: ns_of(m.header.stamp)),
}
# Record item types carried as a nested message of litevlm_msgs with the same field names.
NESTED = {ObjectRef: ObjectRefMsg}


def in_message(f) -> bool:
    return f.metadata.get("message", True)


def coerce(value, kind):
    """A record value as the message field of type `kind` takes it (rclpy checks int vs float), or
    a message's value as the record's type `kind`: a NESTED dataclass to its message and back, field
    by field (a message of rclpy's or of rosbags' from a bag)."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind)
        return [coerce(v, item) for v in value]
    if kind in NESTED:
        hints = typing.get_type_hints(kind)
        values = {f.name: coerce(getattr(value, f.name), hints[f.name]) for f in fields(kind)}
        return NESTED[kind](**values) if isinstance(value, kind) else kind(**values)
    return kind(value)


def record_to_msg(rec: AnswerRecord) -> Answer:
    msg = Answer()
    types = field_types()
    for f in wire_fields():
        if not in_message(f):
            continue
        value = getattr(rec, f.name)
        if f.name == "query_stamp_ns":
            msg.header.stamp = time_of(value)
        elif f.name in SHAPED:
            names, to_message, _ = SHAPED[f.name]
            for name, v in zip(names, to_message(value)):
                setattr(msg, name, v)
        else:
            setattr(msg, wire_name(f.name), coerce(value, types[f.name]))
    for name, kind in TOTALS.items():
        setattr(msg, name, kind(getattr(rec, name)))
    return msg


def record_from_msg(msg) -> AnswerRecord:
    """The record an Answer message carries (a field a message of an older bag lacks: its default)."""
    values, types = {}, field_types()
    for f in wire_fields():
        if not in_message(f):
            continue
        if f.name in SHAPED:
            names, _, from_message = SHAPED[f.name]
            if all(hasattr(msg, n) for n in names):
                values[f.name] = from_message(msg)
        elif hasattr(msg, wire_name(f.name)):
            values[f.name] = coerce(getattr(msg, wire_name(f.name)), types[f.name])
    return AnswerRecord(**values)


def message_fields() -> set[str]:
    """The Answer message fields the record's fields fill (with TOTALS): what Answer.msg must declare."""
    out = set(TOTALS)
    for f in wire_fields():
        if in_message(f):
            out.update(SHAPED[f.name][0] if f.name in SHAPED else (wire_name(f.name),))
    return out


def partial_to_msg(partial: PartialRecord, stamp) -> AnswerPartial:
    msg = AnswerPartial(query_id=partial.query_id, text=partial.text, token_count=partial.token_count,
                        final=partial.final)
    msg.header.stamp = stamp
    return msg
