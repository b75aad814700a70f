"""Accuracy per question template: where a model's closed-form accuracy comes from.

The overall accuracy mixes questions a model can answer from the text alone with questions it
must look at the images for. Grouping by template (the question with its object tags, camera
directions, object kinds, colours and choice options abstracted away) and setting two runs side
by side (images vs blanked images, baseline vs LiteVLM pipeline) shows which.
"""

from __future__ import annotations

import re

from .metrics import ACCURACY, Question

_OPTIONS = re.compile(r"\s*Please select the correct answer from the following options:.*$", re.S)
_TAG = re.compile(r"<c\d+\s*,\s*CAM_[A-Z_]+\s*,\s*-?[\d.]+\s*,\s*-?[\d.]+\s*>")
_DIRECTION = re.compile(r"\b(front left|front right|back left|back right|front|back)\b")
_KIND = re.compile(r"(?<!ego )\b(cars?|trucks?|bus(?:es)?|pedestrians?|barriers?|traffic lights?)\b")
_COLOUR = re.compile(r"\b(red|blue|green|yellow|white|black|orange)\b")
_STATUS = re.compile(r"\b(moving|stopped|parked|standing)\b(?! direction| status)")
_SIDE = re.compile(r"\b(left|right)\b")


def question_template(question: str) -> str:
    """'What colour is the car to the front left of the ego car? Please select ... A. Red.' ->
    'What colour is the OBJ to the DIR of the ego car? (choice)'."""
    choice = bool(_OPTIONS.search(question))
    text = _OPTIONS.sub("", question.strip())
    text = _TAG.sub("<obj>", text)
    text = _DIRECTION.sub("DIR", text)
    text = _KIND.sub("OBJ", text)
    text = _COLOUR.sub("COLOUR", text)
    text = _STATUS.sub("STATE", text)
    text = _SIDE.sub("SIDE", text)
    return text + (" (choice)" if choice else "")


def accuracy_by_template(questions: list[Question], runs: dict[str, dict[str, str]]) -> list[dict]:
    """Closed-form questions grouped by template, most frequent first: {template, questions, and
    per run name its exact-match accuracy}. runs: name -> {question id: predicted answer}."""
    groups: dict[str, list[Question]] = {}
    for q in questions:
        if ACCURACY in q.tags:
            groups.setdefault(question_template(q.question), []).append(q)
    rows = []
    for template, qs in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        row = {"template": template, "questions": len(qs)}
        for name, predictions in runs.items():
            row[name] = sum(predictions.get(q.id, "").strip() == q.answer.strip() for q in qs) / len(qs)
        rows.append(row)
    return rows
