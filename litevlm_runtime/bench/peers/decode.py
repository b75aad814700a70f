"""`litevlm bench --peers` (without --whole): the decode step of the language model, this project
against llama.cpp and OpenVINO GenAI at their own defaults, on the same weights (the model
folder's language model: at `--preset internvl3-2b`, Qwen2.5-1.5B's widths with upstream's
vocabulary and tied head), every row in its own process, in alternating rounds.

  litevlm    this project's decoder and torch engines in `backend.weights` float | int8 | int4
             (int4-rtn where the folder has no AWQ scales), at the package's defaults
  llama.cpp  the text model files of llama.cpp's own converter and quantizer (peers/files.py:
             F16, Q8_0, Q4_0 with llama-quantize's default tensor types), llama_decode one
             token at a time, its own defaults (OpenMP, n_batch 2048, F16 KV cache)
  openvino   optimum-cli's IR of the same language model (int8, int4 at optimum's defaults) run
             by OpenVINO GenAI's LLMPipeline (generate over the prompt ids, ignore_eos)

Each row: the same `--prompt` random ids (seeded), then `--tokens` greedy steps; decode ms/token
per round, the best round, step p50 / p99 (per step where the engine exposes steps), prefill of
the prompt, bytes a step reads, the floor that bandwidth allows (bench/roofline.py, measured in the
same run) and the best round's fraction of it, agreement with litevlm float (teacher-forced for
the rows that take fed tokens; GenAI runs free: common prefix), peak RSS. With `--hog N` every row
is also run beside N busy processes (`litevlm bench --contention`'s hogs) in the same round: the
loaded median and its ratio to the quiet one.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from ...bench.contention import Hog
from ...bench.roofline import CAP_BYTES, measure_bandwidth
from ...report import table
from ...timing import percentile
from ...weights.checkpoint import read_config
from . import env, openvino_rows
from .files import llama_files, weights_digest
from .flags import ENGINES, cpu_line, split
from .models import peer_form
from .whole import project_int4


def run_decode_command(args, model: Path, cache: Path, say) -> int:
    rows, skipped = decode_rows(args, model)
    peer = peer_form(model, cache / "peer-forms" / weights_digest(model), say)
    files = {}
    if any(e == "llama.cpp" for e, _ in rows):
        files["gguf"] = llama_files(peer, cache, [w for e, w in rows if e == "llama.cpp"], say)
    if any(e == "openvino" for e, _ in rows):
        files["openvino"] = openvino_rows.prepare(peer, cache, [w for e, w in rows if e == "openvino"], say)
    cfg = read_config(model).llm
    prompt = random.Random(args.seed).choices(range(min(cfg.vocab_size, 150000)), k=args.prompt)
    work = cache / "runs" / ("decode-" + time.strftime("%Y%m%d-%H%M%S"))
    work.mkdir(parents=True, exist_ok=True)
    hog = args.hog or 0
    results, reference, bandwidth, loads = run_rounds(args, model, rows, files, prompt, work, say)
    text, summary = decode_table(rows, results, reference or [], bandwidth, cfg, args.prompt, args.tokens, hog)
    head = (f"{cpu_line()}\n{args.threads} threads; prompt {args.prompt} ids, then {args.tokens} greedy steps; "
            f"{args.rounds} alternating rounds, each row a fresh process; 1-min load average "
            + ", ".join(f"{v:.2f}" for v in loads)
            + f"\nmemory bandwidth (read, {args.threads} threads, before each round): "
            + ", ".join(f"{b:.1f}" for b in bandwidth) + f" GB/s; floors use the highest\nmodel {model}")
    skip = "".join(f"\nskipped {e}: {w}" for e, w in skipped.items())
    print(f"{head}\n\n{text}{skip}")
    if args.json:
        payload = {"rows": summary, "bandwidth_gbs": bandwidth, "loads": loads, "cpu": cpu_line(),
                   "threads": args.threads, "hog": hog}
        if args.json == "-":
            print(json.dumps(payload, indent=1))
        else:
            Path(args.json).write_text(json.dumps(payload, indent=1))
            print(f"\njson: {args.json}")
    return 0


def decode_rows(args, model: Path) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """The (engine, weights) rows --engines, --weights, --gguf and --openvino ask for, and the engines
    skipped (engine -> why: not installed)."""
    rows: list[tuple[str, str]] = []
    skipped = {}
    for engine in split(args.engines, ",".join(ENGINES)):
        if engine == "litevlm":
            forms = split(args.weights, "float,int8,int4")
            rows += [("litevlm", project_int4(model) if w == "int4" else w) for w in forms]
        elif engine == "llama.cpp":
            why = env.llama_cpp_missing()
            if why:
                skipped[engine] = why
            else:
                rows += [("llama.cpp", g) for g in split(args.gguf, "f16,q8_0,q4_0")]
        else:
            why = env.openvino_missing()
            if why:
                skipped[engine] = why
            else:
                rows += [("openvino", w) for w in split(args.openvino, "int8,int4")]
    return rows, skipped


def run_rounds(args, model: Path, rows, files: dict, prompt: list[int], work: Path, say):
    """--rounds alternating rounds of every row (the reference, litevlm float, first in each), quiet and,
    with --hog N, beside N busy processes: (results by (engine, weights, busy), the reference's ids,
    the memory bandwidth before each round, the load averages)."""
    log = work / "rows.log"
    hog = args.hog or 0
    results: dict[tuple[str, str, int], list[dict]] = {}
    reference: list[int] | None = None
    bandwidth, loads = [], []
    torch.set_num_threads(args.threads)
    conditions = [0, hog] if hog else [0]
    for rnd in range(args.rounds):
        bw = measure_bandwidth(CAP_BYTES)
        bandwidth.append(bw.read_gbs)
        loads.append(os.getloadavg()[0])
        say(f"[round {rnd + 1}/{args.rounds}] bandwidth (read, {args.threads} threads) {bw.read_gbs:.1f} GB/s; "
            f"load {loads[-1]:.2f}; log {log}")
        order = rows if rnd % 2 == 0 else rows[::-1]
        if ("litevlm", "float") in order:            # the reference first, for teacher forcing
            order = [("litevlm", "float")] + [r for r in order if r != ("litevlm", "float")]
        for engine, weights in order:
            for busy in conditions:
                spec = {"mode": "decode", "threads": args.threads, "prompt": prompt, "tokens": args.tokens,
                        "forced": reference if (engine, weights) != ("litevlm", "float") else None}
                with Hog(busy, "spin"):
                    name = work / f"{rnd}-{engine}-{weights}-{busy}"
                    res = run_row(args, model, (engine, weights), files, spec, name)
                results.setdefault((engine, weights, busy), []).append(res)
                if (engine, weights) == ("litevlm", "float") and reference is None and busy == 0:
                    reference = res["decode"]["ids"]
                d = res["decode"]
                say(f"  {engine:<10} {weights:<8} {'beside ' + str(busy) + ' busy' if busy else 'quiet':<14} "
                    f"decode {d['decode_ms']:7.1f} ms/token  prefill {d['prefill_s']:5.2f} s  "
                    f"peak {res.get('peak_rss_gb', 0):.1f} GB")
    loads.append(os.getloadavg()[0])
    return results, reference, bandwidth, loads


def run_row(args, model: Path, row: tuple[str, str], files: dict, spec: dict, name: Path) -> dict:
    """One row's decode job in its own process (job and output files beside `name`): its result."""
    engine, weights = row
    log = name.parent / "rows.log"
    job, out = name.parent / f"job-{name.name}.json", name.parent / f"out-{name.name}.json"
    if engine == "litevlm":
        job.write_text(json.dumps(dict(spec, model=str(model), weights=weights)))
        env.run_project(job, out, log, f"litevlm {weights}")
    elif engine == "llama.cpp":
        job.write_text(json.dumps(dict(spec, model=str(files["gguf"][weights]),
                                       n_ctx=args.prompt + args.tokens + 64)))
        env.run_script(sys.executable, env.HERE / "run_llama_cpp.py", [str(job), str(out)], log)
    else:
        job.write_text(json.dumps(dict(spec, llm=str(files["openvino"]["llm"][weights]))))
        env.run_script(env.openvino_python(), env.HERE / "run_openvino.py", ["run", str(job), str(out)], log)
    return json.loads(out.read_text())


