"""GPU check of the deployed configuration: an InternVL2.5-2B-shaped model (full widths and depths,
random weights built in memory on the GPU, 2 tiles per camera) through the LiteVLM pipeline
(view selector, token selector, EAGLE-2), eager versus CUDA-graph-captured, then the paper-shaped
per-stage table of the baseline and LiteVLM pipelines, and (with --node) the ROS 2 node over DDS
on the GPU with that configuration.

The LiteVLM modules of a random 2B model: the bundled view selector (text only, independent of
the VLM), the untrained token selector (a copy of decoder layer 0, tokens.mode layer0) and a
random EAGLE-2 head started from the target's last layer. They check that every stage runs and is
captured; they are not trained, so acceptance and accuracy mean nothing here.

Three LiteVLM pipelines share the one model:
  torch            the model's own modules, eager (the reference backend)
  torch-static     the same modules on static, bucketed buffers (what is captured), eager
  torch-cudagraph  the static stages captured once per bucket and replayed (draft head included)
Pass/fail: torch-cudagraph gives exactly the tokens of torch-static (capture changes nothing).
Reported: agreement with eager torch (it attends over the live cache columns, the static stages
over the whole masked cache: in bf16 with random weights a near-tied greedy token may flip).

Then in-flight batching at these shapes (pipeline/batching.py, serving.max_batch 4): the same
queries decoded together on each backend (eager torch's batched step, the static one, the
batched step captured once per batch bucket 2, 3 and 4, each KV region's step graphs captured);
pass/fail again: captured == static, token for token; reported: batched == one at a time (greedy
verification is lossless, so they differ only where bf16 rounding flips a near tie) and == eager
torch batched; and the per-bucket table: one batched step of 1..4 rows over a 600-column context,
eager vs captured, ms per query.

Last, issue 36's low-bit matmuls at the preset's decoder shapes (gpu_lowbit.py): FP8 E4M3 through
torch._scaled_mm and the project's INT4 form, each against its float64 reference (pass/fail within
1e-2) and timed against the 16-bit matmul (--skip-lowbit leaves them out).

Run: scripts/gpu_check.sh   (under 5 minutes on one data-centre GPU)
On a machine without CUDA it stops with a clear message; `--allow-cpu --preset tiny` runs the
same script with capture off (what the CPU test suite checks).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_lowbit import lowbit_check, timed_ms  # noqa: E402  (scripts/, beside this file)

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS  # noqa: E402
from litevlm_runtime.pipeline.answer import STAGES  # noqa: E402
from litevlm_runtime.report import table  # noqa: E402
from litevlm_runtime.weights.random_init import random_draft  # noqa: E402
from litevlm_runtime.weights.random_init import random_internvl as random_model


def frames_for_check(count: int):
    from litevlm_runtime.commands.bench import load_frame_sets

    sample = ROOT.parent / "shared" / "drivelm_sample" / "samples"
    return load_frame_sets(sample if sample.is_dir() else None, count)


def lite_settings(args, device) -> dict:
    from litevlm_runtime.bundled import DEFAULT_MODEL

    return {"device": str(device), "dtype": args.dtype, "tiles_per_camera": args.tiles_per_camera,
            "max_new_tokens": args.max_new_tokens, "views.mode": "selector",
            "views.selector_dir": str(DEFAULT_MODEL / "view_selector"), "tokens.mode": "layer0",
            "tokens.keep_ratio": 0.8, "decoding.mode": "eagle"}


def paper_table(runs: dict) -> str:
    """The paper's table 1 shape: tiles, ViT, input tokens, prefill, ms per token, decode, select."""
    rows, base = [], None
    for name, answers in runs.items():
        med = {s: statistics.median(a.stage_ms[s] for a in answers) for s in STAGES}
        total = statistics.median(a.total_ms for a in answers)
        base = base or total
        tokens = sum(len(a.token_ids) for a in answers)
        rows.append([name, statistics.mean(len(a.cameras) for a in answers), med["vision"],
                     statistics.mean(a.input_tokens for a in answers), med["prefill"],
                     sum(a.stage_ms["decode"] for a in answers) / max(1, tokens - len(answers)),
                     statistics.mean(a.accepted_length for a in answers), med["decode"],
                     med["view_select"] + med["token_select"], total, f"{base / total:.2f}x"])
    return table(["pipeline", "cams", "ViT ms", "in tok", "prefill ms", "ms/tok", "acc len", "decode ms",
                  "select ms", "total ms", "speed-up"], rows)


