"""Constrained answers (constrain.py, xgrammar) on the bundled model: with `choices` the answer is
exactly one of them; with `answer_schema` it parses as JSON and validates, under greedy decoding,
sampling, EAGLE-2 verification (a fixed tree, so that every round speculates) and in a batch
(where it equals the same constrained query answered alone)."""

import json

import pytest
from helpers import options, random_frames

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.decoding.greedy import greedy
from litevlm_runtime.decoding.speculative import eagle2
from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest

TAGS = ["car", "truck", "pedestrian", "traffic light", "bicycle"]
STATUSES = ["moving", "parked", "crossing", "red", "green", "unknown"]
SCHEMA = {
    "type": "object",
    "properties": {"objects": {"type": "array", "maxItems": 3, "items": {
        "type": "object",
        "properties": {"tag": {"enum": TAGS}, "status": {"enum": STATUSES}},
        "required": ["tag", "status"], "additionalProperties": False}}},
    "required": ["objects"], "additionalProperties": False,
}


def valid(doc) -> bool:
    """SCHEMA, checked by hand (independently of the grammar library)."""
    if not isinstance(doc, dict) or set(doc) != {"objects"} or not isinstance(doc["objects"], list):
        return False
    return len(doc["objects"]) <= 3 and all(
        isinstance(o, dict) and set(o) == {"tag", "status"} and o["tag"] in TAGS and o["status"] in STATUSES
        for o in doc["objects"])


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=160, decoding__eagle__policy="fixed"))


@pytest.fixture(scope="module")
def sampling():
    return Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=160, decoding__temperature=1.0,
                                                           decoding__mode="greedy"))


@pytest.fixture(scope="module")
def images():
    return random_frames(4, 270, 480)


@pytest.mark.parametrize("question,choices", [
    ("Is there a pedestrian in front of the ego car?", ["Yes.", "No."]),
    ("Which object is closest? A. car B. truck C. pedestrian D. none", ["A", "B", "C", "D"]),
    ("What should the ego vehicle do next?", ["Keep going straight.", "Stop.", "Turn left."]),
])
def test_choices_give_exactly_one_choice(pipe, images, question, choices):
    for decoder in (greedy, eagle2):
        ans = pipe.answer(images, QueryRequest(question, choices=choices), decoder=decoder)
        assert ans.text in choices, (decoder.__name__, ans.text)
        assert not any("constrained" in d for d in ans.degraded)


@pytest.mark.parametrize("how", ["greedy", "eagle2", "sampling"])
def test_schema_answers_parse_and_validate(pipe, sampling, images, how):
    schema = json.dumps(SCHEMA)
    for q in ("List the objects around the ego car.", "What is in front of the ego vehicle?"):
        if how == "sampling":
            texts = [sampling.answer(images, QueryRequest(q, answer_schema=schema)).text]
        else:
            texts = [
                pipe.answer(
                    images, QueryRequest(q, answer_schema=schema), decoder=greedy if how == "greedy" else eagle2
                ).text
            ]
        for text in texts:
            assert valid(json.loads(text)), text


def test_eagle2_under_a_constraint_gives_the_greedy_answer(pipe, images):
    """Verification masks each tree node under its own path: lossless, as without a constraint."""
    schema = json.dumps(SCHEMA)
    q = "List the objects around the ego car."
    plain = pipe.answer(images, QueryRequest(q, answer_schema=schema), decoder=greedy)
    spec = pipe.answer(images, QueryRequest(q, answer_schema=schema), decoder=eagle2)
    assert spec.token_ids == plain.token_ids and spec.decode_steps < len(spec.token_ids)


def test_constrained_queries_in_a_batch(pipe, images):
    schema = json.dumps(SCHEMA)
    alone = pipe.answer(images, QueryRequest("List the objects.", answer_schema=schema), decoder=greedy).token_ids
    alone_choice = pipe.answer(images, QueryRequest("Is it safe?", choices=["Yes.", "No."]), decoder=greedy).text
    batched = Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=160, serving__max_batch=4))
    batch = BatchDecoder(batched)
    batch.admit(images, QueryRequest("List the objects.", answer_schema=schema), tag="json")
    batch.admit(images, QueryRequest("Is it safe?", choices=["Yes.", "No."]), tag="choice")
    batch.admit(images, "What is in front of the ego vehicle?", tag="free")
    got = {r.tag: a for r, a in batch.run()}
    assert got["json"].token_ids == alone and got["json"].batched_steps
    assert got["choice"].text == alone_choice


def test_bad_constraints_are_input_errors(pipe, images):
    with pytest.raises(InputError, match="answer_schema"):
        pipe.answer(images, QueryRequest("objects?", answer_schema="{not json"))
    with pytest.raises(InputError, match="choices"):
        pipe.answer(images, QueryRequest("objects?", choices=["yes", " "]))
    with pytest.raises(InputError, match="not valid for answer_schema"):
        pipe.answer(
            images, QueryRequest("objects?", choices=['{"objects": []}', "nope"], answer_schema=json.dumps(SCHEMA))
        )
