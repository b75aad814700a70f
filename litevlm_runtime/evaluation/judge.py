"""The challenge's GPT score is a pluggable judge: any object with `name` and
`score(question, prediction, reference) -> float in 0..100` (metrics.Judge). None ships here
(no model API is reachable from these machines); `--judge module:attr` loads one, where attr is
a Judge instance, or a class or factory called with no arguments that returns one."""

from __future__ import annotations

import importlib

from ..errors import InputError


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
