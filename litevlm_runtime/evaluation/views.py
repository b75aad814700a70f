"""Evaluating a view selector on DriveLM-format QA: the same metrics for every row compared
(recall over tagged cameras, question recall, cameras kept), used by `litevlm train views` on its
held-out frames and by `litevlm eval-views` on any file.

Ground truth per question: the cameras named in object tags `<cN,CAM_X,x,y>` of the question and
of its answer. Camera x time (`time_metrics`): a question whose item has "frames" K > 1 (a motion
question) needs past frame sets, any other needs none."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..cameras import CAMERAS
from ..errors import InputError
from ..stages.view_selector import Fusion, LoadedViewSelector, fuse, fuse_time, keyword_map, tagged_cameras, time_cue
from .data import load_frames


@dataclass
class QARecord:
    source: str      # data file
    scene: str
    frame: str       # key frame token: the unit of the train/eval split
    category: str    # perception | prediction | planning | behavior
    question: str
    answer: str
    frames: int = 1  # frame sets its answer needs (the item's "frames"; > 1: a motion question)


def load_qa(paths: list[str | Path]) -> list[QARecord]:
    """Every QA pair of the given DriveLM-format files (read by evaluation.data, the one DriveLM
    reader), in file order."""
    records: list[QARecord] = []
    for path in paths:
        frames = load_frames(path)
        for f in frames:
            for q in f.questions:
                if not q.question.strip():
                    raise InputError(f"{path}: frame {f.token} {q.category} question {q.id} is empty")
        found = [QARecord(str(path), f.scene, f.token, q.category, q.question, q.answer, q.frames)
                 for f in frames for q in f.questions]
        if not found:
            raise InputError(f"{path}: no QA pairs found")
        records += found
    return records


def selection_metrics(records: list[QARecord], selections: list[list[str]]) -> dict:
    """The metrics every selector is compared by, on the same questions.

    Truth for a question: the cameras tagged `<cN,CAM_X,x,y>` in its question or its answer (the
    selector sees only the question). A question with no tag has no camera truth: it counts in
    the cameras kept (its cost) but not in recall.
    - recall: over every (question, truth camera) pair, the fraction whose camera is kept;
    - question_recall: the fraction of tagged questions whose truth cameras are all kept;
    - mean_cameras_kept: cameras kept per question over all questions (of 6);
    - all_cameras_fraction: the fraction of questions that keep all six.
    """
    if not records:
        raise InputError("evaluate: no questions")
    pairs = recalled = tagged_q = tagged_q_ok = 0
    for r, kept in zip(records, selections, strict=True):
        truth = set(tagged_cameras(r.question)) | set(tagged_cameras(r.answer))
        if truth:
            hits = sum(c in kept for c in truth)
            tagged_q += 1
            pairs += len(truth)
            recalled += hits
            tagged_q_ok += hits == len(truth)
    return {
        "questions": len(records),
        "tagged_questions": tagged_q,
        "recall": recalled / pairs if pairs else float("nan"),
        "question_recall": tagged_q_ok / tagged_q if tagged_q else float("nan"),
        "mean_cameras_kept": sum(len(s) for s in selections) / len(records),
        "all_cameras_fraction": sum(len(s) == len(CAMERAS) for s in selections) / len(records),
    }


def cues_of(records: list[QARecord]) -> list[tuple[dict, list[str]]]:
    return [(keyword_map(r.question), tagged_cameras(r.question)) for r in records]


def selections_of(cues, probs: torch.Tensor | None, fusion: Fusion) -> list[list[str]]:
    rows = probs.tolist() if probs is not None else [None] * len(cues)
    return [
        fuse(keyword, dict(zip(CAMERAS, p)) if p is not None else None, tagged, fusion).cameras
        for (keyword, tagged), p in zip(cues, rows)
    ]


def evaluate(selector: LoadedViewSelector | None, records: list[QARecord], fusion: Fusion | None = None) -> dict:
    """selection_metrics of a selector under its own fusion (or `fusion`); selector=None is the
    keyword map alone, cut at fusion.threshold (default 0.4)."""
    if not records:
        raise InputError("evaluate: no questions")
    fusion = fusion or (selector.fusion if selector else Fusion())
    probs = selector.module_probs([r.question for r in records]) if selector else None
    return selection_metrics(records, selections_of(cues_of(records), probs, fusion))


def format_table(rows: dict[str, dict]) -> str:
    width = max([28] + [len(name) for name in rows])
    head = (f"{'selector':<{width}} {'questions':>9} {'tagged':>6} {'recall':>7} {'q-recall':>8} "
            f"{'cams kept':>9} {'all 6':>6}")
    lines = [head, "-" * len(head)]
    for name, m in rows.items():
        lines.append(
            f"{name:<{width}} {m['questions']:>9d} {m['tagged_questions']:>6d} {m['recall']:>7.4f} "
            f"{m['question_recall']:>8.4f} {m['mean_cameras_kept']:>9.3f} {m['all_cameras_fraction']:>6.3f}"
        )
    return "\n".join(lines)


def compare(trained: LoadedViewSelector, untrained: LoadedViewSelector, records: list[QARecord]) -> dict[str, dict]:
    """The selector vs the same architecture at its random initialisation (same fusion) vs the
    keyword map alone (at the selector's keyword threshold, and with only its certain cameras)
    vs all six cameras, on the same questions."""
    thr = trained.fusion.threshold
    return {
        f"selector ({trained.fusion.describe()})": evaluate(trained, records),
        "untrained (same fusion)": evaluate(untrained, records, trained.fusion),
        f"keyword map only (thr {thr:g})": evaluate(None, records, Fusion(threshold=thr)),
        "keyword map, certain cues only": evaluate(None, records, Fusion(threshold=1.0)),
        "all six cameras": selection_metrics(records, [list(CAMERAS)] * len(records)),
    }


# ---------------------------------------------------------------------------------------------
# Camera x time
# ---------------------------------------------------------------------------------------------


def time_metrics(records: list[QARecord], past: list[int | None]) -> dict:
    """How a time selection (past frame sets per question: 0 none, None every one asked for)
    treats motion questions (frames > 1: they need past sets) and static ones (need none)."""
    motion = [p for r, p in zip(records, past, strict=True) if r.frames > 1]
    static = [p for r, p in zip(records, past, strict=True) if r.frames == 1]
    return {
        "motion_questions": len(motion),
        "motion_with_past": sum(p is None or p > 0 for p in motion) / len(motion) if motion else float("nan"),
        "static_questions": len(static),
        "static_without_past": sum(p == 0 for p in static) / len(static) if static else float("nan"),
    }


def time_choices(records: list[QARecord], probs: torch.Tensor | None, weight: float,
                 threshold: float) -> list[int | None]:
    """Past frame sets per question by fuse_time (probs None: the time cue alone)."""
    rows = probs.tolist() if probs is not None else [None] * len(records)
    return [fuse_time(time_cue(r.question), p, weight, threshold)[0] for r, p in zip(records, rows)]


def compare_time(selector: LoadedViewSelector, records: list[QARecord]) -> dict[str, dict]:
    """The selector's time selection (its fusion), its time head alone and the time cue alone."""
    cfg = selector.cfg
    probs = selector.all_probs([r.question for r in records])[1] if records else None
    rows = {"time cue alone": time_metrics(records, time_choices(records, None, 0.0, 0.5))}
    if probs is not None:
        rows = {f"selector (w {cfg.time_keyword_weight:g}, thr {cfg.time_threshold:g})":
                time_metrics(records, time_choices(records, probs, cfg.time_keyword_weight, cfg.time_threshold)),
                "time head alone": time_metrics(records, time_choices(records, probs, 0.0, 0.5))} | rows
    return rows


def format_time_table(rows: dict[str, dict]) -> str:
    width = max([28] + [len(name) for name in rows])
    head = f"{'time selection':<{width}} {'motion q':>8} {'with past':>9} {'static q':>8} {'none':>6}"
    lines = [head, "-" * len(head)]
    for name, m in rows.items():
        lines.append(f"{name:<{width}} {m['motion_questions']:>8d} {m['motion_with_past']:>9.4f} "
                     f"{m['static_questions']:>8d} {m['static_without_past']:>6.4f}")
    return "\n".join(lines)
