"""`litevlm bench --budget F`: latency budgets measured on a DriveLM-format QA set, in one run.

Pass 1 answers every question without a budget (its median total is the reference); pass 2
answers the same questions with the budget at F x that median (F = 0.5 by default: "half the
unbudgeted median"). The table: budget, share of ok answers within it, p50/p95 latency, accuracy
and the final score without GPT (the challenge's rules on the same questions) for both passes,
and how often each degradation was taken.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import replace
from pathlib import Path

from ..evaluation.data import frame_images, load_frames
from ..evaluation.metrics import CHALLENGE, score
from ..evaluation.runner import select
from ..pipeline.pipeline import Pipeline
from ..pipeline.request import QueryRequest
from ..report import table


def run_budget_bench(model_dir: Path, data: Path, frames_root: Path, options, limit: int | None = None,
                     fractions: tuple[float, ...] = (0.5,), progress=print) -> dict:
    pipe = Pipeline.from_pretrained(model_dir, options)
    pipe.warm_up()
    work = select(load_frames(data), limit)
    questions = [q for _, qs in work for q in qs]
    # Each frame's questions in turn, with the frame as the features' key: what a planner asking
    # several questions of one frame set sees (visual reuse on).
    inputs = [
        ({c: p.read_bytes() for c, p in frame_images(frames_root, f).items()}, q, f.token) for f, qs in work for q in qs
    ]
    rules = replace(CHALLENGE, name="challenge without the graph filter", graph_filter=False)

    def run(budget: float, label: str) -> dict:
        answers = []
        for i, (images, q, frame) in enumerate(inputs):
            answers.append(
                pipe.answer(
                    images, QueryRequest(q.question, budget_ms=budget), frame_keys={c: (frame, label) for c in images}
                )
            )
            if (i + 1) % 20 == 0 or i + 1 == len(inputs):
                progress(f"[{label} {i + 1}/{len(inputs)}]")
        scores = score(questions, {q.id: a.text for (_, q, _), a in zip(inputs, answers)}, rules=rules)
        totals = sorted(a.total_ms for a in answers)
        kinds = Counter("not met" if d.startswith("budget") else " ".join(d.split()[:2]) if d.startswith("answer")
                        else d.split()[0] for a in answers for d in a.degraded)
        return {"budget_ms": budget, "met": sum(a.budget_met for a in answers) / len(answers),
                "p50_ms": statistics.median(totals), "p95_ms": totals[min(len(totals) - 1, int(0.95 * len(totals)))],
                "accuracy": scores.accuracy, "final_without_gpt": scores.final.get("without_gpt"),
                "degraded": dict(kinds), "degraded_answers": sum(bool(a.degraded) for a in answers)}

    rows = [run(0.0, "unbudgeted")]
    for f in fractions:
        rows.append(run(f * rows[0]["p50_ms"], f"budget {f:g} x median"))
    return {"model": str(model_dir), "questions": len(questions), "rows": rows}


def budget_table(result: dict) -> str:
    rows = []
    for r in result["rows"]:
        rows.append(["none" if not r["budget_ms"] else f"{r['budget_ms']:.1f}",
                     "-" if not r["budget_ms"] else f"{100 * r['met']:.1f}%", r["p50_ms"], r["p95_ms"],
                     "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}",
                     "-" if r["final_without_gpt"] is None else f"{r['final_without_gpt']:.4f}",
                     r["degraded_answers"], ", ".join(f"{k} {v}" for k, v in sorted(r["degraded"].items())) or "-"])
    return (table(["budget ms", "within", "p50 ms", "p95 ms", "accuracy", "final*", "degraded", "what"], rows)
            + f"\n\n{result['questions']} questions; accuracy and final* by the challenge's rules on every question")
