"""Accuracy per question template: where a model's closed-form accuracy comes from.

The overall accuracy mixes questions a model can answer from the text alone with questions it
must look at the images for. Grouping by template (the question with its object tags, camera
directions, object kinds, colours and choice options abstracted away) and setting two runs side
by side (images vs blanked images, baseline vs LiteVLM pipeline) shows which.
"""

from __future__ import annotations

import re

from ..objects import OBJECT_TAG
from .metrics import ACCURACY, CHALLENGE, MATCH_THRESHOLD_PX, Question, Rules, answer_is_correct, graph_filter

_OPTIONS = re.compile(r"\s*Please select the correct answer from the following options:.*$", re.S)
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
    text = OBJECT_TAG.sub("<obj>", text)
    text = _DIRECTION.sub("DIR", text)
    text = _KIND.sub("OBJ", text)
    text = _COLOUR.sub("COLOUR", text)
    text = _STATUS.sub("STATE", text)
    text = _SIDE.sub("SIDE", text)
    return text + (" (choice)" if choice else "")


def accuracy_by_template(questions: list[Question], runs: dict[str, dict[str, str]], rules: Rules = CHALLENGE,
                         match_threshold: float = MATCH_THRESHOLD_PX) -> list[dict]:
    """Closed-form questions grouped by template, most frequent in the file first:
    {template, questions: {run: n}, accuracy: {run: accuracy or None}}, each run over exactly the
    questions its scores count (under the challenge's graph filter that set depends on the run's
    own answers, so the counts may differ). runs: name -> {question id: predicted answer}."""
    templates = {q.id: question_template(q.question) for q in questions if ACCURACY in q.tags}
    in_file: dict[str, int] = {}
    for t in templates.values():
        in_file[t] = in_file.get(t, 0) + 1
    rows = {t: {"template": t, "questions": {}, "accuracy": {}}
            for t in sorted(in_file, key=lambda t: (-in_file[t], t))}
    for name, predictions in runs.items():
        scored, _ = graph_filter(questions, predictions, rules, match_threshold)
        for t, row in rows.items():
            qs = [q for q in scored if templates.get(q.id) == t]
            row["questions"][name] = len(qs)
            row["accuracy"][name] = (sum(answer_is_correct(predictions[q.id], q.answer, rules) for q in qs) / len(qs)
                                     if qs else None)
    return list(rows.values())
