"""The paper's ablation on one model, data set and machine, in one run:

    baseline / + FastV / + EAGLE-2 / LiteVLM (view selector + token selector + EAGLE-2)

Every question is answered by every configuration in turn (interleaved, so machine noise hits
them alike); the table reports per-stage medians, cameras and input tokens, ms per output token,
mean accepted length, end-to-end speed-up over the baseline, and accuracy on the choice and
yes/no questions (DriveLM's accuracy metric) plus the final score without the GPT term.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..evaluation.data import frame_images, load_frames
from ..evaluation.metrics import CHALLENGE, score
from ..evaluation.runner import select
from ..options import options_from_flat
from ..pipeline.answer import STAGES
from ..pipeline.pipeline import Pipeline
from ..report import table
from ..weights.checkpoint import read_config

# matplotlib is imported where the plot is drawn: it is heavy, and only --plot needs it.

# Each row: settings (dotted names, options.py) over the command's own options.
CONFIGS: dict[str, dict] = {
    "baseline": {"pipeline": "baseline"},
    "+FastV": {
        "pipeline": "baseline",
        "fastv.k": 2,
        "fastv.ratio": 0.7,
    },  # the paper's "FastV r=0.3": keep 30% from layer 2
    "+EAGLE": {"pipeline": "baseline", "decoding.mode": "eagle"},
    "LiteVLM": {"pipeline": "litevlm", "views.mode": "selector", "tokens.mode": "selector", "decoding.mode": "eagle"},
}


@dataclass
class ConfigRun:
    name: str
    pipe: object
    records: list[dict] = field(default_factory=list)


def run_ablation(model_dir: Path, data: Path, frames_root: Path, base_options, limit: int | None = None,
                 configs: dict[str, dict] | None = None, progress=print) -> dict:

    # The challenge's rules without its per-frame graph filter: the filter depends on each
    # pipeline's own first answers, and the rows must be compared on the same questions.
    same_questions = replace(CHALLENGE, name="challenge without the graph filter", graph_filter=False)


    configs = configs or CONFIGS
    layers = read_config(model_dir).llm.num_hidden_layers
    # FastV prunes from layer K = 2 (the paper's setting); a shallower test model prunes from its last layer.
    configs = {name: ({**o, "fastv.k": min(o["fastv.k"], layers - 1)} if "fastv.k" in o else o)
               for name, o in configs.items()}
    runs = [ConfigRun(name, Pipeline.from_pretrained(model_dir, options_from_flat(overrides, base_options)))
            for name, overrides in configs.items()]
    work = select(load_frames(data), limit)
    questions = [q for _, qs in work for q in qs]
    done = 0
    for frame, qs in work:
        images = {cam: p.read_bytes() for cam, p in frame_images(frames_root, frame).items()}
        for q in qs:
            for run in runs:
                ans = run.pipe.answer(images, q.question)
                run.records.append({"id": q.id, "answer": ans.text, "stage_ms": ans.stage_ms,
                                    "cameras": len(ans.cameras), "input_tokens": ans.input_tokens,
                                    "new_tokens": len(ans.token_ids), "accepted_length": ans.accepted_length,
                                    "total_ms": ans.total_ms, "rounds": ans.extra.get("rounds", [])})
            done += 1
            progress(f"[{done}/{len(questions)}] {q.question[:60]}")
    rows = []
    base_total = None
    for run in runs:
        r = run.records
        med = {s: statistics.median(x["stage_ms"][s] for x in r) for s in STAGES}
        total = statistics.median(x["total_ms"] for x in r)
        tokens = sum(x["new_tokens"] for x in r)
        scores = score(questions, {x["id"]: x["answer"] for x in r}, rules=same_questions)
        base_total = base_total or total
        rows.append({
            "pipeline": run.name,
            "cameras": statistics.mean(x["cameras"] for x in r),
            "input_tokens": statistics.mean(x["input_tokens"] for x in r),
            "stage_ms": med,
            "select_ms": med["view_select"] + med["token_select"],
            "ms_per_token": sum(x["stage_ms"]["decode"] for x in r) / max(1, tokens - len(r)),
            "accepted_length": statistics.mean(x["accepted_length"] for x in r),
            "total_ms": total,
            "speedup": base_total / total,
            "accuracy": scores.accuracy,
            "final_without_gpt": scores.final.get("without_gpt"),
        })
    return {"model": str(model_dir), "data": str(data), "questions": len(questions), "rows": rows}


def ablation_table(result: dict) -> str:
    headers = ["pipeline", "cams", "ViT ms", "in tok", "prefill ms", "ms/tok", "acc len", "decode ms",
               "select ms", "total ms", "speed-up", "accuracy", "final*"]
    rows = [[r["pipeline"], f"{r['cameras']:.1f}", r["stage_ms"]["vision"], f"{r['input_tokens']:.0f}",
             r["stage_ms"]["prefill"], r["ms_per_token"], f"{r['accepted_length']:.2f}", r["stage_ms"]["decode"],
             r["select_ms"], r["total_ms"], f"{r['speedup']:.2f}x",
             "-" if r["accuracy"] is None else f"{r['accuracy']:.4f}",
             "-" if r["final_without_gpt"] is None else f"{r['final_without_gpt']:.4f}"]
            for r in result["rows"]]
    return (table(headers, rows) + f"\n\n{result['questions']} questions; medians per query; accuracy and "
            "final* (the DriveLM final score without the GPT term: no judge) by the challenge's rules on every "
            "question (no graph filter, so that every row is scored on the same questions)")


def ablation_plot(result: dict, path: Path) -> None:
    """Stacked per-stage bars, one per pipeline (the paper's figure 2)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    fig, ax = plt.subplots(figsize=(9, 5))
    left = [0.0] * len(rows)
    for stage in STAGES:
        vals = [r["stage_ms"][stage] for r in rows]
        ax.barh([r["pipeline"] for r in rows], vals, left=left, label=stage)
        left = [a + b for a, b in zip(left, vals)]
    for i, r in enumerate(rows):
        ax.text(left[i], i, f" {r['total_ms']:.0f} ms ({r['speedup']:.2f}x)", va="center")
    ax.invert_yaxis()
    ax.set_xlabel("median milliseconds per query")
    ax.set_title(f"LiteVLM ablation: {Path(result['model']).name}, {result['questions']} questions")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=len(STAGES), fontsize=8, frameon=False)
    ax.set_xlim(0, max(left) * 1.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
