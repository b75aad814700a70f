"""DriveLM-challenge scoring as a pure function of (questions, predictions).

The default rules (CHALLENGE) are those of the challenge's own script, OpenDriveLab/DriveLM
`challenge/evaluation.py` (language metrics through bckim92/language-evaluation's
`CocoEvaluator`, the GPT score through `challenge/gpt_eval.py`), rule by rule:

1. Questions are taken per scene, per key frame, in the order perception + prediction + planning
   + behavior; the i-th of a frame has the id `scene_frame_i`. Each carries tags naming its
   metrics (several at once are allowed): 0 accuracy, 1 GPT, 2 language, 3 match.
2. Graph filter, per frame: the frame's first question is always scored, and its prediction sets
   the frame's graph, the reference points of that question which the prediction matched (rule 5).
   Each later question of the frame is scored only if every coordinate pair read from its
   question text (rule 4) is in the graph, by exact float equality; a question text with no
   coordinates always passes. Skipped questions count in no metric.
3. Accuracy: `answer == gt`, exactly (no strip: "Yes. " and "Yes.\\n" are wrong), mean over tag-0.
4. Coordinates: every match of `\\d+\\.\\d+` in the text, as float, paired in order (x1, y1, x2,
   y2, ...). So a bare "(1043.2, 82.2)" is a point; integers are not numbers ("<c1,CAM_FRONT,
   100,200>" has no point); there is no sign ("-12.5" reads 12.5); any decimal number joins the
   pairs ("12.5 m/s" shifts the pairing); Python's `\\d` and float() both take any Unicode
   decimal digit ("１０４３.２" reads 1043.2). A prediction with an odd count loses its last
   number. A reference or question text with an odd count makes evaluation.py fail (its numpy
   reshape; the "reshape error" of the challenge's FAQ): here an InputError naming the question.
5. Match: each predicted point in turn takes the nearest remaining reference point by L1
   distance (|dx| + |dy|; the first of equals); strictly under 16 px it is a true positive and
   that reference point is used up, otherwise a false positive. FN = reference points - TP,
   P = TP / (TP + FP + 1e-8), R = TP / (TP + FN + 1e-8), F1 = 2PR / (P + R + 1e-8): no points
   on either side gives F1 = 0 (even for a correct "no objects"). The match score is
   (mean(100 F1) + mean GPT score of the same answers) / 2, over tag-3 questions.
6. Language, over tag-2 questions: one reference per prediction, "_UNK" in a reference replaced
   by "_UNKNOWN" (CocoEvaluator's unknown-token guard), both sides through coco-caption's PTB
   tokenizer (Stanford CoreNLP 3.4.1, -preserveLines -lowerCase, a newline inside a text becomes
   a space, punctuation tokens dropped), then corpus-level Bleu(4), Rouge (ROUGE-L) and Cider
   from coco-caption; language-evaluation ships a copy of pycocoevalcap 1.2's scorers and
   tokenizer that differs from it only in verbosity, so pycocoevalcap is called here. Combined
   in the script's order: Bleu_n / 4 / 3 for n = 1..4, + ROUGE_L / 3, + CIDEr / 10 / 3.
7. GPT score: gpt-3.5-turbo rates each tag-1 answer against its reference, 0..100, mean.
8. final = 0.4 GPT/100 + 0.2 language + 0.2 match/100 + 0.2 accuracy, summed in that order.

Where the script cannot give a number this module reports one honestly instead: a metric with
no question (evaluation.py divides by zero) is None and left out of the final score; without a
judge (no model API here) the GPT term is unavailable, the match score is the F1 part alone, and
the final score is reported without the GPT term (max 0.6) and renormalized by the weights used.

LENIENT rules (`litevlm eval --lenient`) are the project's friendlier variant, differing in three
points only: every question is scored (no graph filter, so two pipelines are scored on the same
questions), answers are compared after strip(), and coordinates are read only from object tags
`<cN,CAM_X,x,y>` (integers and negative numbers included; other numbers, a speed "12.5 m/s",
are not coordinates).
"""

