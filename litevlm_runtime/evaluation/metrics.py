"""DriveLM-challenge scoring as a pure function of (questions, predictions).

What the challenge's evaluation.py (OpenDriveLab/DriveLM, challenge/) computes, re-implemented:
- each question carries tags naming its metrics: 0 accuracy, 1 GPT judge, 2 language, 3 match;
- accuracy: exact string match of prediction and reference (choice letters, "Yes."/"No.");
- language: BLEU-1..4, ROUGE-L and CIDEr from pycocoevalcap on PTB-tokenized text, corpus level
  over the tag-2 questions, combined as sum(Bleu_i)/12 + ROUGE_L/3 + CIDEr/30;
- match: object coordinates in the prediction matched greedily (each prediction point in turn
  takes the nearest unmatched reference point, by L1 distance, if it is under 16 px) and scored
  by F1 per question, averaged; with a judge the challenge averages this (x100) with the judge's
  score of the same answers;
- final = 0.4 * GPT + 0.2 * language + 0.2 * match + 0.2 * accuracy (GPT and match in 0..1).
Without a judge the GPT term is reported unavailable, and the final score is given without it
(max 0.6) and renormalized by the weight it had (/0.6).

Two deliberate, documented differences: coordinates are read from object tags
`<cN,CAM_X,x,y>` rather than from every "d.d" number in the text (a speed "12.5 m/s" in an answer
is not a coordinate), and the challenge's per-frame "graph" filter (later questions about objects
the model failed to find in the frame's first answer are skipped) is an option, off by default,
so that two pipelines are always scored on the same questions.
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import dataclass, field
from typing import Protocol

ACCURACY, GPT, LANGUAGE, MATCH = 0, 1, 2, 3
WEIGHTS = {"gpt": 0.4, "language": 0.2, "match": 0.2, "accuracy": 0.2}
MATCH_THRESHOLD_PX = 16.0
OBJECT_TAG = re.compile(r"<c\d+\s*,\s*(CAM_[A-Z_]+)\s*,\s*(-?\d+(?:\.\d+)?)\s*,\s*(-?\d+(?:\.\d+)?)\s*>")
CHOICE_ANSWER = re.compile(r"^[A-D]\.?$")
YES_NO = {"Yes.", "No.", "Yes", "No"}


class Judge(Protocol):
    """The challenge's GPT scorer, pluggable: a 0..100 score of a prediction against a reference."""

    name: str

    def score(self, question: str, prediction: str, reference: str) -> float: ...


@dataclass(frozen=True)
class Question:
    id: str                       # scene_frame_i, as the challenge's output.json ids
    frame: str                    # frame token (the graph filter works per frame)
    question: str
    answer: str                   # reference
    tags: tuple[int, ...]
    category: str = ""


def derive_tags(question: str, answer: str) -> tuple[int, ...]:
    """Metric tags for a question that has none (DriveLM v1.1 training files carry none; the
    challenge's test file does): choice and yes/no questions are scored by accuracy, everything
    else by the judge and the language metrics, plus match when the reference names objects."""
    a = answer.strip()
    if (CHOICE_ANSWER.match(a) and "options" in question) or a in YES_NO:
        return (ACCURACY,)
    return (GPT, LANGUAGE, MATCH) if OBJECT_TAG.search(a) else (GPT, LANGUAGE)


def points(text: str) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for _, x, y in OBJECT_TAG.findall(text)]


def match_f1(prediction: str, reference: str, threshold: float = MATCH_THRESHOLD_PX) -> tuple[float, list]:
    """(F1, matched reference points): greedy, in the prediction's order, L1 distance < threshold."""
    remaining = points(reference)
    n_ref = len(remaining)
    tp = fp = 0
    matched = []
    for px, py in points(prediction):
        if remaining:
            dists = [abs(px - gx) + abs(py - gy) for gx, gy in remaining]
            best = min(range(len(dists)), key=dists.__getitem__)
            if dists[best] < threshold:
                tp += 1
                matched.append(remaining.pop(best))
                continue
        fp += 1
    fn = n_ref - tp
    precision = tp / (tp + fp + 1e-8)
    recall = tp / (tp + fn + 1e-8)
    return 2 * precision * recall / (precision + recall + 1e-8), matched


