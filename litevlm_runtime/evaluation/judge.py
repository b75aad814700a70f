"""The challenge's GPT score is a pluggable judge: any object with `name` and
`score(question, prediction, reference) -> float in 0..100` (metrics.Judge). None ships here
(no model API is reachable from these machines); `--judge module:attr` loads one, where attr is
a Judge instance, or a class or factory called with no arguments that returns one.

What the challenge's judge is (OpenDriveLab/DriveLM `challenge/gpt_eval.py`): gpt-3.5-turbo at
temperature 0.6 (so not repeatable), asked once per answer with the messages challenge_messages()
builds; it sees the answer and the reference, not the question; its reply is read with float()
(a reply that is not a bare number fails the script; here the judge's score must be a number,
or scoring stops with an error naming the judge and the question). A judge meant to stand in for
it sends those messages to a chat model and returns float(reply)."""

from __future__ import annotations

import importlib

from ..errors import InputError

# gpt_eval.py's texts, verbatim (including its missing spaces): the rating depends on them.
CHALLENGE_SYSTEM = "an evaluator who rates my answer based on the correct answer"
CHALLENGE_PROMPT = ("Rate my answer based on the correct answer out of 100, with higher scores indicating that the "
                    "answer is closer to the correct answer, and you should be accurate to single digits like 62, "
                    "78, 41,etc. Output the number only")


def challenge_messages(prediction: str, reference: str) -> list[dict]:
    """The chat messages the challenge's judge sends for one answer."""
    prompt = CHALLENGE_PROMPT + "This is the correct answer: " + reference + "This is my answer: " + prediction
    return [{"role": "system", "content": CHALLENGE_SYSTEM}, {"role": "user", "content": prompt}]


def load_judge(spec: str):
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InputError(f"--judge {spec!r}: expected module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise InputError(f"--judge {spec!r}: cannot import {module_name} ({exc})") from None
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise InputError(f"--judge {spec!r}: {module_name} has no attribute {attr}") from None
    judge = obj() if callable(obj) and not hasattr(obj, "score") else obj
    if isinstance(judge, type):
        judge = judge()
    if not callable(getattr(judge, "score", None)):
        raise InputError(f"--judge {spec!r}: {attr} has no score(question, prediction, reference) method")
    if not getattr(judge, "name", None):
        judge.name = f"{module_name}:{attr}"
    return judge
