"""An answer and its explanation from a Pipeline, for the tools that ask for both (scripts, the docs'
pictures): the query is answered exactly as `Pipeline.answer` answers it, with its request's
`explain` flag set, so that the answer carries its trace (taken right after its prefill)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import InputError
from ..evaluation.data import frame_images, load_frames
from ..pipeline.answer import Answer
from ..pipeline.explanation import Explanation, explain
from ..pipeline.pipeline import Pipeline
from ..pipeline.request import QueryRequest


def answer_and_explain(pipe: Pipeline, images: dict, question: QueryRequest | str, layers=None,
                       **kwargs) -> tuple[Answer, Explanation]:
    """(the Answer, its Explanation); `kwargs` go to Pipeline.answer, `layers` to explain."""
    answer = pipe.answer(images, replace(QueryRequest.of(question), explain=True), **kwargs)
    if answer.trace is None:
        raise InputError("explanation: a conversation's answer (history or follow_up_of) is not explained yet")
    return answer, explain(pipe.rt, answer.trace, layers)


@dataclass(frozen=True)
class SampleQuestion:
    """A DriveLM question with its key frame's six images (paths) and its reference answer."""

    id: str
    question: str
    reference: str
    images: dict[str, Path]


def drivelm_questions(qa_file: str | Path, frames_root: str | Path,
                      ids: list[str] | None = None) -> list[SampleQuestion]:
    """Every question of a DriveLM QA file (or those of `ids`, in that order) with its images."""
    out = {}
    for frame in load_frames(qa_file):
        images = frame_images(frames_root, frame)
        for q in frame.questions:
            out[q.id] = SampleQuestion(q.id, q.question, q.answer, images)
    unknown = [i for i in ids or () if i not in out]
    if unknown:
        raise InputError(f"{qa_file}: no question {unknown[0]!r}")
    return list(out.values()) if ids is None else [out[i] for i in ids]
