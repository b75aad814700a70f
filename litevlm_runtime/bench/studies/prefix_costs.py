"""What the shared prompt prefix (serving.prefix_cache, pipeline/prefix.py) saves, on the same queries:
two pipelines of one model in one process, with and without it, answering each (frame set,
question) pair in turn, the order alternating pair by pair (A B / B A) so that machine noise hits
both alike. Prints the prefill and whole-answer medians, the median of the per-query prefill
ratios, the rows reused, and whether every answer is identical (it must be: the prefix is exact).

    litevlm bench --study prefix_costs [--model DIR] [--frames DIR] [--frame-sets 2] [--threads 1]
                                   [--set tokens.mode=off] [--set backend.weights=int8]

Frames: the DriveLM sample's key frames when ../shared is there (else random); questions: the
benchmark's eight.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import litevlm_runtime  # noqa: F401 - first, so that torch's threads sleep when idle (threads.py)
from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.frames import load_frame_sets
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.report import table

SAMPLE = Path(__file__).resolve().parents[4] / "shared" / "drivelm_sample" / "samples"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--frames", type=Path, default=SAMPLE if SAMPLE.is_dir() else None)
    ap.add_argument("--frame-sets", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a pipeline setting for both")
    args = ap.parse_args(argv)
    settings = {"backend.threads": args.threads, **dict(s.split("=", 1) for s in args.set)}
    pipes = {"prefix": Pipeline.from_pretrained(args.model, options_from_flat(settings)),
             "whole": Pipeline.from_pretrained(args.model, options_from_flat({**settings,
                                                                              "serving.prefix_cache": False}))}
    if pipes["prefix"].rt.prefix is None:
        raise SystemExit(f"no prompt prefix kept with {settings} (FastV, or an engine whose prompt runs as graphs)")
    frame_sets = load_frame_sets(args.frames, args.frame_sets)
    for pipe in pipes.values():                 # warm-up, both
        pipe.answer(frame_sets[0], DEFAULT_QUESTIONS[0])
    prefill = {k: [] for k in pipes}
    total = {k: [] for k in pipes}
    prompt_rows, identical, pairs = [], 0, 0
    for f in frame_sets:
        for q in DEFAULT_QUESTIONS:
            order = list(pipes) if pairs % 2 == 0 else list(reversed(pipes))
            answers = {}
            for name in order:
                answers[name] = ans = pipes[name].answer(f, q)
                prefill[name].append(ans.stage_ms["prefill"])
                total[name].append(sum(ans.stage_ms.values()))
            identical += answers["prefix"].token_ids == answers["whole"].token_ids
            prompt_rows.append(answers["prefix"].input_tokens)
            pairs += 1
            print(f"[{pairs}/{len(frame_sets) * len(DEFAULT_QUESTIONS)}] prefill {prefill['whole'][-1]:7.1f} -> "
                  f"{prefill['prefix'][-1]:7.1f} ms  {q[:50]}", flush=True)
    ratio = statistics.median(w / p for w, p in zip(prefill["whole"], prefill["prefix"]))
    rows = [["prefill", statistics.median(prefill["whole"]), statistics.median(prefill["prefix"]), f"{ratio:.2f}x"],
            ["whole answer", statistics.median(total["whole"]), statistics.median(total["prefix"]),
             f"{statistics.median(w / p for w, p in zip(total['whole'], total['prefix'])):.2f}x"]]
    print(f"\n{args.model}  {settings}  {pairs} queries, alternating")
    print(table(["median ms", "whole prompt", "shared prefix kept", "paired speed-up"], rows))
    print(f"prefix rows kept: {len(pipes['prefix'].rt.prefix.ids)} (a query reuses its prompt's common prefix with "
          f"them); prompt rows median {statistics.median(prompt_rows):.0f}; answers identical {identical}/{pairs}")


if __name__ == "__main__":
    main()
