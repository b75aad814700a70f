"""Accuracy of several runs on the same questions, with 95% intervals: is a difference real?

Each run is a predictions file (`litevlm eval --predictions`) answering the same DriveLM-format
questions. Per run: the accuracy of the closed-form questions the rules score, with its Wilson
score interval (a binomial proportion; better than the normal interval near 0 or 1 and at a few
hundred questions). Per run against the reference run (the first): the accuracy difference with a
**paired cluster bootstrap over key frames**: frames are resampled with replacement and both runs
are scored on the same resampled frames. Frames, not questions, are the unit because the
challenge's graph filter decides per frame which questions count (rule 2 of metrics.py: a run's
answer to a frame's first question changes which of its later questions are scored), and because
a frame's questions share its images; the percentile interval of 10,000 resamples is reported.
Also: how many answers are identical to the reference's, token for token as text.

`category` restricts the counts to the questions of one category (Question.category: a DriveLM
section, or motion) while the graph filter still runs over every question of the frame, as the
totals' does: a category's figures are a split of the totals', never a rescoring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .metrics import ACCURACY, CHALLENGE, Question, Rules, answer_is_correct, graph_filter

Z95 = 1.959963984540054


def wilson(correct: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a proportion correct / n (95% by default)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def per_frame(questions: list[Question], predictions: dict[str, str], rules: Rules,
              category: str | None = None) -> dict[str, tuple[int, int]]:
    """frame -> (correct, scored) over the closed-form questions the rules score in that frame
    (of `category` only, when given)."""
    scored, _ = graph_filter(questions, predictions, rules)
    out = {q.frame: (0, 0) for q in questions}
    for q in scored:
        if ACCURACY in q.tags and (category is None or q.category == category):
            c, n = out[q.frame]
            out[q.frame] = (c + int(answer_is_correct(predictions[q.id], q.answer, rules)), n + 1)
    return out


@dataclass
class RunScore:
    name: str
    correct: int
    scored: int
    identical: int             # answers identical to the reference run's (all questions)
    questions: int
    delta: float = 0.0         # accuracy minus the reference's
    delta_lo: float = 0.0      # paired frame bootstrap, 95%
    delta_hi: float = 0.0

    @property
    def accuracy(self) -> float:
        return self.correct / self.scored if self.scored else float("nan")

    @property
    def interval(self) -> tuple[float, float]:
        return wilson(self.correct, self.scored)


def compare_runs(questions: list[Question], runs: dict[str, dict[str, str]], rules: Rules = CHALLENGE,
                 resamples: int = 10_000, seed: int = 0, category: str | None = None) -> list[RunScore]:
    """Every run scored (on the questions of `category` only, when given); the first is the
    reference the others are compared against."""
    names = list(runs)
    frames = sorted({q.frame for q in questions})
    counts = {name: per_frame(questions, preds, rules, category) for name, preds in runs.items()}
    table = {name: np.array([counts[name][f] for f in frames], dtype=np.int64) for name in names}   # [frames, 2]
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(frames), size=(resamples, len(frames)))
    ref = names[0]
    out = []
    for name in names:
        c, n = table[name].sum(0)
        mine_q = [q for q in questions if category is None or q.category == category]
        same = sum(runs[name][q.id] == runs[ref][q.id] for q in mine_q)
        score = RunScore(name, int(c), int(n), same, len(mine_q))
        if name != ref:
            mine, theirs = table[name][picks].sum(1), table[ref][picks].sum(1)        # [resamples, 2]
            deltas = mine[:, 0] / np.maximum(mine[:, 1], 1) - theirs[:, 0] / np.maximum(theirs[:, 1], 1)
            score.delta = score.accuracy - out[0].accuracy
            score.delta_lo, score.delta_hi = (float(x) for x in np.percentile(deltas, [2.5, 97.5]))
        out.append(score)
    return out


def comparison_rows(scores: list[RunScore]) -> list[list]:
    rows = []
    for s in scores:
        lo, hi = s.interval
        delta = "" if s is scores[0] else f"{100 * s.delta:+.1f} [{100 * s.delta_lo:+.1f}, {100 * s.delta_hi:+.1f}]"
        rows.append([s.name, f"{s.accuracy:.3f}", f"[{lo:.3f}, {hi:.3f}]", s.scored, delta,
                     f"{s.identical}/{s.questions} ({100 * s.identical / max(1, s.questions):.1f}%)"])
    return rows


COMPARISON_HEADER = ["run", "accuracy", "95% Wilson", "scored", "delta, points [95% paired frame bootstrap]",
                     "answers identical to the first run"]
