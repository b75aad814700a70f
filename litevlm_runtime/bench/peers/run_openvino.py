"""OpenVINO's rows, run as a standalone script by the OpenVINO venv's python (.venv-openvino:
optimum-intel, OpenVINO GenAI and their pins), in its own process, never importing litevlm_runtime:

    python run_openvino.py export-vlm MODEL_DIR OUT_DIR       (try optimum's InternVL export)
    python run_openvino.py export-llm LLM_DIR OUT_DIR int8|int4
    python run_openvino.py run JOB.json OUT.json

export-vlm: optimum-intel's `main_export(task="image-text-to-text")` over the InternVL folder, which
is what a user runs to get a VLMPipeline folder. Its outcome (the exception's message when it fails)
goes to OUT_DIR/export-vlm.json.

export-llm: `optimum-cli export openvino --task text-generation-with-past --weight-format FORM`
over the language model as a transformers Qwen2 folder (peers/openvino_rows.py writes it from the
same weights): optimum's own IR, its own NNCF weight compression at its defaults, its tokenizer
conversion (openvino-tokenizers).

run (mode "whole"): what OpenVINO can do of a whole question when the VLM export is refused: each
camera's JPEG decoded and resized to the tile as upstream's preprocessing does (PIL, bicubic:
what a GenAI user hands VLMPipeline is decoded pixels), the vision IR (InternViT + pixel shuffle +
mlp1, converted by OpenVINO's converter from the same weights) on the camera's tile, then the
language model through OpenVINO GenAI's `LLMPipeline` over a prompt of the question's exact length
(the reference prompt's ids, the visual positions as the `<IMG_CONTEXT>` id: the same prefill work,
not the same numbers), exactly `new_tokens` greedy tokens (ignore_eos). Its timings: preprocess,
vision (the vision IR's calls), prefill = GenAI's TTFT, decode per token = GenAI's TPOT, TTFT =
preprocess + vision + GenAI's TTFT, total = preprocess + vision + generate. No agreement: the
prompt's visual rows are not the images' features.

run (mode "decode"): the language model alone, prompt ids then `tokens` greedy steps, as the
decode table's other rows.

Every pipeline at GenAI's defaults for the CPU, with only INFERENCE_NUM_THREADS set. The OpenVINO
venv's packages (optimum, openvino, openvino_genai, numpy, PIL) are imported where a mode uses them:
export-vlm needs optimum only, run needs no optimum.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

from child_common import environment_check, peak_rss_gb  # this folder: the script runs by path

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def export_vlm(model_dir: str, out_dir: str) -> int:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    record = {"model": model_dir, "task": "image-text-to-text", "trust_remote_code": True}
    try:
        from optimum.exporters.openvino import main_export

        main_export(model_name_or_path=model_dir, output=str(out / "vlm"), task="image-text-to-text",
                    trust_remote_code=True)
        record["ok"] = True
    except Exception as exc:          # the outcome is the result: any failure is reported as is
        record["ok"] = False
        record["error"] = f"{type(exc).__name__}: {exc}".strip()
    (out / "export-vlm.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record), file=sys.stderr)
    return 0


def export_llm(llm_dir: str, out_dir: str, form: str) -> int:
    cli = Path(sys.executable).with_name("optimum-cli")
    cmd = [str(cli), "export", "openvino", "--model", llm_dir, "--task", "text-generation-with-past",
           "--weight-format", form, out_dir]
    print("$ " + " ".join(cmd), file=sys.stderr, flush=True)
    return subprocess.run(cmd).returncode


class Vision:
    """The vision IR on one tile per camera, as GenAI's InternVL encoder calls it per image."""

    def __init__(self, xml: str, threads: int, tile: int):
        import openvino as ov

        self.tile = tile
        config = {"INFERENCE_NUM_THREADS": threads}
        self.request = ov.Core().compile_model(xml, "CPU", config).create_infer_request()

    def pixels(self, data: bytes):
        """JPEG bytes -> [1, 3, S, S] float32, upstream InternVL's transform for one tile."""

        import numpy as np
        from PIL import Image

        img = Image.open(io.BytesIO(data)).convert("RGB").resize((self.tile, self.tile), Image.BICUBIC)
        arr = np.asarray(img, dtype=np.float32) / 255.0
        arr = (arr - np.array(IMAGENET_MEAN, np.float32)) / np.array(IMAGENET_STD, np.float32)
        return np.ascontiguousarray(arr.transpose(2, 0, 1)[None])

    def encode(self, pixels):
        self.request.infer({0: pixels})
        return self.request.get_output_tensor(0).data


