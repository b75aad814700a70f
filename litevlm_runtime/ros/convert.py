"""The Query message and the QueryRequest, field by field, both ways.

    request_from_query(msg)      a litevlm_msgs/Query (rclpy's, or one rosbags read from a bag)
    request_from_question(msg)   a std_msgs/String question
    query_fields(request, ...)   the Query message's fields of a request (bags written by `bag make`)

Every request field the message carries has the message field of the same name, but for the four
in QUERY_NAMES (tests/serving/test_answer_fields.py checks Query.msg against this). The node and `bag eval`
both read queries here, so that the two tools build the same request from the same message; a
bag recorded before Query had a field carries its old type: the field's default. No rclpy import
here: `bag eval` runs without it (outgoing messages: messages.py).
"""

from __future__ import annotations

import typing
from dataclasses import fields

from ..pipeline.request import QueryRequest

# Request field -> the Query message field that carries it, where the names differ.
QUERY_NAMES = {"question": "text", "query_id": "id", "stamp_ns": "header", "deadline_ns": "deadline"}


def ns_of(t) -> int:
    """Nanoseconds of a builtin_interfaces/Time (rclpy's or rosbags')."""
    return int(t.sec) * 1_000_000_000 + int(t.nanosec)


def carried():
    """The request's fields a Query message carries (dataclass Fields)."""
    return [f for f in fields(QueryRequest) if f.metadata.get("message", True)]


def query_name(name: str) -> str:
    return QUERY_NAMES.get(name, name)


def request_from_query(msg) -> QueryRequest:
    """The request a Query message asks (its header stamp: when the question was asked)."""
    types = typing.get_type_hints(QueryRequest)
    values = {}
    for f in carried():
        if not hasattr(msg, query_name(f.name)):
            continue
        value = getattr(msg, query_name(f.name))
        if f.name == "stamp_ns":
            values[f.name] = ns_of(value.stamp)
        elif f.name == "deadline_ns":
            values[f.name] = ns_of(value)
        elif typing.get_origin(types[f.name]) is tuple:
            values[f.name] = tuple(str(v) for v in value)
        else:
            values[f.name] = types[f.name](value)
    return QueryRequest(**values)


def request_from_question(msg) -> QueryRequest:
    """A std_msgs/String question: its text, stamped when it arrives."""
    return QueryRequest(question=str(msg.data))


def query_fields(request: QueryRequest, time, header) -> dict:
    """The Query message's fields for `request`, as keyword arguments of the message type of any
    library: `time(ns)` makes its builtin_interfaces/Time, `header(time)` its std_msgs/Header."""
    out = {}
    for f in carried():
        value = getattr(request, f.name)
        if f.name == "stamp_ns":
            value = header(time(value))
        elif f.name == "deadline_ns":
            value = time(value)
        elif isinstance(value, tuple):
            value = list(value)
        out[query_name(f.name)] = value
    return out
