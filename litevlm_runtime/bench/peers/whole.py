"""`litevlm bench --peers --whole`: whole six-camera questions, this project against the engines a
user runs VLMs with on a CPU, on the same weights, in one run (issue 43).

The work: DriveLM sample questions about key frames the bundled view selector did not train on
(its config's `frames_holdout`; the VLMs never trained on DriveLM), alternating between those
frames; each question with its frame's six camera JPEGs, the same files for every engine, one
tile per camera for every engine. Each row answers every question in its own process, greedy:

  litevlm    baseline   this project, every camera, every visual token, greedy (the reference:
                        float32's ids are what `agree` compares with)
  litevlm    litevlm    the deployed pipeline: the view selector, the token selector, EAGLE-2,
                        each where the model folder has it (at a preset's random weights: the
                        bundled view selector, tokens.mode layer0 at r 0.8, no draft head)
             weights    float (float32) | int8 | int4 (AWQ scales where the folder has them,
                        else int4-rtn)
  llama.cpp  baseline   libmtmd over the files llama.cpp's own converter writes (peers/files.py):
                        text model F16 | Q8_0 | Q4_0 (llama_model_quantize), mmproj F16
  openvino   parts      what OpenVINO can run of the same weights when optimum-intel cannot export the
                        folder (openvino_rows.py): the vision IR per camera, then OpenVINO GenAI's
                        LLMPipeline over a prompt of the same length; no agreement (run_openvino.py)

Rows alternate in rounds (the reference first, then the others, their order reversed every other
round), each a fresh process, the first question once untimed first. A peer decodes exactly as
many tokens per question as the reference did (its answer plus the end-of-sequence id where it
ended on one), so every engine does the same work and `agree` = equal greedy ids. Per question:
TTFT, total, vision ms, prefill ms, decode ms per token, tiles encoded, vision input bytes (tiles x
3 x S x S float32); per row: p50 / p90 over the questions of each question's median over rounds,
and its process's peak RSS. The memory bandwidth (bench/roofline.py, at the rows' thread count)
and the load average are measured before each round and printed with the table.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...bench.roofline import CAP_BYTES, measure_bandwidth
from ...cameras import CAMERAS
from ...errors import InputError
from ...evaluation.data import frame_images, load_frames
from ...report import table
from ...stages.prompt import IMAGE, image_line, model_layout
from ...timing import percentile
from ...weights.checkpoint import read_config
from . import env, openvino_rows
from .files import llama_files

DEFAULT_DATA = Path(__file__).resolve().parents[3].parent / "shared" / "drivelm_sample"


@dataclass(frozen=True)
class Row:
    engine: str          # litevlm | llama.cpp | openvino
    weights: str         # float | int8 | int4 | int4-rtn ; f16 | q8_0 | q4_0 ; fp16 | int8 | int4
    pipeline: str        # baseline | litevlm

    @property
    def key(self) -> str:
        return f"{self.engine} {self.pipeline} {self.weights}"


REFERENCE = Row("litevlm", "float", "baseline")


# ----------------------------------------------------------------------------- the work
def holdout_frames(model_dir: Path) -> list[str]:
    """Key frames the model's view selector did not train on (its training record), else []."""
    path = Path(model_dir) / "view_selector" / "config.json"
    if not path.is_file():
        return []
    return list(json.loads(path.read_text()).get("training", {}).get("frames_holdout", []))


def select_questions(data: Path, count: int, frames: list[str]) -> list[dict]:
    """`count` questions alternating over `frames` (in each frame's question order), with each
    frame's six image files."""
    qa = next(iter(sorted(Path(data).glob("qa_*.json"))), None)
    if qa is None:
        raise InputError(f"{data}: no qa_*.json (the DriveLM sample: ../shared/drivelm_sample)")
    by_token = {f.token: f for f in load_frames(qa)}
    chosen = [by_token[t] for t in frames if t in by_token] or list(by_token.values())[-2:]
    out, i = [], 0
    while len(out) < count and i < max(len(f.questions) for f in chosen):
        for f in chosen:
            if i < len(f.questions) and len(out) < count:
                images = frame_images(data, f)
                out.append({"id": f.questions[i].id, "question": f.questions[i].question,
                            "images": {c: str(images[c]) for c in CAMERAS}})
        i += 1
    return out


