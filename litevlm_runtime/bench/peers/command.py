"""`litevlm bench --peers [--whole]`: the flags' meaning and the printed report (commands/bench.py
registers the flags and calls `run_peers`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from ...errors import InputError
from .decode import run_decode_command
from .files import weights_digest
from .flags import ENGINES, GGUF, OPENVINO, PIPELINES, WEIGHTS, cpu_line, split
from .models import BUNDLED, peer_form, study_checkpoint
from .whole import (
    DEFAULT_DATA,
    WholeSettings,
    holdout_frames,
    plan_rows,
    run_whole,
    select_questions,
    summarize,
    whole_plot,
    whole_table,
)

DEFAULT_CACHE = Path("/tmp/litevlm-peers")


def resolve_model(args, cache: Path, progress) -> Path:
    """--model DIR as given, --preset NAME as a random-weight checkpoint in the cache (written once)."""
    if args.model:
        return Path(args.model)
    return study_checkpoint(cache / "checkpoints" / f"{args.preset}-seed{args.seed}", args.preset, args.seed, progress)


def check_flags(args) -> None:
    """Every flag's value checked before anything is written or started, naming the flag."""
    if not args.model and not args.preset:
        raise InputError("litevlm bench --peers: --model DIR or --preset NAME (e.g. internvl3-2b)")
    for name in ("rounds", "threads", "new_tokens", "prompt", "tokens"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be 1 or more")
    if args.questions is not None and args.questions < 1:
        raise InputError(f"--questions {args.questions}: must be 1 or more")
    for flag, value, default, allowed in (("--engines", args.engines, ",".join(ENGINES), ENGINES),
                                          ("--gguf", args.gguf, ",".join(GGUF), GGUF),
                                          ("--openvino", args.openvino, ",".join(OPENVINO), OPENVINO),
                                          ("--pipelines", args.pipelines, ",".join(PIPELINES), PIPELINES),
                                          ("--weights", args.weights, "float,int8,int4", WEIGHTS)):
        values = split(value, default)
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise InputError(f"{flag}: {bad[0] if bad else value!r} is not one of {', '.join(allowed)}"
                             if bad else f"{flag}: empty")
    if args.model and not Path(args.model).is_dir():
        raise InputError(f"--model {args.model}: no such folder")
    if (args.hog or 0) < 0:
        raise InputError(f"--hog {args.hog}: must be 0 or more")


def run_peers(args) -> int:
    check_flags(args)
    say = lambda m: print(m, file=sys.stderr, flush=True)      # noqa: E731
    cache = Path(args.cache or DEFAULT_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args, cache, say)
    if args.whole:
        return run_whole_command(args, model, cache, say)

    return run_decode_command(args, model, cache, say)


def run_whole_command(args, model: Path, cache: Path, say) -> int:
    data = Path(args.drivelm or DEFAULT_DATA)
    if not data.is_dir():
        raise InputError(f"--drivelm {data}: no such folder (the DriveLM sample, ../shared/drivelm_sample)")
    count = args.questions or 4
    new_tokens = args.new_tokens
    engines, weights = split(args.engines, ",".join(ENGINES)), split(args.weights, "float,int8,int4")
    gguf, pipelines = split(args.gguf, ",".join(GGUF)), split(args.pipelines, ",".join(PIPELINES))

    frames = holdout_frames(model) or holdout_frames(BUNDLED)
    questions = select_questions(data, count, frames)
    peer = peer_form(model, cache / "peer-forms" / weights_digest(model), say)
    rows, skipped = plan_rows(engines, weights, gguf, pipelines, model, split(args.openvino, ",".join(OPENVINO)))
    for engine, why in skipped.items():
        say(f"skipping {engine}: {why}")
    say(f"model {model} (peers read {peer}); {len(questions)} questions of key frames {', '.join(frames)}; "
        f"rows: {', '.join(r.key for r in rows)}")
    study = run_whole(model, peer, cache, questions, rows, skipped,
                      WholeSettings(args.rounds, args.threads, new_tokens, args.llama_preprocess), say)
    summary = summarize(study)
    header = (f"{cpu_line()}\n{args.threads} threads per row; {len(questions)} DriveLM sample questions (the "
              f"first {-(-len(questions) // max(len(frames), 1))} of each of key frames "
              f"{', '.join(f[:8] for f in frames)}, alternating: frames the bundled view selector did not train "
              f"on); six cameras, one tile each; up to {new_tokens} new tokens (a peer decodes as many as the "
              f"reference did); {args.rounds} round(s), rows alternating, each row a fresh process\n"
              f"memory bandwidth (read, {args.threads} threads, before each round): "
              + ", ".join(f"{b:.1f}" for b in study["bandwidth_gbs"]) + " GB/s; 1-min load average "
              + ", ".join(f"{v:.2f}" for v in study["loads"])
              + f"\nmodel {model}; agree = greedy ids equal to litevlm baseline float's (* = varied between rounds); "
              "x fastest peer = the fastest peer row's total p50 / this row's")
    print(whole_table(study, summary, header))
    vlm = _vlm_export_line(cache, peer)
    if vlm:
        print("\n" + vlm)
    if args.json:
        payload = {"rows": summary, "bandwidth_gbs": study["bandwidth_gbs"], "loads": study["loads"],
                   "questions": [q["id"] for q in questions], "threads": args.threads, "model": str(model),
                   "cpu": cpu_line(), "failed": {r.key: w for r, w in study["failed"].items()},
                   "skipped": study["skipped"], "per_question": {r.key: runs for r, runs in study["rows"].items()}}
        if args.json == "-":
            print(json.dumps(payload, indent=1))
        else:
            Path(args.json).write_text(json.dumps(payload, indent=1))
            print(f"\njson: {args.json}")
    if args.plot and summary:
        whole_plot(summary, Path(args.plot), f"{model.name}: p50 per question, {args.threads} threads")
        print(f"plot: {args.plot}")
    return 0


def _vlm_export_line(cache: Path, peer: Path) -> str:
    path = cache / weights_digest(peer) / "openvino" / "vlm-attempt" / "export-vlm.json"
    if not path.is_file():
        return ""
    record = json.loads(path.read_text())
    if record["ok"]:
        return "optimum-intel exported the InternVL folder (image-text-to-text)."
    return ("openvino rows are parts (vision IR + LLMPipeline over a prompt of the same length; no agreement): "
            f"optimum-intel's InternVL export of {peer} failed: {record['error'].splitlines()[0][:400]}")
