"""What frame sets over time cost, in one run (`litevlm bench --temporal`, issue 45 item 4):

    1 frame set                                   the question on the key frame set alone
    K frame sets, every token (change_threshold 0) the older sets' tokens all in the prompt
    K frame sets, temporal token selection        older sets keep only the tokens that changed

on the motion questions of a SynthDrive set in motion (or any DriveLM file whose items carry
"frames"), through the configured pipeline (the LiteVLM pipeline by default). Every question is
answered by the three rows in turn (interleaved: machine noise hits them alike). The window is
warm, as in a car where each frame set was encoded when it arrived: before a K-frame question the
feature cache holds its K - 1 older sets (`Pipeline.prefetch`, untimed) and not the key set; the
1-frame question starts from a cache without the key set too, so both encode the key set's views.

Columns: the vision stage (preprocess + vision, median ms) and its ratio to 1 frame set, (camera,
frame) views encoded and reused, prefill rows (input_tokens, median) and their ratio, prefill ms,
and accuracy on the closed-form questions (exact match, as `litevlm eval`) with its 95% Wilson
interval. The rows' K-frame answers use every asked set (temporal.mode all) so that each question
is asked over the same frames in both K-frame rows.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ..errors import InputError
from ..evaluation.compare import wilson
from ..evaluation.data import frame_images_over_time, load_frames
from ..evaluation.metrics import ACCURACY
from ..options import options_from_flat
from ..pipeline.frame_sets import FrameSet
from ..pipeline.pipeline import Pipeline
from ..pipeline.request import QueryRequest
from ..report import table

ROWS = ("1 frame set", "{k} frame sets, every token", "{k} frame sets, temporal token selection")


def run_temporal(model_dir: Path, data: Path, frames_root: Path, base_options, frames: int = 4,
                 limit: int | None = 200, progress=print) -> dict:
    questions = [(f, q) for f in load_frames(data) for q in f.questions if q.frames > 1 and ACCURACY in q.tags]
    questions = questions[:limit] if limit else questions
    if not questions:
        raise InputError(f"{data}: no closed-form question over several frame sets (items with \"frames\" > 1)")
    settings = {"temporal.max_frames": max(frames, base_options.temporal.max_frames), "temporal.mode": "all"}
    selecting = Pipeline.from_pretrained(model_dir, options_from_flat(settings, base_options))
    every = Pipeline.from_pretrained(model_dir, options_from_flat(settings | {"temporal.change_threshold": 0.0},
                                                                  base_options))
    rows = {name.format(k=frames): [] for name in ROWS}
    names = list(rows)
    for n, (frame, q) in enumerate(questions, 1):
        sets = [FrameSet({c: p.read_bytes() for c, p in s.paths.items()}, {c: str(p) for c, p in s.paths.items()})
                for s in frame_images_over_time(frames_root, frame, frames, base_options.temporal.stride_s)]
        for name, pipe, k in ((names[0], selecting, 1), (names[1], every, frames), (names[2], selecting, frames)):
            pipe.rt.features.clear()
            if pipe.rt.motion_cache is not None:           # (a model with motion/: its flow made here too)
                pipe.rt.motion_cache.clear()
            for older in sets[:-1] if k > 1 else ():        # the window, warm: encoded as the sets arrived
                pipe.prefetch(older.images, older.keys)
            ans = pipe.answer(sets[-k:], QueryRequest(q.question, frames=k))
            rows[name].append({"vision_ms": ans.stage_ms["preprocess"] + ans.stage_ms["vision"],
                               "prefill_ms": ans.stage_ms["prefill"], "input_tokens": ans.input_tokens,
                               "encoded": ans.encoded_views, "reused": ans.reused_views,
                               "kept_per_frame": ans.kept_per_frame, "frames": ans.frames,
                               "correct": ans.text.strip() == q.answer.strip()})
        if n % 25 == 0 or n == len(questions):
            progress(f"temporal bench: {n}/{len(questions)} questions")
    base = rows[names[0]]
    out = {"model": str(model_dir), "data": str(data), "frames": frames, "questions": len(questions),
           "pipeline": selecting.rt.options.label(), "change_threshold": selecting.rt.options.temporal.change_threshold,
           "rows": {}}
    for name, recs in rows.items():
        med = {key: statistics.median(r[key] for r in recs) for key in ("vision_ms", "prefill_ms", "input_tokens",
                                                                      "encoded", "reused")}
        correct = sum(r["correct"] for r in recs)
        lo, hi = wilson(correct, len(recs))
        out["rows"][name] = med | {
            "vision_ratio": med["vision_ms"] / statistics.median(r["vision_ms"] for r in base),
            "tokens_ratio": med["input_tokens"] / statistics.median(r["input_tokens"] for r in base),
            "kept_per_frame": [statistics.mean(r["kept_per_frame"][i] for r in recs) for i in range(len(recs[0]
                                                                                                   ["kept_per_frame"]))],
            "accuracy": correct / len(recs), "interval": [lo, hi], "correct": correct}
    same = sum(a["correct"] == b["correct"] for a, b in zip(rows[names[1]], rows[names[2]]))
    out["answers_equal_every_token_vs_selection"] = same / len(questions)
    return out


def temporal_table(result: dict) -> str:
    head = ["", "vision ms", "x 1 set", "views enc/reused", "prefill rows", "x 1 set", "prefill ms",
            "kept per set (mean)", "accuracy [95% CI]"]
    body = [[name, r["vision_ms"], f"{r['vision_ratio']:.2f}x", f"{r['encoded']:g}/{r['reused']:g}",
             r["input_tokens"], f"{r['tokens_ratio']:.2f}x", r["prefill_ms"],
             " ".join(f"{v:.0f}" for v in r["kept_per_frame"]),
             f"{r['accuracy']:.3f} [{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]"]
            for name, r in result["rows"].items()]
    return (f"{result['questions']} closed-form questions over {result['frames']} frame sets of {result['data']}; "
            f"{result['pipeline']}, change_threshold {result['change_threshold']:g}; medians, the window warm\n"
            + table(head, body)
            + "\nquestions answered equally right or wrong, every token vs temporal selection: "
            + f"{result['answers_equal_every_token_vs_selection']:.3f}")