def prompt_text(model_dir: Path, question: str, cameras) -> str:
    """The prompt this project builds for the question (stages/prompt.py), as text with an
    `<image>` where each camera's `<img>...</img>` goes: what a peer tokenizes itself."""
    layout, _ = model_layout(model_dir)
    line = image_line(layout, len(cameras))
    system = read_config(model_dir).system_message
    lines = "".join(line.replace("{camera}", c).replace("{index}", str(i)).replace(IMAGE, "<image>")
                    for i, c in enumerate(cameras, 1))
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{lines}{question}<|im_end|>\n" \
           f"<|im_start|>assistant\n"


# ----------------------------------------------------------------------------- rows
def project_int4(model_dir: Path) -> str:
    return "int4" if (Path(model_dir) / "quantized-int4" / "quantization.json").is_file() else "int4-rtn"


def plan_rows(engines, weights, gguf, pipelines, model_dir: Path,
              openvino=("int8", "int4")) -> tuple[list[Row], dict[str, str]]:
    """The rows to run and, for each engine that cannot run here, why not."""
    rows, skipped = [], {}
    for engine in engines:
        if engine == "litevlm":
            for pipeline in pipelines:
                for w in weights:
                    rows.append(Row("litevlm", project_int4(model_dir) if w == "int4" else w, pipeline))
        elif engine == "llama.cpp":
            why = env.llama_cpp_missing()
            if why:
                skipped["llama.cpp"] = why
            else:
                rows += [Row("llama.cpp", g, "baseline") for g in gguf]
        elif engine == "openvino":
            why = env.openvino_missing()
            if why:
                skipped["openvino"] = why
            else:
                rows += [Row("openvino", w, "parts") for w in openvino]
    if REFERENCE in rows:
        rows.remove(REFERENCE)
    return [REFERENCE] + rows, skipped


def project_options(model_dir: Path, pipeline: str) -> dict:
    """What the deployed pipeline runs where the folder lacks a trained module (random weights)."""
    if pipeline == "litevlm" and not (Path(model_dir) / "token_selector" / "model.safetensors").is_file():
        return {"tokens.mode": "layer0"}
    return {}


def run_row(row: Row, ctx: dict, rnd: int) -> dict:
    work: Path = ctx["work"]
    name = f"{rnd}-{row.key.replace(' ', '_')}"
    job, out = work / f"job-{name}.json", work / f"out-{name}.json"
    out.unlink(missing_ok=True)
    ref = ctx["reference"]
    if row.engine == "litevlm":
        questions = [dict(q, want_prompt=row == REFERENCE and rnd == 0) for q in ctx["questions"]]
        job.write_text(json.dumps({"model": str(ctx["model"]), "pipeline": row.pipeline, "weights": row.weights,
                                   "threads": ctx["threads"], "max_new_tokens": ctx["new_tokens"],
                                   "options": project_options(ctx["model"], row.pipeline), "questions": questions}))
        env.run_project(job, out, ctx["log"], row.key)
    elif row.engine == "llama.cpp":
        files = ctx["gguf"]
        questions = [{"id": q["id"], "prompt": prompt_text(ctx["model"], q["question"], list(q["images"])),
                      "images": list(q["images"].values()), "new_tokens": len(ref[q["id"]]["ids"])}
                     for q in ctx["questions"]]
        longest = max(len(r.get("prompt_seq", [])) for r in ref.values()) if ref else 4096
        tiles = 1 if ctx["llama_preprocess"] == "tile" else 2           # mtmd's own: tile + overview
        job.write_text(json.dumps({"mode": "whole", "model": str(files[row.weights]), "mmproj": str(files["mmproj"]),
                                   "threads": ctx["threads"], "preprocess": ctx["llama_preprocess"],
                                   "tile": read_config(ctx["peer"]).force_image_size,
                                   "n_ctx": tiles * max(longest, 512) + ctx["new_tokens"] + 64,
                                   "questions": questions}))
        env.run_script(sys.executable, env.HERE / "run_llama_cpp.py", [str(job), str(out)], ctx["log"])
    else:
        openvino_rows.run(row, ctx, job, out)
    return json.loads(out.read_text())


