"""`litevlm fleet bench`: the wall time of `fleet eval` with pools of different sizes on the same
bags, in one session, sizes alternating round by round (so that a change in the machine's other
load hits every size alike), as a table with the ratio to the first size; and whether every run
gave the same answers (and, with --versus-bag-eval, the answers `bag eval` gives each bag).

Bags given as URIs are fetched by each worker from object storage: "fetched MB per bag" and "fetch
s per bag" are that transfer (part of "s per bag").

Wall time is the whole `fleet eval`: actors started, each loading the model once, all bags
evaluated, answers written. "s per bag" is a bag's own time in its worker; "CPU s per bag" the CPU
seconds its worker process spent on it (every thread: the query thread, torch's intra-op threads,
prefetching while idle), which does not grow with other load the way wall time does. The 1-minute
load average before and after each run is in the table: on a shared machine it says how much of
the CPU the runs had.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable

import numpy as np

from ..bag.evaluate import evaluate
from ..report import table
from .dataset import RunFolder
from .run import run_fleet
from .storage import fetch_bag, remove_scratch, scratch_folder

ANSWER_FIELDS = ("status", "answer", "token_ids", "cameras", "kept_tokens")


def run_answers(out: Path) -> dict[tuple[str, str], tuple]:
    return {(r["bag"], r["query_id"]): tuple(str(r[k]) for k in ANSWER_FIELDS) for r in RunFolder(out).read_rows()}


def bag_eval_answers(cfg) -> dict[tuple[str, str], tuple]:
    """Each bag through bag.evaluate with a freshly loaded pipeline, as `litevlm bag eval` runs it."""

    out = {}
    for bag in cfg.bags:
        scratch = scratch_folder() if bag.remote else None
        try:
            local = fetch_bag(bag.path, scratch).path if scratch else bag.path     # a bag on object storage
            for rec in evaluate(local, cfg.params):
                r = rec.to_json()
                out[(bag.key, r["query_id"])] = tuple(str(r[k]) for k in ANSWER_FIELDS)
        finally:
            if scratch:
                remove_scratch(scratch)
    return out


def _mean(bags, key: str) -> float:
    """The mean of a manifest field over the bags that have it (nan: none has: local bags fetch nothing)."""
    return float(np.mean([b[key] for b in bags if key in b] or [float("nan")]))


def scaling(make_config: Callable, sizes: list[int], out: Path, rounds: int = 1,
            versus_bag_eval: bool = False) -> tuple[str, dict]:
    out = Path(out)
    results: dict[int, list[dict]] = {n: [] for n in sizes}
    answers = {}
    for r in range(rounds):
        for n in sizes:
            folder = out / f"workers{n}-round{r}"
            if folder.exists():
                raise FileExistsError(f"{folder} exists: give bench a new --out")
            cfg = make_config(folder, n)
            load0 = os.getloadavg()[0]
            t0 = time.perf_counter()
            res = run_fleet(cfg)
            wall = time.perf_counter() - t0
            bags = RunFolder(folder).read_manifest()["bags"].values()
            cpu_per_bag = float(np.mean([b["cpu_s"] for b in bags if "cpu_s" in b] or [float("nan")]))
            results[n].append({"wall_s": wall, "answers": res.answers, "bags": len(res.complete),
                               "cpu_s_per_bag": cpu_per_bag, "wall_s_per_bag": _mean(bags, "wall_s"),
                               "fetch_s_per_bag": _mean(bags, "fetch_s"),
                               "fetch_mb_per_bag": _mean(bags, "fetch_bytes") / 1e6,
                               "failed": len(res.failed), "threads": res.threads,
                               "load_before": load0, "load_after": os.getloadavg()[0]})
            answers[(n, r)] = run_answers(folder)
            print(f"fleet bench: round {r + 1}/{rounds}, {n} worker(s) x {res.threads} thread(s): {wall:.1f} s, "
                  f"{res.answers} answers, load {load0:.1f} -> {os.getloadavg()[0]:.1f}", flush=True)
    reference = next(iter(answers.values()))
    identical = all(a == reference for a in answers.values())
    versus = None
    if versus_bag_eval:
        versus = bag_eval_answers(make_config(out / "unused", sizes[0])) == reference
    base = float(np.median([x["wall_s"] for x in results[sizes[0]]]))
    rows = []
    for n in sizes:
        walls = [x["wall_s"] for x in results[n]]
        med = float(np.median(walls))
        rows.append([n, results[n][0]["threads"], " ".join(f"{w:.1f}" for w in walls), med, med / base,
                     results[n][0]["answers"], results[n][0]["bags"] * 60.0 / med,
                     float(np.median([x["wall_s_per_bag"] for x in results[n]])),
                     float(np.median([x["cpu_s_per_bag"] for x in results[n]])),
                     float(np.median([x["fetch_mb_per_bag"] for x in results[n]])),
                     float(np.median([x["fetch_s_per_bag"] for x in results[n]])),
                     " ".join(f"{x['load_before']:.1f}/{x['load_after']:.1f}" for x in results[n])])
    text = table(["workers", "threads each", "wall s per round", "median s", f"vs {sizes[0]} worker(s)", "answers",
                  "bags/min", "s per bag", "CPU s per bag", "fetched MB per bag", "fetch s per bag",
                  "load avg before/after"], rows)
    text += (f"\nanswers identical across all {len(answers)} runs: {identical}"
             + (f"; identical to bag eval of each bag: {versus}" if versus is not None else ""))
    return text, {"results": {str(n): v for n, v in results.items()}, "identical": identical and versus is not False,
                  "identical_runs": identical, "identical_to_bag_eval": versus}