def llm_pipeline(path: str, threads: int):
    """GenAI's LLMPipeline at its defaults for the CPU, with the thread count and one change: its
    prefix cache off. By default it keeps the KV of earlier prompts and reuses their common prefix
    (measured: a 256-id prompt's TTFT 23 s, then 0.16 s for the same ids), and the prompts here
    share everything up to the question (the visual positions are one id): every other row
    prefills each question's whole prompt, so this one does too."""
    import openvino_genai as ov_genai

    scheduler = ov_genai.SchedulerConfig()
    scheduler.enable_prefix_caching = False
    return ov_genai.LLMPipeline(path, "CPU", INFERENCE_NUM_THREADS=threads, scheduler_config=scheduler)


def generate(pipe, ids: list[int], new_tokens: int):
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    config = ov_genai.GenerationConfig()
    config.max_new_tokens = new_tokens
    config.min_new_tokens = new_tokens
    config.ignore_eos = True
    config.do_sample = False
    arr = np.array([ids], dtype=np.int64)
    inputs = ov_genai.TokenizedInputs(ov.Tensor(arr), ov.Tensor(np.ones_like(arr)))
    t0 = time.perf_counter()
    res = pipe.generate(inputs, config)
    wall = time.perf_counter() - t0
    pm = res.perf_metrics
    return list(res.tokens[0]), {"ttft_ms": pm.get_ttft().mean, "tpot_ms": pm.get_tpot().mean,
                                 "generate_ms": pm.get_generate_duration().mean, "wall_ms": wall * 1e3}


def run(job_path: str, out_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    threads = job["threads"]
    t0 = time.perf_counter()
    pipe = llm_pipeline(job["llm"], threads)
    out = {"settings": {"llm": Path(job["llm"]).name, "INFERENCE_NUM_THREADS": threads, "pipeline": "LLMPipeline",
                        "prefix_caching": False},
           "questions": []}
    say = lambda m: print(m, file=sys.stderr, flush=True)      # noqa: E731
    if job["mode"] == "whole":
        vision = Vision(job["vision"], threads, job["tile"])
        out["settings"]["vision"] = Path(job["vision"]).name
        out["load_s"] = time.perf_counter() - t0
        questions = job["questions"]
        images = {p: Path(p).read_bytes() for q in questions for p in q["images"]}

        def question(q, new_tokens):
            s = time.perf_counter()
            tiles = [vision.pixels(images[p]) for p in q["images"]]
            pre = time.perf_counter()
            for t in tiles:
                vision.encode(t)
            vis = time.perf_counter()
            ids, m = generate(pipe, q["prompt_ids"], new_tokens)
            end = time.perf_counter()
            return {"id": q["id"], "ids": ids, "preprocess_ms": (pre - s) * 1e3, "vision_ms": (vis - pre) * 1e3,
                    "prefill_ms": m["ttft_ms"], "decode_ms_per_token": m["tpot_ms"],
                    "ttft_ms": (vis - s) * 1e3 + m["ttft_ms"], "total_ms": (end - s) * 1e3,
                    "vision_tiles": len(tiles), "prompt_positions": len(q["prompt_ids"])}

        say(f"openvino: warm-up on question {questions[0]['id']}")
        question(questions[0], 2)
        for i, q in enumerate(questions):
            res = question(q, q["new_tokens"])
            out["questions"].append(res)
            say(f"openvino: question {i + 1}/{len(questions)} ttft {res['ttft_ms'] / 1e3:.1f} s "
                f"total {res['total_ms'] / 1e3:.1f} s")
    else:
        out["load_s"] = time.perf_counter() - t0
        prompt, tokens = job["prompt"], job["tokens"]
        generate(pipe, prompt, 3)                                   # warm-up
        ids, m = generate(pipe, prompt, tokens + 1)
        out["decode"] = {"ids": ids, "prefill_s": m["ttft_ms"] / 1e3, "decode_ms": m["tpot_ms"], "step_ms": [],
                         "generate_ms": m["generate_ms"]}
        out["weight_bytes"] = sum(f.stat().st_size for f in Path(job["llm"]).glob("openvino_model.bin"))
    out["environment"] = environment_check()
    out["peak_rss_gb"] = peak_rss_gb()
    Path(out_path).write_text(json.dumps(out))
    return 0


def main(argv: list[str]) -> int:
    step = argv[0]
    if step == "export-vlm":
        return export_vlm(argv[1], argv[2])
    if step == "export-llm":
        return export_llm(argv[1], argv[2], argv[3])
    if step == "run":
        return run(argv[1], argv[2])
    raise SystemExit(f"unknown step {step!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