# ----------------------------------------------------------------------------- the study
@dataclass(frozen=True)
class WholeSettings:
    """How every row of the study runs (`bench --peers --whole`'s flags): `rounds` alternating rounds,
    `threads` per row, up to `new_tokens` new tokens, llama.cpp's image preprocessing `llama_preprocess`
    (tile | mtmd: run_llama_cpp.py)."""
    rounds: int
    threads: int
    new_tokens: int
    llama_preprocess: str = "tile"


def run_whole(model_dir: Path, peer_dir: Path, cache: Path, questions: list[dict], rows: list[Row],
              skipped: dict[str, str], settings: WholeSettings, progress=print) -> dict:
    rounds, threads, new_tokens = settings.rounds, settings.threads, settings.new_tokens
    work = Path(cache) / "runs" / time.strftime("%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    ctx = {"model": Path(model_dir), "peer": Path(peer_dir), "questions": questions, "threads": threads,
           "new_tokens": new_tokens, "work": work, "log": work / "rows.log", "reference": {}, "cache": Path(cache),
           "llama_preprocess": settings.llama_preprocess}
    gguf_forms = [r.weights for r in rows if r.engine == "llama.cpp"]
    if gguf_forms:
        ctx["gguf"] = llama_files(peer_dir, cache, gguf_forms, progress)
    if any(r.engine == "openvino" for r in rows):
        ctx["openvino"] = openvino_rows.prepare(peer_dir, cache, [r.weights for r in rows if r.engine == "openvino"],
                                                progress)
    results: dict[Row, list[dict]] = {r: [] for r in rows}
    failed: dict[Row, str] = {}
    bandwidth, loads = [], []

    torch.set_num_threads(threads)
    for rnd in range(rounds):
        bw = measure_bandwidth(CAP_BYTES)
        bandwidth.append(bw.read_gbs)
        loads.append(os.getloadavg()[0])
        progress(f"[round {rnd + 1}/{rounds}] memory bandwidth (read, {threads} threads) {bw.read_gbs:.1f} GB/s; "
                 f"load {loads[-1]:.2f}; log {ctx['log']}")
        others = rows[1:] if rnd % 2 == 0 else rows[1:][::-1]
        for row in [rows[0]] + others:
            if row in failed:
                continue
            t0 = time.perf_counter()
            try:
                res = run_row(row, ctx, rnd)
            except RuntimeError as exc:
                failed[row] = str(exc).splitlines()[0]
                progress(f"  {row.key}: FAILED: {failed[row]}")
                continue
            results[row].append(res)
            if row == REFERENCE and not ctx["reference"]:
                ctx["reference"] = {q["id"]: q for q in res["questions"]}
            med = statistics.median(q["total_ms"] for q in res["questions"]) / 1e3
            progress(f"  {row.key:<32} median total {med:6.1f} s  ({time.perf_counter() - t0:.0f} s with load)")
    loads.append(os.getloadavg()[0])
    return {"rows": results, "failed": failed, "skipped": skipped, "bandwidth_gbs": bandwidth, "loads": loads,
            "reference": ctx["reference"], "questions": questions, "threads": threads, "new_tokens": new_tokens,
            "work": str(work)}


# ----------------------------------------------------------------------------- the table
METRICS = ("ttft_ms", "total_ms", "preprocess_ms", "vision_ms", "prefill_ms", "decode_ms_per_token")


