"""GPU check: an InternVL2.5-2B-shaped model (full widths and depths, random weights, built in
memory on the GPU; no checkpoint file) through the pipeline, eager versus CUDA-graph-captured.

Three pipelines share the one model:
  torch            the model's own modules, eager (the reference backend)
  torch-static     the export-form stage modules on static, bucketed buffers, eager
  torch-cudagraph  the same modules and buffers, captured once per bucket and replayed
Pass/fail: torch-cudagraph gives exactly the tokens of torch-static (capture changes nothing).
Reported: agreement of both with the eager torch backend (a different attention formulation;
in bf16 with random weights, near-tied logits may legitimately flip a greedy token), the first
answer step's logits relative error, and the per-stage latency table (CUDA events).

Run: scripts/gpu_check.sh   (about 1-3 minutes on one data-centre GPU)
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

from litevlm_runtime.answer import STAGES  # noqa: E402
from litevlm_runtime.benchmark import DEFAULT_QUESTIONS  # noqa: E402
from litevlm_runtime.report import table  # noqa: E402

ONES = ("norm.weight", "norm1.weight", "norm2.weight", "ls1", "ls2", "attention_norm.weight", "ffn_norm.weight",
        "mlp1.0.weight")


def random_model(preset_name: str, vocab_size: int, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """InternVL of the preset, initialised on the device as make-checkpoint does (normal(0, 0.02)
    weights, unit norms and layer scales, zero biases); seconds even at 2B on a GPU."""
    from litevlm_runtime.models.internvl import InternVL
    from litevlm_runtime.presets import preset

    torch.manual_seed(seed)
    with torch.device(device):
        model = InternVL(preset(preset_name, vocab_size=vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ONES):
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def frames_for_check(count: int):
    from litevlm_runtime.commands.bench import load_frame_sets

    sample = ROOT.parent / "shared" / "drivelm_sample" / "samples"
    return load_frame_sets(sample if sample.is_dir() else None, count)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="internvl2_5-2b")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--tiles-per-camera", type=int, default=2, choices=(1, 2))
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (capture off): tests the script")
    args = ap.parse_args(argv)

    from litevlm_runtime.commands.make_checkpoint import make_checkpoint
    from litevlm_runtime.engines.cuda_graph import cuda_graph_engines
    from litevlm_runtime.pipeline import Pipeline, PipelineOptions
    from litevlm_runtime.tokenizer import Tokenizer

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
    params = sum(p.numel() for p in model.parameters())
    gpu = torch.cuda.get_device_name() if cuda else "cpu"
    print(f"{args.preset}: {params / 1e9:.2f} B parameters, {args.dtype}, {args.tiles_per_camera} tiles/camera, "
          f"on {gpu}; built in {time.perf_counter() - t0:.1f} s", flush=True)

    def pipeline(backend):
        options = PipelineOptions(device=str(device), dtype=args.dtype, tiles_per_camera=args.tiles_per_camera,
                                  max_new_tokens=args.max_new_tokens)
        pipe = Pipeline(model, tok, options, name=args.preset)
        if backend != "torch":
            t = time.perf_counter()
            pipe.engines = cuda_graph_engines(pipe, capture=(backend == "torch-cudagraph" and cuda))
            print(f"{backend}: engines ready in {time.perf_counter() - t:.1f} s", flush=True)
        return pipe

    pipes = {name: pipeline(name) for name in ("torch", "torch-static", "torch-cudagraph")}
    frame_sets = frames_for_check(2)
    questions = DEFAULT_QUESTIONS[: args.questions]
    for pipe in pipes.values():                         # warm-up
        pipe.answer(frame_sets[0], questions[0])
    ms = {name: {s: [] for s in list(STAGES) + ["total"]} for name in pipes}
    tokens = {name: [] for name in pipes}
    for i, q in enumerate(questions):
        frames = frame_sets[i % len(frame_sets)]
        for name, pipe in pipes.items():
            ans = pipe.answer(frames, q)
            for s in STAGES:
                ms[name][s].append(ans.stage_ms[s])
            ms[name]["total"].append(ans.total_ms)
            tokens[name].append(list(ans.token_ids))
        print(f"[{i + 1}/{len(questions)}] {q}", flush=True)

    # First answer step's logits, eager backend vs captured stages, same prompt.
    with torch.inference_mode():
        first = {}
        for name in ("torch", "torch-cudagraph"):
            pipe = pipes[name]
            ans = pipe.answer(frame_sets[0], questions[0], max_new_tokens=1)
            first[name] = pipe.engines.head.run(hidden=pipe.prefill_hidden[ans.input_tokens - 1:ans.input_tokens]).float().clone()
        rel = float((first["torch-cudagraph"] - first["torch"]).abs().max() / first["torch"].abs().max())

    rows = []
    for s in list(STAGES) + ["total"]:
        med = {n: statistics.median(v[s]) for n, v in ms.items()}
        rows.append([s, med["torch"], med["torch-static"], med["torch-cudagraph"],
                     f"{med['torch'] / med['torch-cudagraph']:.2f}x" if med["torch-cudagraph"] > 0 else "-"])
    print()
    print(table(["stage", "torch eager ms", "static eager ms", "cuda graph ms", "graph speed-up vs eager"], rows))
    same_capture = sum(a == b for a, b in zip(tokens["torch-static"], tokens["torch-cudagraph"]))
    same_eager = sum(a == b for a, b in zip(tokens["torch"], tokens["torch-cudagraph"]))
    n = len(questions)
    print(f"\nmedian over {n} queries (CUDA events on a GPU); mean answer tokens "
          f"{statistics.mean(len(t) for t in tokens['torch']):.1f}")
    print(f"cuda graph == static eager (capture changes nothing): {same_capture}/{n}")
    print(f"cuda graph == torch eager backend: {same_eager}/{n}; first-step logits max rel error {rel:.2e}")
    print(f"total {time.perf_counter() - t0:.0f} s")
    ok = same_capture == n
    print("PASS" if ok else "FAIL: captured graphs changed the tokens")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