from __future__ import annotations

import contextlib
import io
import re
from dataclasses import asdict, dataclass, field
from typing import Protocol

from ..errors import InputError
from ..objects import OBJECT_TAG, tag_points

ACCURACY, GPT, LANGUAGE, MATCH = 0, 1, 2, 3
WEIGHTS = {"gpt": 0.4, "language": 0.2, "match": 0.2, "accuracy": 0.2}
MATCH_THRESHOLD_PX = 16.0
NUMBER = re.compile(r"\d+\.\d+")          # evaluation.py's coordinate parse (rule 4)
# Found by trying: Stanford's PTBLexer (-preserveLines) ends a line at each of these, and
# coco-caption only replaces "\n" before joining one text per line, so a text holding one shifts
# every later text onto the wrong reference (in the challenge's script too; replicated, and counted).
PTB_LINE_BREAK = re.compile("[\r\x0b\x0c\u2028\u2029]")
CHOICE_ANSWER = re.compile(r"^[A-D]\.?$")
YES_NO = {"Yes.", "No.", "Yes", "No"}


@dataclass(frozen=True)
class Rules:
    name: str
    graph_filter: bool        # rule 2
    exact_answers: bool       # rule 3; False: compared after strip()
    coordinates: str          # "numbers" (rule 4) or "tags" (<cN,CAM_X,x,y> only)


CHALLENGE = Rules("challenge", graph_filter=True, exact_answers=True, coordinates="numbers")
LENIENT = Rules("lenient", graph_filter=False, exact_answers=False, coordinates="tags")


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
    category: str = ""            # its DriveLM section, or "motion" when it needs time (frames > 1; data.py)
    frames: int = 1               # frame sets its answer is defined over: the key frame and frames - 1 before it


def derive_tags(question: str, answer: str) -> tuple[int, ...]:
    """Metric tags for a question that has none (DriveLM v1.1 training files carry none; the
    challenge's test file does): choice and yes/no questions are scored by accuracy, everything
    else by the judge and the language metrics, plus match when the reference names objects."""
    a = answer.strip()
    if (CHOICE_ANSWER.match(a) and "options" in question) or a in YES_NO:
        return (ACCURACY,)
    return (GPT, LANGUAGE, MATCH) if OBJECT_TAG.search(a) else (GPT, LANGUAGE)


class OddCoordinates(ValueError):
    """A reference or question text whose decimal numbers do not pair up (rule 4)."""


def points(text: str, coordinates: str = "numbers", odd: str = "drop") -> list[tuple[float, float]]:
    """The (x, y) points of a text. coordinates="numbers": rule 4, where odd="drop" (a
    prediction) loses an unpaired last number and odd="refuse" (a reference or question) raises
    OddCoordinates; coordinates="tags": the numbers of <cN,CAM_X,x,y> tags only."""
    if coordinates == "tags":
        return tag_points(text)
    numbers = [float(n) for n in NUMBER.findall(text)]
    if len(numbers) % 2:
        if odd == "refuse":
            raise OddCoordinates(f"{len(numbers)} decimal numbers ({', '.join(NUMBER.findall(text))}) "
                                 f"do not pair up as x, y")
        numbers.pop()
    return list(zip(numbers[0::2], numbers[1::2]))


def match_f1(prediction: str, reference: str, threshold: float = MATCH_THRESHOLD_PX,
             coordinates: str = "numbers") -> tuple[float, list]:
    """(F1, matched reference points) by rule 5."""
    remaining = points(reference, coordinates, odd="refuse")
    n_ref = len(remaining)
    tp = fp = 0
    matched = []
    for px, py in points(prediction, coordinates, odd="drop"):
        # The script's own scan (strict <, starting from inf) rather than min(): it keeps the
        # first of equal distances, and a nan distance (from an inf coordinate) never wins.
        best, best_distance = None, float("inf")
        for i, (gx, gy) in enumerate(remaining):
            distance = abs(px - gx) + abs(py - gy)
            if distance < best_distance:
                best, best_distance = i, distance
        if best_distance < threshold:
            tp += 1
            matched.append(remaining.pop(best))
        else:
            fp += 1
    fn = n_ref - tp
    precision = tp / (tp + fp + 1e-8)
    recall = tp / (tp + fn + 1e-8)
    return 2 * precision * recall / (precision + recall + 1e-8), matched


