"""One row of this project, run in its own process like every peer row:

    python -m litevlm_runtime.bench.peers.run_project JOB.json OUT.json

The pipeline (`baseline`: every camera, every visual token, greedy; or the deployed `litevlm`
pipeline: the modules the model folder carries) over the model folder with `backend.weights`
float | int8 | int4 | int4-rtn, at the package's own defaults (passive OpenMP waiting, its GEMM
choice), answering the same questions from the same image bytes. Per question: the answer's ids
(with the end-of-sequence id when the answer ended on one, so that a peer decodes the same number
of steps), time to first token (the first id out, measured by the answer's own on_tokens callback),
total wall time of `Pipeline.answer`, the pipeline's own stage times, the cameras encoded, and for
the agreement of prompts the prompt's ids (every `<IMG_CONTEXT>` as -1).

The feature cache is off (every question encodes its cameras, as every peer does: later questions
about the same frames would otherwise reuse the first one's vision); the first question is run
once untimed first (warm-up), as for every peer.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ...engines.torch_engine import TorchDecoder, TorchHead
from ...options import options_from_flat
from ...pipeline.pipeline import Pipeline, prompt_ids
from ...pipeline.runtime import set_threads
from ...weights import linear_forms
from ...weights.checkpoint import load_model
from ...weights.gemm import resolve_gemm, use_onednn
from ...weights.linear_forms import weight_bytes


def peak_rss_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 2 ** 20
    return 0.0


def build(job: dict):
    flat = {"pipeline": job["pipeline"], "backend.weights": job["weights"], "backend.threads": job["threads"],
            "serving.feature_cache": False, "max_new_tokens": job["max_new_tokens"], **job.get("options", {})}
    return Pipeline.from_pretrained(job["model"], options_from_flat(flat))


def answer(pipe, q: dict, images: dict[str, bytes]) -> dict:
    rt = pipe.rt
    first: list[float] = []

    def on_tokens(out):
        if not first:
            first.append(time.perf_counter())

    t0 = time.perf_counter()
    ans = pipe.answer(images, q["question"], on_tokens=on_tokens)
    total = time.perf_counter() - t0
    ids = list(ans.token_ids)
    ended = len(ids) < rt.options.max_new_tokens       # stopped on an end-of-sequence id, not the cap
    if ended:
        ids.append(min(rt.tok.eos_ids) if len(rt.tok.eos_ids) == 1 else rt.tok.im_end_id)
    stages = dict(ans.stage_ms)
    steps = max(ans.decode_steps, 1)
    res = {"id": q["id"], "ids": ids, "ended_on_eos": ended, "ttft_ms": ((first[0] if first else time.perf_counter())
                                                                          - t0) * 1e3,
           "total_ms": total * 1e3, "stage_ms": stages, "vision_ms": stages.get("vision", 0.0),
           "preprocess_ms": stages.get("preprocess", 0.0), "prefill_ms": stages.get("prefill", 0.0),
           "decode_ms_per_token": stages.get("decode", 0.0) / steps if ans.decode_steps else None,
           "cameras": list(ans.cameras), "vision_tiles": len(ans.cameras) * rt.options.tiles_per_camera,
           "tile_px": rt.cfg.force_image_size, "input_tokens": ans.input_tokens, "kept_tokens": ans.kept_tokens,
           "visual_tokens": ans.visual_tokens, "text": ans.text, "pipeline_label": ans.pipeline}
    if q.get("want_prompt"):
        seq, _ = prompt_ids(rt, list(ans.cameras), q["question"])
        res["prompt_seq"] = [-1 if i == rt.tok.img_context_id else int(i) for i in seq]
    return res


def decode_row(job: dict) -> dict:
    """The decode table's row (mode "decode"): the folder's language model through the project's
    torch engines (TorchDecoder / TorchHead: what `backend.name torch` runs) over a static KV cache,
    its linears in `backend.weights` form `weights`; the prompt ids in one call, then `tokens`
    greedy steps (each fed the row's own choice, or with `forced` the reference's). A warm-up of
    the prompt and two steps first."""
    set_threads(job["threads"])
    t0 = time.perf_counter()
    model = load_model(job["model"])
    model.vision_model, model.mlp1 = None, None          # the decode table reads the language model only
    lm = model.language_model
    weights = job["weights"]
    if weights != "float":
        linear_forms.convert_linears(model, weights, model_dir=job["model"])
    if resolve_gemm("auto", "cpu", torch.float32) == "onednn":
        use_onednn([lm])
    prompt, tokens, forced = job["prompt"], job["tokens"], job.get("forced")
    max_len = len(prompt) + tokens + 8
    lm.init_rope(max_len)
    cfg = lm.cfg
    k_cache = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, max_len, cfg.head_dim)
    v_cache = torch.zeros_like(k_cache)
    decoder, head = TorchDecoder(lm, k_cache, v_cache), TorchHead(lm)
    load_s = time.perf_counter() - t0
    one = torch.ones(1, 1, dtype=torch.bool)

    def start(ids):
        t = len(ids)
        causal = torch.ones(t, t, dtype=torch.bool).tril_()
        hidden = decoder.prefill(lm.embed(torch.tensor(ids)), torch.arange(t), causal)
        return int(head.run(hidden[-1:]).argmax(-1))

    def step(token, position):
        hidden = decoder.step(lm.embed(torch.tensor([token])), torch.tensor([position]), torch.tensor([position]),
                              torch.ones(1, position, dtype=torch.bool), one)
        return int(head.run(hidden).argmax(-1))

    with torch.inference_mode():
        token = start(prompt)
        for position in range(len(prompt), len(prompt) + 2):
            token = step(token, position)
        t0 = time.perf_counter()
        ids = [start(prompt)]
        prefill_s = time.perf_counter() - t0
        steps = []
        for position in range(len(prompt), len(prompt) + tokens):
            feed = forced[len(ids) - 1] if forced else ids[-1]
            s = time.perf_counter()
            ids.append(step(feed, position))
            steps.append((time.perf_counter() - s) * 1e3)
    head_module = getattr(lm, "lm_head", None)
    nbytes = weight_bytes(list(lm.layers) + [lm.norm, head_module if isinstance(head_module, nn.Module) else lm.embed])
    return {"decode": {"ids": ids, "prefill_s": prefill_s, "step_ms": steps, "decode_ms": sum(steps) / len(steps)},
            "weight_bytes": nbytes, "kv_element_bytes": 4, "load_s": load_s,
            "settings": {"weights": weights, "threads": job["threads"], "torch_threads": torch.get_num_threads()}}


def main(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    if job.get("mode") == "decode":
        out = decode_row(job)
        out["peak_rss_gb"] = peak_rss_gb()
        Path(out_path).write_text(json.dumps(out))
        return 0
    t0 = time.perf_counter()
    pipe = build(job)
    load_s = time.perf_counter() - t0
    rt = pipe.rt
    questions = job["questions"]
    images = {p: Path(p).read_bytes() for q in questions for p in q["images"].values()}
    out = {"load_s": load_s, "questions": [],
           "settings": {"pipeline": rt.options.label(), "weights": rt.options.backend.weights,
                        "threads": rt.options.threads(), "torch_threads": torch.get_num_threads(),
                        "gemm": str(rt.gemm), "backend": str(rt.engines.backend),
                        "decoding": rt.options.decoding.mode.value, "tokens": rt.options.tokens.mode.value,
                        "keep_ratio": rt.options.tokens.keep_ratio, "views": rt.options.views.mode.value,
                        "feature_cache": rt.options.serving.feature_cache,
                        "lowbit_prefill": getattr(rt.weights, "prefill", None) if rt.weights else None}}
    say = lambda m: print(m, file=sys.stderr, flush=True)      # noqa: E731
    first = questions[0]
    say(f"litevlm {job['pipeline']} {job['weights']}: warm-up on question {first['id']}")
    answer(pipe, first, {c: images[p] for c, p in first["images"].items()})
    for i, q in enumerate(questions):
        res = answer(pipe, q, {c: images[p] for c, p in q["images"].items()})
        out["questions"].append(res)
        say(f"litevlm {job['pipeline']} {job['weights']}: question {i + 1}/{len(questions)} "
            f"ttft {res['ttft_ms'] / 1e3:.1f} s total {res['total_ms'] / 1e3:.1f} s ({len(res['cameras'])} cameras)")
    out["peak_rss_gb"] = peak_rss_gb()
    Path(out_path).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
