"""What explaining an answer costs, part by part, against the answer's own time in the same run.

For each DriveLM question of the sample (with its key frame's six images): the answer (A1), its
explanation (views, token scores, the attention pass: pipeline/explanation.py), the picture drawn
and encoded (PNG as for docs, JPEG as the ROS topic sends), then the same answer again (A2). Each
part's cost is divided by the mean of A1 and A2 (the answer's time around it, so that machine noise
between them hits both alike), and the medians of those ratios are printed with the medians in ms.
A query that is not explained runs none of this (nothing of it is on the query's path).

    litevlm bench --study explain_costs [--model DIR] [--questions N] [--threads 1] [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import litevlm_runtime  # noqa: F401 - first, so that torch's threads sleep when idle (threads.py)
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.explain.capture import drivelm_questions
from litevlm_runtime.explain.picture import draw_explanation, encode_jpeg, encode_png
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.explanation import explain, trace_from_arena
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.report import table

SAMPLE = Path(__file__).resolve().parents[4] / "shared" / "drivelm_sample"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--data", type=Path, default=SAMPLE / "qa_scene_n008.json")
    ap.add_argument("--frames", type=Path, default=SAMPLE)
    ap.add_argument("--questions", type=int, default=12, help="every k-th question of the file, this many")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a pipeline setting")
    args = ap.parse_args(argv)
    settings = {"backend.threads": args.threads, **dict(s.split("=", 1) for s in args.set)}
    pipe = Pipeline.from_pretrained(args.model, options_from_flat(settings))
    everything = drivelm_questions(args.data, args.frames)
    step = max(1, len(everything) // args.questions)
    questions = everything[::step][:args.questions]
    images = {q.id: {c: p.read_bytes() for c, p in q.images.items()} for q in questions}
    pipe.answer(images[questions[0].id], questions[0].question)          # warm-up
    parts = ("views", "token_scores", "attention", "explanation", "draw", "png", "jpeg")
    ms = {p: [] for p in ("answer", *parts)}
    ratio = {p: [] for p in parts}
    for i, q in enumerate(questions, 1):
        first = pipe.answer(images[q.id], q.question)
        e = explain(pipe.rt, trace_from_arena(pipe.rt, first))
        t0 = time.perf_counter()
        picture = draw_explanation(e, images[q.id])
        t1 = time.perf_counter()
        png = encode_png(picture)
        t2 = time.perf_counter()
        jpeg = encode_jpeg(picture)
        t3 = time.perf_counter()
        second = pipe.answer(images[q.id], q.question)
        answer_ms = (first.total_ms + second.total_ms) / 2
        cost = {**e.cost_ms, "explanation": sum(e.cost_ms.values()), "draw": (t1 - t0) * 1e3,
                "png": (t2 - t1) * 1e3, "jpeg": (t3 - t2) * 1e3}
        ms["answer"].append(answer_ms)
        for p in parts:
            ms[p].append(cost[p])
            ratio[p].append(cost[p] / answer_ms)
        print(f"[{i}/{len(questions)}] answer {answer_ms:6.0f} ms  explanation {cost['explanation']:6.0f} ms  "
              f"draw {cost['draw']:5.0f} ms  cameras {len(first.cameras)}  tokens {first.kept_tokens}  "
              f"answer tokens {len(first.token_ids)}  png {len(png) // 1024} KB  jpeg {len(jpeg) // 1024} KB  "
              f"{q.question[:48]}", flush=True)
    rows = [["answer (mean of the two around)", statistics.median(ms["answer"]), "1.00"]]
    labels = {"views": "explain: view selection (remembered)", "token_scores": "explain: token scores",
              "attention": "explain: attention pass", "explanation": "explain: all", "draw": "picture: draw",
              "png": "picture: PNG encode", "jpeg": "picture: JPEG encode (ROS topic)"}
    rows += [[labels[p], statistics.median(ms[p]), f"{statistics.median(ratio[p]):.3f}"] for p in parts]
    print(f"\n{args.model}  {settings}  {len(questions)} DriveLM questions")
    print(table(["part", "median ms", "median ratio to the answer"], rows))


if __name__ == "__main__":
    main()