def answer_is_correct(prediction: str, reference: str, rules: Rules = CHALLENGE) -> bool:
    return prediction == reference if rules.exact_answers else prediction.strip() == reference.strip()


def _refusing(q: Question, what: str, fn, *args):
    try:
        return fn(*args)
    except OddCoordinates as exc:
        raise InputError(f"question {q.id}: its {what}: {exc}; the challenge's evaluation.py fails on "
                         f"this (its 'reshape error'); score with --lenient to read only <cN,CAM,x,y> tags") from None


def graph_filter(questions: list[Question], predictions: dict[str, str], rules: Rules = CHALLENGE,
                 match_threshold: float = MATCH_THRESHOLD_PX) -> tuple[list[Question], list[Question]]:
    """(scored, skipped) questions under the rules' graph filter (rule 2); with the filter off,
    every question is scored."""
    if not rules.graph_filter:
        return list(questions), []
    graph: dict[str, list] = {}
    scored, skipped = [], []
    for q in questions:
        if q.frame not in graph:             # the frame's first question sets its graph
            graph[q.frame] = _refusing(q, "reference answer", match_f1, predictions[q.id], q.answer,
                                       match_threshold, rules.coordinates)[1]
            scored.append(q)
        elif all(p in graph[q.frame] for p in _refusing(q, "question text", points, q.question,
                                                          rules.coordinates, "refuse")):
            scored.append(q)
        else:
            skipped.append(q)
    return scored, skipped