def summarize_row(row: Row, runs: list[dict], reference: dict) -> dict:
    """Per question the median over rounds, then p50 / p90 over the questions."""
    per_q: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for q in run["questions"]:
            d = per_q.setdefault(q["id"], {m: [] for m in METRICS})
            for m in METRICS:
                if q.get(m) is not None:
                    d[m].append(q[m])
    med = {m: [statistics.median(d[m]) for d in per_q.values() if d[m]] for m in METRICS}
    first = runs[0]["questions"]
    ids = {q["id"]: q["ids"] for q in first}
    # OpenVINO's rows run the language model over the prompt's length, not the images' features:
    # their ids are not an answer to compare (run_openvino.py)
    agree = [ids[k] == v["ids"] for k, v in reference.items() if k in ids] if row.engine != "openvino" else []
    stable = all({q["id"]: q["ids"] for q in r["questions"]} == ids for r in runs)
    ref_seq = {k: v.get("prompt_seq") for k, v in reference.items()}
    prompts = [q["prompt_seq"] == ref_seq[q["id"]] for q in first if q.get("prompt_seq") is not None
               and ref_seq.get(q["id"]) is not None and row != REFERENCE]
    tiles = statistics.mean(q.get("vision_tiles", 0) for q in first)
    tile_px = next((q.get("tile_px") for q in reference.values() if q.get("tile_px")), 448)
    out = {"engine": row.engine, "weights": row.weights, "pipeline": row.pipeline,
           "agree": sum(agree) / len(agree) if agree else None, "ids_stable_over_rounds": stable,
           "prompt_ids_equal": sum(prompts) / len(prompts) if prompts else None,
           "tiles_per_question": tiles, "vision_mb": tiles * 3 * tile_px * tile_px * 4 / 1e6,
           "new_tokens": statistics.mean(len(q["ids"]) for q in first),
           "peak_rss_gb": max(r.get("peak_rss_gb", 0.0) for r in runs), "rounds": len(runs),
           "settings": runs[0].get("settings", {}), "environment": runs[0].get("environment", {})}
    for m in METRICS:
        base = m.replace("_ms", "").replace("_per_token", "")
        out[f"{base}_ms_p50"] = percentile(med[m], 50) if med[m] else None
        out[f"{base}_ms_p90"] = percentile(med[m], 90) if med[m] else None
    return out


def summarize(study: dict) -> list[dict]:
    rows = [summarize_row(row, runs, study["reference"]) for row, runs in study["rows"].items() if runs]
    peers = [r for r in rows if r["engine"] != "litevlm"]
    fastest = min((r["total_ms_p50"] for r in peers), default=None)
    for r in rows:
        r["x_fastest_peer_total"] = fastest / r["total_ms_p50"] if fastest else None
    return rows


def fmt_s(ms) -> str:
    """Seconds, two decimals below 10 s (the tiny preset's figures), one above."""
    if ms is None:
        return "-"
    return f"{ms / 1e3:.2f}" if ms < 1e4 else f"{ms / 1e3:.1f}"


def whole_table(study: dict, rows: list[dict], header: str) -> str:
    lines = []
    for r in rows:
        lines.append([r["engine"], r["pipeline"], r["weights"], f"{r['tiles_per_question']:.1f}",
                      f"{r['vision_mb']:.1f}", f"{fmt_s(r['ttft_ms_p50'])} / {fmt_s(r['ttft_ms_p90'])}",
                      f"{fmt_s(r['total_ms_p50'])} / {fmt_s(r['total_ms_p90'])}", fmt_s(r["preprocess_ms_p50"]),
                      fmt_s(r["vision_ms_p50"]),
                      fmt_s(r["prefill_ms_p50"]),
                      "-" if r["decode_ms_p50"] is None else f"{r['decode_ms_p50']:.0f}",
                      f"{r['new_tokens']:.1f}",
                      "-" if r["agree"] is None else f"{r['agree']:.2f}" + ("" if r["ids_stable_over_rounds"] else "*"),
                      "-" if r["x_fastest_peer_total"] is None else f"{r['x_fastest_peer_total']:.2f}",
                      f"{r['peak_rss_gb']:.1f}"])
    for row, why in study["failed"].items():
        lines.append([row.engine, row.pipeline, row.weights, f"failed: {why}"] + [""] * 11)
    for engine, why in study["skipped"].items():
        lines.append([engine, "", "", f"skipped: {why}"] + [""] * 11)
    headers = ["engine", "pipeline", "weights", "tiles", "vision MB", "TTFT p50/p90 s", "total p50/p90 s",
               "preproc s", "vision s", "prefill s", "decode ms/tok", "new tok", "agree", "x fastest peer",
               "peak RSS GB"]
    settings = "\n".join(f"  {r['engine']} {r['pipeline']} {r['weights']}: " + settings_line(r) for r in rows)
    verdicts = "\n".join(f"  {v}" for v in verdict(rows))
    return (f"{header}\n\n{table(headers, lines)}\n\nagainst issue 43's targets (p50s of this run):\n{verdicts}"
            f"\n\nsettings of each row (and what its process inherited):\n{settings}")


# Which peer rows run the same weight format as this project's `weights` (for the "engine at least
# level" comparison): float32 against llama.cpp's F16 (its unquantized form), int8 against Q8_0 and
# OpenVINO int8, int4 against Q4_0 and OpenVINO int4.
SAME_FORMAT = {"float": ("f16",), "int8": ("q8_0", "int8"), "int4": ("q4_0", "int4"), "int4-rtn": ("q4_0", "int4")}