def decode_table(rows, results, reference, bandwidth, cfg, prompt_len, tokens, hog) -> tuple[str, list[dict]]:
    best_bw = max(bandwidth)
    context = prompt_len + tokens / 2
    lines, summary = [], []
    for engine, weights in rows:
        quiet = results.get((engine, weights, 0), [])
        if not quiet:
            continue
        per_round = [r["decode"]["decode_ms"] for r in quiet]
        best = min(per_round)
        steps = [m for r in quiet for m in r["decode"].get("step_ms", [])]
        p50, p99 = (percentile(steps, 50), percentile(steps, 99)) if steps else (None, None)
        kv_elem = 4 if engine == "litevlm" else 2
        kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * kv_elem * context
        wbytes = quiet[0].get("weight_bytes") or 0
        nbytes = wbytes + kv
        floor = nbytes / (best_bw * 1e9) * 1e3
        ids = quiet[0]["decode"]["ids"]
        forced = engine != "litevlm" or weights != "float"
        if not reference:
            agree = "-"
        elif (engine, weights) == ("litevlm", "float"):
            agree = "(reference)"
        elif engine == "openvino":
            same = next((i for i, (a, b) in enumerate(zip(ids, reference)) if a != b), min(len(ids), len(reference)))
            agree = f"first {same}/{len(reference)} (free)"
        else:
            agree = f"{sum(a == b for a, b in zip(ids, reference))}/{len(reference)} steps" if forced else "-"
        loaded = [r["decode"]["decode_ms"] for r in results.get((engine, weights, hog), [])] if hog else []
        row = {"engine": engine, "weights": weights, "decode_ms": per_round, "best_ms": best,
               "median_ms": statistics.median(per_round), "step_p50_ms": p50, "step_p99_ms": p99,
               "prefill_s": [r["decode"]["prefill_s"] for r in quiet], "bytes_per_token": nbytes, "floor_ms": floor,
               "fraction_of_floor": floor / best, "agree": agree,
               "peak_rss_gb": max(r.get("peak_rss_gb", 0) for r in quiet),
               "hog": hog, "loaded_ms": loaded, "loaded_median_ms": statistics.median(loaded) if loaded else None,
               "settings": quiet[0].get("settings", {}), "environment": quiet[0].get("environment", {})}
        summary.append(row)
        pre = row["prefill_s"]
        line = [engine, weights, ", ".join(f"{m:.0f}" for m in per_round), f"{best:.1f}",
                "-" if p50 is None else f"{p50:.0f} / {p99:.0f}",
                f"{min(pre):.2f}-{max(pre):.2f}", f"{nbytes / 1e6:,.0f}", f"{floor:.0f}", f"{floor / best:.2f}"]
        if hog:
            line += ["-" if not loaded else f"{row['loaded_median_ms']:.0f}",
                     "-" if not loaded else f"{row['loaded_median_ms'] / row['median_ms']:.2f}"]
        lines.append(line + [agree, f"{row['peak_rss_gb']:.1f}"])
    headers = ["engine", "weights", "decode ms/token (rounds)", "best", "step p50 / p99", f"prefill {prompt_len}, s",
               "MB per token", "floor ms", "fraction of floor"]
    if hog:
        headers += [f"--hog {hog}: ms/token", "loaded / quiet"]
    headers += ["argmax = litevlm float's", "peak RSS GB"]
    settings = "\n".join(f"  {r['engine']} {r['weights']}: " + ", ".join(f"{k} {v}" for k, v in r["settings"].items())
                         + ("; inherited OMP/KMP/MKL env: " + str(r["environment"].get("thread_env") or "none")
                            if r["environment"] else "") for r in summary)
    return f"{table(headers, lines)}\n\nsettings:\n{settings}", summary