def node_check(args) -> bool:
    """The node (LiteVLM on the bundled model, on the GPU, torch-cudagraph) answering a replayed
    bag over DDS: `litevlm drive`, `bag record`, `bag replay` as the main job runs them."""
    import os
    import subprocess

    try:
        import rclpy  # noqa: F401
    except ImportError:
        print("node check: skipped (rclpy is not installed here: the ROS 2 Kilted wheels are needed)")
        return True
    py, cli = sys.executable, [sys.executable, "-m", "litevlm_runtime.cli"]
    env = dict(os.environ, ROS_DOMAIN_ID=str(140 + os.getpid() % 50),
               FASTDDS_DEFAULT_PROFILES_FILE=str(ROOT / "config" / "fastdds_large_data.xml"), PYTHONPATH=str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        bag, answers = Path(tmp) / "bag", Path(tmp) / "answers.jsonl"
        sample = ROOT.parent / "shared" / "drivelm_sample"
        src = ["--from-drivelm", str(sample)] if sample.is_dir() else None
        if src is None:
            subprocess.run(cli + ["synth", "--out", f"{tmp}/synth", "--scenes", "2", "--quiet"], env=env, check=True)
            src = ["--from-synth", f"{tmp}/synth"]
        subprocess.run(
            cli + ["bag", "make", *src, "--out", str(bag), "--max-frames", "2", "--questions-per-frame", "2"],
            env=env,
            check=True,
            capture_output=True,
        )
        node = subprocess.Popen(cli + ["drive", "--set", "device=cuda", "--set", "backend.name=torch-cudagraph",
                                       "--set", f"dtype={args.dtype}"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        record = subprocess.Popen(cli + ["bag", "record", "--out", str(answers), "--count", "4", "--timeout", "120"],
                                  env=env)
        try:
            for line in node.stdout:
                print(f"  node: {line.rstrip()}")
                if "ready (" in line:
                    break
            subprocess.run(cli + ["bag", "replay", str(bag)], env=env, check=True)
            record.wait(timeout=150)
            ok = record.returncode == 0
            subprocess.run(cli + ["bag", "summary", str(answers)], env=env)
        finally:
            node.terminate()
            node.wait(timeout=30)
        del py
    print(f"node over DDS on the GPU: {'PASS' if ok else 'FAIL'}")
    return ok


def serve_together(pipe, frame_sets, questions) -> dict:
    """Every question (on frame set i mod count) through one BatchDecoder: as many at once as
    it has KV regions, the next joining when one leaves. Returns {index: Answer}."""
    from litevlm_runtime.pipeline.batching import BatchDecoder

    batch, out = BatchDecoder(pipe), {}
    pending = list(enumerate(questions))
    while pending or len(batch):
        while pending and batch.has_room:
            i, q = pending.pop(0)
            batch.admit(frame_sets[i % len(frame_sets)], q, tag=i)
        for r, ans in batch.step(waiting=lambda: bool(pending) and batch.has_room):
            out[r.tag] = ans
    return out


def median_ms(answers, stage: str) -> float:
    return statistics.median(a.stage_ms[stage] for a in answers)


@torch.inference_mode()
def bucket_table(pipes: dict, cuda: bool, context: int = 600, repeats: int = 20) -> str:
    """One decode step of 1 row (the single-query step graph) and batched steps of 2..batch rows
    (the batch buckets, 3 padded in 4), every row over its own `context` live columns."""
    ref = pipes["torch"].rt
    a = ref.arena
    context = min(context, a.max_len - 1)
    d, batch = ref.cfg.llm.hidden_size, a.limits.batch
    rows_out = []
    for rows in range(1, batch + 1):
        emb = torch.randn(rows, d, device=ref.device).to(ref.dtype)
        positions = torch.full((rows,), context, device=ref.device)
        slots = torch.full((rows,), context, device=ref.device)
        mask = torch.ones(rows, context, dtype=torch.bool, device=ref.device)
        eye = torch.eye(rows, dtype=torch.bool, device=ref.device)
        ms = []
        for name in ("torch", "torch-cudagraph"):
            engines = pipes[name].rt.engines
            step = engines.decoder.step if rows == 1 else engines.batch.step
            ms.append(timed_ms(lambda: step(emb, positions, slots, mask, eye), repeats, cuda))
        bucket = 1 if rows == 1 else min(b for b in pipes["torch-cudagraph"].rt.engines.batch.sizes if b >= rows)
        rows_out.append([rows, bucket, ms[0], ms[1], f"{ms[0] / max(1e-9, ms[1]):.2f}x", ms[1] / rows])
    one = rows_out[0][3]
    for r in rows_out:
        r.append(f"{one * r[0] / max(1e-9, r[3]):.2f}x")
    return table(["rows", "bucket", "torch eager ms", "cuda graph ms", "graph speed-up", "graph ms per query",
                  "vs rows x 1-row step"], rows_out)


def batched_check(pipes: dict, frame_sets, questions, alone: dict, cuda: bool) -> bool:
    """In-flight batching on each backend: tokens compared, per-bucket timing printed."""
    if pipes["torch-cudagraph"].rt.engines.batch is None:
        print("\nbatched: skipped (serving.max_batch 1)")
        return True
    t = time.perf_counter()
    got = {name: serve_together(pipe, frame_sets, questions) for name, pipe in pipes.items()}
    n = len(questions)
    tokens = {name: [out[i].token_ids for i in range(n)] for name, out in got.items()}
    together = {name: sum(1 for a in out.values() if a.batched_steps) for name, out in got.items()}
    same_capture = sum(a == b for a, b in zip(tokens["torch-static"], tokens["torch-cudagraph"]))
    same_alone = sum(a == b for a, b in zip(alone["torch-cudagraph"], tokens["torch-cudagraph"]))
    same_eager = sum(a == b for a, b in zip(tokens["torch"], tokens["torch-cudagraph"]))
    batch = pipes["torch-cudagraph"].rt.engines.batch
    print(f"\nin-flight batching (serving.max_batch {pipes['torch'].rt.arena.limits.batch}, batch buckets "
          f"{batch.sizes}; {time.perf_counter() - t:.1f} s): queries that ran batched steps "
          + ", ".join(f"{k} {v}/{n}" for k, v in together.items()))
    print(f"batched cuda graph == batched static eager (capture changes nothing): {same_capture}/{n}")
    print(f"batched cuda graph == cuda graph one at a time: {same_alone}/{n}")
    print(f"batched cuda graph == batched torch eager: {same_eager}/{n}")
    print("\nbatched decode step per bucket (each row over its own 600-column region; median of 20):")
    print(bucket_table(pipes, cuda))
    return same_capture == n and together["torch-cudagraph"] > 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="internvl2_5-2b")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--tiles-per-camera", type=int, default=2, choices=(1, 2))
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--node", action="store_true", help="also the ROS 2 node over DDS on the GPU (needs rclpy)")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (capture off): tests the script")
    ap.add_argument("--skip-lowbit", action="store_true", help="leave out the FP8 / INT4 matmuls (gpu_lowbit.py)")
    args = ap.parse_args(argv)

    from litevlm_runtime.engines.cuda_graph import cuda_graph_engines
    from litevlm_runtime.options import options_from_flat
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.weights.random_init import make_checkpoint
    from litevlm_runtime.weights.tokenizer import Tokenizer

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); this check needs an NVIDIA GPU "
              "and a CUDA build of PyTorch", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        make_checkpoint(Path(tmp), "tiny")          # only for its tokenizer files
        tok = Tokenizer(Path(tmp))
    model = random_model(args.preset, 92553 if args.preset.startswith("internvl") else tok.vocab_size, device,
                         getattr(torch, args.dtype))
    draft = random_draft(model)
    params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{args.preset}: {params / 1e9:.2f} B parameters, {args.dtype}, {args.tiles_per_camera} tiles/camera, "
          f"on {gpu}; built in {time.perf_counter() - t0:.1f} s", flush=True)

    def pipeline(backend, settings):
        pipe = Pipeline.from_model(model, tok, options_from_flat(settings), name=args.preset,
                                   draft=draft if settings.get("decoding.mode") == "eagle" else None)
        if backend != "torch":
            t = time.perf_counter()
            pipe.rt.engines = cuda_graph_engines(pipe.rt, capture=(backend == "torch-cudagraph" and cuda))
            print(f"{backend}: engines ready in {time.perf_counter() - t:.1f} s", flush=True)
        pipe.warm_up()                                   # and the speculation cost table on this device
        return pipe

    lite = lite_settings(args, device)
    pipes = {name: pipeline(name, lite) for name in ("torch", "torch-static", "torch-cudagraph")}
    baseline = pipeline("torch-cudagraph" if cuda else "torch-static", {**lite, "pipeline": "baseline",
                                                                         "views.mode": "all", "tokens.mode": "off",
                                                                         "decoding.mode": "greedy"})
    frame_sets = frames_for_check(2)
    questions = [q for q in DEFAULT_QUESTIONS][: args.questions]
    answers = {name: [] for name in list(pipes) + ["baseline"]}
    for i, q in enumerate(questions):
        frames = frame_sets[i % len(frame_sets)]
        for name, pipe in [*pipes.items(), ("baseline", baseline)]:
            answers[name].append(pipe.answer(frames, q))
        print(f"[{i + 1}/{len(questions)}] {q}  cameras {answers['torch'][-1].cameras}", flush=True)

    print()
    print(
        table(
            ["stage", "torch eager ms", "static eager ms", "cuda graph ms", "graph speed-up vs eager"],
            [
                [
                    s,
                    *(statistics.median(a.stage_ms[s] for a in answers[n]) for n in pipes),
                    f"{median_ms(answers['torch'], s) / max(1e-9, median_ms(answers['torch-cudagraph'], s)):.2f}x",
                ]
                for s in STAGES
            ],
        )
    )
    print("\npaper-shaped table (CUDA graphs; random weights: acceptance and accuracy mean nothing):")
    print(paper_table({"baseline": answers["baseline"], "LiteVLM": answers["torch-cudagraph"]}))
    costs = pipes["torch-cudagraph"].rt.costs
    print("\nspeculation cost table (torch-cudagraph):")
    print(table(["measured", "ms", "x plain step"], costs.table()))
    tokens = {n: [a.token_ids for a in v] for n, v in answers.items()}
    n = len(questions)
    same_capture = sum(a == b for a, b in zip(tokens["torch-static"], tokens["torch-cudagraph"]))
    same_eager = sum(a == b for a, b in zip(tokens["torch"], tokens["torch-cudagraph"]))
    print(f"\npipeline {answers['torch'][0].pipeline}; median over {n} queries (CUDA events on a GPU)")
    print(f"cuda graph == static eager (capture changes nothing): {same_capture}/{n}")
    print(f"cuda graph == torch eager backend: {same_eager}/{n}")
    ok = same_capture == n
    ok = batched_check(pipes, frame_sets, questions, tokens, cuda) and ok
    if args.node:
        ok = node_check(args) and ok
    if not args.skip_lowbit:
        print(f"\nFP8 and INT4 matmuls at {args.preset}'s decoder shapes (gpu_lowbit.py):")
        ok = lowbit_check(args.preset, device, repeats=20 if cuda else 1) and ok
    print(f"total {time.perf_counter() - t0:.0f} s")
    print("PASS" if ok else "FAIL: captured graphs changed the tokens (or nothing ran batched, or a low-bit "
          "matmul was off its reference)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