def verdict(rows: list[dict]) -> list[str]:
    """Issue 43's questions of the table, answered from it (p50 over the questions)."""
    peers = [r for r in rows if r["engine"] != "litevlm" and r["total_ms_p50"]]
    ours = [r for r in rows if r["engine"] == "litevlm" and r["total_ms_p50"]]
    if not peers or not ours:
        return []
    name = lambda r: f"{r['engine']} {r['pipeline']} {r['weights']}"      # noqa: E731
    fastest = min(peers, key=lambda r: r["total_ms_p50"])
    out = []
    deployed = [r for r in ours if r["pipeline"] == "litevlm"]
    if deployed:
        best = min(deployed, key=lambda r: r["total_ms_p50"])
        ratio = fastest["total_ms_p50"] / best["total_ms_p50"]
        lowest = min(r["ttft_ms_p50"] for r in peers)
        out.append(f"deployed pipeline ({name(best)}) end to end: {ratio:.2f}x the fastest peer row ({name(fastest)}); "
                   f"target >= 3x: {'met' if ratio >= 3 else 'not met'}")
        lower = best["ttft_ms_p50"] < lowest
        out.append(f"its TTFT {fmt_s(best['ttft_ms_p50'])} s against the lowest peer TTFT {fmt_s(lowest)} s: "
                   f"{'lower than every peer' if lower else 'not lower than every peer'}")
    for r in ours:
        if r["pipeline"] != "baseline":
            continue
        same = [p for p in peers if p["weights"] in SAME_FORMAT.get(r["weights"], ())]
        if same:
            peer = min(same, key=lambda p: p["total_ms_p50"])
            ratio = peer["total_ms_p50"] / r["total_ms_p50"]
            out.append(f"baseline {r['weights']}: {ratio:.2f}x the fastest peer of its format ({name(peer)}), "
                       f"vision {ratio_text(peer['vision_ms_p50'], r['vision_ms_p50'])}, prefill "
                       f"{ratio_text(peer['prefill_ms_p50'], r['prefill_ms_p50'])}, decode/token "
                       f"{ratio_text(peer['decode_ms_p50'], r['decode_ms_p50'])} (peer / ours: > 1 = ours faster); "
                       f"at least level: {'yes' if ratio >= 1 else 'no'}")
    return out


def ratio_text(peer_ms, ours_ms) -> str:
    return "-" if not peer_ms or not ours_ms else f"{peer_ms / ours_ms:.2f}x"


def settings_line(r: dict) -> str:
    s = dict(r["settings"])
    envc = r.get("environment") or {}
    if envc:
        s["imports litevlm"] = envc.get("imports_litevlm")
        s["OMP/KMP/MKL env"] = envc.get("thread_env") or "none"
        if envc.get("openmp_runtime"):
            s["threading runtime"] = ",".join(Path(p).name for p in envc["openmp_runtime"])
    return ", ".join(f"{k} {v}" for k, v in s.items())


def whole_plot(rows: list[dict], path: Path, title: str) -> None:
    """Stacked bars per row: vision, prefill, decode (p50 seconds), TTFT marked."""
    # matplotlib: optional (plots only), imported where a plot is asked for
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['engine']}\n{r['pipeline']} {r['weights']}" for r in rows]
    pre = [(r["preprocess_ms_p50"] or 0) / 1e3 for r in rows]
    vision = [(r["vision_ms_p50"] or 0) / 1e3 for r in rows]
    prefill = [(r["prefill_ms_p50"] or 0) / 1e3 for r in rows]
    total = [(r["total_ms_p50"] or 0) / 1e3 for r in rows]
    rest = [max(t - a - v - p, 0) for t, a, v, p in zip(total, pre, vision, prefill)]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rows)), 5))
    x = range(len(rows))
    bottom = [0.0] * len(rows)
    for values, label in ((pre, "preprocess"), (vision, "vision"), (prefill, "prefill"), (rest, "decode + rest")):
        ax.bar(x, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter(x, [(r["ttft_ms_p50"] or 0) / 1e3 for r in rows], color="k", marker="_", s=400, label="TTFT p50",
               zorder=3)
    ax.set_xticks(list(x), labels, fontsize=7)
    ax.set_ylabel("seconds per question (p50)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