def language_metrics(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus-level BLEU-1..4, ROUGE-L, CIDEr exactly as coco-caption computes them (rule 6)."""
    # Imported here: only the language scores need coco-caption, and this module is read on the node's
    # path too (objects.py, evaluation/data.py), where pycocoevalcap need not be installed.
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    gts = {i: [{"caption": r.replace("_UNK", "_UNKNOWN")}] for i, r in enumerate(references)}
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
    # Term by term in evaluation.py's order: x / 4 / 3 is not always x / 12 in the last bit.
    total = 0.0
    for n in range(1, 5):
        total += m[f"Bleu_{n}"] / 4.0 / 3.0
    total += m["ROUGE_L"] / 3.0
    total += m["CIDEr"] / 10.0 / 3.0
    return total


@dataclass
class Scores:
    rules: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    accuracy: float | None = None
    language: dict | None = None          # the six metrics + "score"
    match: dict | None = None             # f1, judge (0..100 or None), score (0..1)
    gpt: dict = field(default_factory=dict)
    final: dict = field(default_factory=dict)
    # Per question category (Question.category: DriveLM's section, or "motion" for a question that
    # needs time): the same questions the totals count, split, so that over the categories the
    # counts add up to counts["scored"], counts["accuracy"] and the skipped, and correct /
    # accuracy_questions to the accuracy.
    by_category: dict = field(default_factory=dict)
    skipped_by_graph: int = 0
    frames_without_graph: int = 0         # first reference names no point: later object questions all skipped

    @property
    def per_category(self) -> dict:
        """The name by_category had before it counted `motion` (fleet/compare.py reads it)."""
        return self.by_category

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def _judged(judge: Judge, items: list[tuple[Question, str]]) -> float:
    """Mean judge score (0..100) of (question, prediction) pairs."""
    total = 0.0
    for q, p in items:
        value = judge.score(q.question, p, q.answer)
        try:
            total += float(value)     # evaluation.py reads the reply with float() too
        except (TypeError, ValueError):
            raise InputError(f"judge {judge.name}: question {q.id}: score {value!r} is not a number") from None
    return total / len(items)


def _correct(items: list[tuple[Question, str]], rules: Rules) -> int:
    return sum(answer_is_correct(p, q.answer, rules) for q, p in items)


def _accuracy(items: list[tuple[Question, str]], rules: Rules) -> float | None:
    if not items:
        return None
    return _correct(items, rules) / len(items)


def score(questions: list[Question], predictions: dict[str, str], judge: Judge | None = None,
          match_threshold: float = MATCH_THRESHOLD_PX, rules: Rules = CHALLENGE) -> Scores:
    """Score predictions {question id: text} against the questions' references."""
    missing = [q.id for q in questions if q.id not in predictions]
    if missing:
        raise KeyError(f"{len(missing)} question(s) have no prediction, e.g. {missing[0]}")
    scored, skipped = graph_filter(questions, predictions, rules, match_threshold)
    tagged = {
        tag: [(q, predictions[q.id]) for q in scored if tag in q.tags] for tag in (ACCURACY, GPT, LANGUAGE, MATCH)
    }
    acc, judged, lang, match = tagged[ACCURACY], tagged[GPT], tagged[LANGUAGE], tagged[MATCH]

    s = Scores(rules=asdict(rules) | {"match_threshold": match_threshold}, skipped_by_graph=len(skipped))
    if rules.graph_filter:
        firsts: dict[str, Question] = {}
        for q in questions:
            firsts.setdefault(q.frame, q)
        s.frames_without_graph = sum(not points(q.answer, rules.coordinates) for q in firsts.values())
    s.counts = {"questions": len(questions), "scored": len(scored), "accuracy": len(acc), "language": len(lang),
                "match": len(match), "gpt": len(judged)}
    s.accuracy = _accuracy(acc, rules)
    if lang:
        m = language_metrics([p for _, p in lang], [q.answer for q, _ in lang])
        s.language = m | {"score": combine_language(m),
                          "texts_split_by_tokenizer": sum(bool(PTB_LINE_BREAK.search(t)) for q, p in lang
                                                          for t in (p, q.answer))}
    if judge is not None and judged:
        s.gpt = {"available": True, "judge": judge.name, "score": _judged(judge, judged) / 100.0}
    else:
        s.gpt = {"available": False, "judge": judge.name if judge else None, "score": None,
                 "note": "no judge configured" if judge is None else "no judge-scored questions"}
    if match:
        f1_percent = sum(_refusing(q, "reference answer", match_f1, p, q.answer, match_threshold,
                                   rules.coordinates)[0] * 100 for q, p in match) / len(match)
        judge_match = _judged(judge, match) if judge is not None else None
        value = f1_percent / 100.0 if judge_match is None else (f1_percent + judge_match) / 2.0 / 100.0
        s.match = {"f1": f1_percent / 100.0, "judge": judge_match, "score": value}

    parts = {"language": s.language["score"] if s.language else None,
             "match": s.match["score"] if s.match else None,
             "accuracy": s.accuracy}
    present = {k: v for k, v in parts.items() if v is not None}
    without = sum(WEIGHTS[k] * v for k, v in present.items())
    weight = sum(WEIGHTS[k] for k in present)
    with_gpt = None
    if s.gpt["available"] and len(present) == 3:     # evaluation.py's sum, in its order
        with_gpt = sum(w * x for w, x in zip((0.4, 0.2, 0.2, 0.2), (s.gpt["score"], *parts.values())))
    s.final = {
        "with_gpt": with_gpt,
        "without_gpt": without,
        "renormalized": without / weight if weight else None,
        "terms_used": sorted(present),
        "terms_missing": sorted(set(parts) - set(present)) + ([] if s.gpt["available"] else ["gpt"]),
    }
    for category in sorted({q.category for q in questions}):
        items = [(q, p) for q, p in acc if q.category == category]
        s.by_category[category] = {
            "questions": sum(q.category == category for q in scored),
            "skipped_by_graph": sum(q.category == category for q in skipped),
            "accuracy_questions": len(items),
            "correct": _correct(items, rules),
            "accuracy": _accuracy(items, rules),
        }
    return s
