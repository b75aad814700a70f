"""Latency benchmark of the pipeline against transformers' reference `generate` on the same
weights, inputs and machine, interleaved query by query so that machine noise hits both alike."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from ..pipeline.answer import STAGES
from ..timing import percentile
from .hf_reference import hf_generate, load_hf_reference

DEFAULT_QUESTIONS = [
    "What are the important objects in the current scene?",
    "Is there a pedestrian behind the ego car?",
    "What is the status of the car in the front left?",
    "What should the ego vehicle do next?",
    "How many vehicles are on the rear right?",
    "Is the traffic light ahead red or green?",
    "Which object is the most dangerous for the ego vehicle?",
    "What is the moving status of the truck in front of the ego car?",
]

MODEL_STAGES = ("view_select", "vision", "token_select", "prefill", "decode")


@dataclass
class BenchResult:
    stage_ms: dict[str, list[float]] = field(default_factory=lambda: {s: [] for s in STAGES})
    reference_ms: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    input_tokens: list[int] = field(default_factory=list)     # prompt rows prefill ran over
    reference_tokens: list[int] = field(default_factory=list)
    identical: int = 0
    queries: int = 0
    rounds: list = field(default_factory=list)        # EAGLE-2: each round's (depth, nodes, accepted) or "greedy"

    def model_ms(self) -> list[float]:
        return [sum(self.stage_ms[s][i] for s in MODEL_STAGES) for i in range(self.queries)]

    def summary(self) -> dict:
        rows = {s: {"median": statistics.median(v), "p90": percentile(v, 90)} for s, v in self.stage_ms.items() if v}
        total = [sum(self.stage_ms[s][i] for s in STAGES) for i in range(self.queries)]
        rows["total"] = {"median": statistics.median(total), "p90": percentile(total, 90)}
        out = {"queries": self.queries, "stages": rows,
               "model_ms": {"median": statistics.median(self.model_ms()), "p90": percentile(self.model_ms(), 90)},
               "mean_new_tokens": statistics.mean(self.tokens)}
        if self.rounds:
            shapes = Counter("plain step" if r == "greedy" else f"depth {r[0]}, {r[1]} nodes" for r in self.rounds)
            out["eagle_rounds"] = dict(shapes.most_common())
        if self.reference_ms:
            ref_med = statistics.median(self.reference_ms)
            out["reference"] = {
                "name": "transformers InternVLForConditionalGeneration.generate (greedy, same weights)",
                "median": ref_med, "p90": percentile(self.reference_ms, 90),
                "mean_new_tokens": statistics.mean(self.reference_tokens),
                "identical_answers": f"{self.identical}/{self.queries}",
                "speedup_model": ref_med / out["model_ms"]["median"],
                **paired_speedups(self.reference_ms, self.model_ms()),
            }
        return out


def paired_speedups(reference_ms: list[float], model_ms: list[float]) -> dict:
    """The speed-up query by query (each query's transformers time over its pipeline time, the two
    measured back to back on the same inputs) and over the whole run (total over total). With the
    bench's mix of one-line and long answers, the ratio of the two medians compares whichever query
    sits at each median, and a busy host that slows one query moves it; the paired median does not
    depend on which queries are short."""
    per_query = sorted(r / m for r, m in zip(reference_ms, model_ms))
    return {"speedup_paired_median": statistics.median(per_query), "speedup_paired_min": per_query[0],
            "speedup_paired_max": per_query[-1], "speedup_total": sum(reference_ms) / sum(model_ms)}


def run_benchmark(pipe, frame_sets: list[dict], questions: list[str], repeat: int = 1, warmup: int = 2,
                  reference: bool = True, progress=print) -> BenchResult:
    """Each (frames, question) pair runs through the pipeline and, if `reference`, through
    transformers' generate on the same prompt ids and pixels with the same token budget."""
    hf = None
    if reference:
        hf = load_hf_reference(pipe.rt.model_dir).to(pipe.rt.dtype)
    result = BenchResult()
    pairs = [(f, q) for _ in range(repeat) for f in frame_sets for q in questions]
    for f, q in pairs[:warmup]:
        pipe.answer(f, q)
        if hf is not None:
            ids, pixels = pipe.reference_inputs(f, q)
            hf_generate(hf, ids, pixels, 2, sorted(pipe.rt.tok.eos_ids))
    for i, (frames, question) in enumerate(pairs):
        ans = pipe.answer(frames, question)
        for s in STAGES:
            result.stage_ms[s].append(ans.stage_ms[s])
        result.tokens.append(len(ans.token_ids))
        result.input_tokens.append(ans.input_tokens)
        result.rounds += ans.extra.get("rounds", [])
        result.queries += 1
        if hf is not None:
            ids, pixels = pipe.reference_inputs(frames, question)
            t0 = time.perf_counter()
            ref_ids = hf_generate(hf, ids, pixels, pipe.rt.options.max_new_tokens, sorted(pipe.rt.tok.eos_ids))
            result.reference_ms.append((time.perf_counter() - t0) * 1000)
            ref_ids = [t for t in ref_ids if t not in pipe.rt.tok.eos_ids]
            result.reference_tokens.append(len(ref_ids))
            result.identical += int(ref_ids == ans.token_ids)
        progress(f"[{i + 1}/{len(pairs)}] {ans.total_ms:8.1f} ms  {question[:50]}")
    return result