def language_metrics(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus-level BLEU-1..4, ROUGE-L, CIDEr exactly as coco-caption computes them."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    gts = {i: [{"caption": r}] for i, r in enumerate(references)}
    res = {i: [{"caption": p}] for i, p in enumerate(predictions)}
    tokenizer = PTBTokenizer()
    with contextlib.redirect_stdout(io.StringIO()):     # the scorers print their internals
        gts, res = tokenizer.tokenize(gts), tokenizer.tokenize(res)
        bleu, _ = Bleu(4).compute_score(gts, res)
        rouge, _ = Rouge().compute_score(gts, res)
        cider, _ = Cider().compute_score(gts, res)
    out = {f"Bleu_{n + 1}": float(b) for n, b in enumerate(bleu)}
    out["ROUGE_L"] = float(rouge)
    out["CIDEr"] = float(cider)
    return out


def combine_language(m: dict[str, float]) -> float:
    return sum(m[f"Bleu_{n}"] for n in range(1, 5)) / 12.0 + m["ROUGE_L"] / 3.0 + m["CIDEr"] / 30.0


@dataclass
class Scores:
    counts: dict = field(default_factory=dict)
    accuracy: float | None = None
    language: dict | None = None          # the six metrics + "score"
    match: dict | None = None             # f1, judge (0..100 or None), score (0..1)
    gpt: dict = field(default_factory=dict)
    final: dict = field(default_factory=dict)
    per_category: dict = field(default_factory=dict)
    skipped_by_graph: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def score(questions: list[Question], predictions: dict[str, str], judge: Judge | None = None,
          match_threshold: float = MATCH_THRESHOLD_PX, graph_filter: bool = False) -> Scores:
    """Score predictions {question id: text} against the questions' references."""
    missing = [q.id for q in questions if q.id not in predictions]
    if missing:
        raise KeyError(f"{len(missing)} question(s) have no prediction, e.g. {missing[0]}")
    acc, lang, match, judged = [], [], [], []
    graph: dict[str, list] = {}
    skipped = 0
    seen_frames = set()
    for q in questions:
        pred = predictions[q.id]
        if graph_filter:
            if q.frame not in seen_frames:           # the frame's first question sets its graph
                seen_frames.add(q.frame)
                graph[q.frame] = match_f1(pred, q.answer, match_threshold)[1]
            elif any(p not in graph[q.frame] for p in points(q.question)):
                skipped += 1
                continue
        if ACCURACY in q.tags:
            acc.append((q, pred))
        if GPT in q.tags:
            judged.append((q, pred))
        if LANGUAGE in q.tags:
            lang.append((q, pred))
        if MATCH in q.tags:
            match.append((q, pred))

    s = Scores(skipped_by_graph=skipped)
    s.counts = {"questions": len(questions), "accuracy": len(acc), "language": len(lang), "match": len(match),
                "gpt": len(judged)}
    if acc:
        s.accuracy = sum(p.strip() == q.answer.strip() for q, p in acc) / len(acc)
    if lang:
        m = language_metrics([p for _, p in lang], [q.answer for q, _ in lang])
        s.language = m | {"score": combine_language(m)}
    if judge is not None and judged:
        s.gpt = {"available": True, "judge": judge.name,
                 "score": sum(judge.score(q.question, p, q.answer) for q, p in judged) / len(judged) / 100.0}
    else:
        s.gpt = {"available": False, "judge": judge.name if judge else None, "score": None,
                 "note": "no judge configured" if judge is None else "no judge-scored questions"}
    if match:
        f1 = sum(match_f1(p, q.answer, match_threshold)[0] for q, p in match) / len(match)
        judge_match = None
        if judge is not None:
            judge_match = sum(judge.score(q.question, p, q.answer) for q, p in match) / len(match)
        value = f1 if judge_match is None else (f1 * 100.0 + judge_match) / 2.0 / 100.0
        s.match = {"f1": f1, "judge": judge_match, "score": value}

    parts = {"language": s.language["score"] if s.language else None,
             "match": s.match["score"] if s.match else None,
             "accuracy": s.accuracy}
    present = {k: v for k, v in parts.items() if v is not None}
    without = sum(WEIGHTS[k] * v for k, v in present.items())
    weight = sum(WEIGHTS[k] for k in present)
    s.final = {
        "with_gpt": (without + WEIGHTS["gpt"] * s.gpt["score"]) if s.gpt["available"] and len(present) == 3 else None,
        "without_gpt": without,
        "renormalized": without / weight if weight else None,
        "terms_used": sorted(present),
        "terms_missing": sorted(set(parts) - set(present)) + ([] if s.gpt["available"] else ["gpt"]),
    }
    for category in sorted({q.category for q in questions}):
        items = [(q, predictions[q.id]) for q in questions if q.category == category and ACCURACY in q.tags]
        s.per_category[category] = {
            "questions": sum(q.category == category for q in questions),
            "accuracy_questions": len(items),
            "accuracy": (sum(p.strip() == q.answer.strip() for q, p in items) / len(items)) if items else None,
        }
    return s
