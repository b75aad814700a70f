"""The low-bit matmuls of issue 36 at a preset's decoder shapes, for the first lent GPU (gpu_check.py
runs this after its pipeline checks; alone: `python scripts/gpu_lowbit.py [--preset internvl2_5-2b]`).

Per decoder linear (qkv, o, gate+up, down, LM head) and per row count (1: a decode step, padded to
16 where cuBLASLt's FP8 GEMM needs it; 256: a prompt):
  - FP8 E4M3: activations and weight quantized per tensor (amax / 448, as ModelOpt's max calibration
    does), multiplied by torch._scaled_mm (cuBLASLt FP8 on Hopper; torch's CPU kernel elsewhere);
    checked against the float64 product of the same dequantized operands (what the GEMM must compute:
    within 1e-2 of the output's largest value, the bfloat16 output's rounding plus accumulation order),
    and its distance to the unquantized product printed (what FP8 costs);
  - INT4: the project's group-wise INT4 form (weights/quantize.py, group 128, asymmetric), run by
    its module (weights/lowbit.py: on a GPU the dequantize-then-matmul path), checked against the
    float64 product with its effective weight (same tolerance);
  - times against the 16-bit matmul of the same shapes in the same run (CUDA events on a GPU), as a
    ratio. On the CPU (--allow-cpu in gpu_check.py) the timings mean nothing; the checks still hold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from litevlm_runtime.report import table  # noqa: E402
from litevlm_runtime.weights.lowbit import Int4Linear  # noqa: E402
from litevlm_runtime.weights.presets import preset  # noqa: E402
from litevlm_runtime.weights.quantize import effective_weight  # noqa: E402

E4M3_MAX = 448.0
TOLERANCE = 1e-2      # of the output's largest magnitude (bfloat16 output: 2^-8 rounding, plus summation order)


def decoder_shapes(name: str) -> list[tuple[str, int, int]]:
    """(linear, out features N, in features K) of one decoder layer and the LM head."""
    llm = preset(name).llm
    head = llm.head_size or llm.hidden_size // llm.num_attention_heads
    qkv = (llm.num_attention_heads + 2 * llm.num_key_value_heads) * head
    return [("qkv", qkv, llm.hidden_size), ("o", llm.hidden_size, llm.num_attention_heads * head),
            ("gate+up", 2 * llm.intermediate_size, llm.hidden_size), ("down", llm.hidden_size, llm.intermediate_size),
            ("lm_head", llm.vocab_size, llm.hidden_size)]


def relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30))


def timed_ms(fn, repeats: int, cuda: bool) -> float:
    """Median ms of fn() after three warm-up calls (CUDA events on a GPU); gpu_check.py uses it too."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def to_e4m3(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor E4M3 codes and their float32 scale (amax / 448)."""
    scale = (t.abs().amax().float() / E4M3_MAX).clamp(min=1e-12)
    return (t.float() / scale).to(torch.float8_e4m3fn), scale


def fp8_row(x: torch.Tensor, w: torch.Tensor, cuda: bool, repeats: int) -> tuple[float, float, float, float]:
    """(error vs the float64 product of the FP8 operands, error vs the unquantized product, FP8 ms, 16-bit ms)."""
    xq, sx = to_e4m3(x)
    wq, sw = to_e4m3(w)
    wt = wq.t()        # column-major second operand, as _scaled_mm takes it

    def fp8():
        return torch._scaled_mm(xq, wt, scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16)

    got = fp8()
    ref = (xq.double() * sx.double()) @ (wq.double() * sw.double()).t()
    exact = x.double() @ w.double().t()
    dense_ms = timed_ms(lambda: x @ w.t(), repeats, cuda)
    return relative(got, ref), relative(got, exact), timed_ms(fp8, repeats, cuda), dense_ms


def int4_row(x: torch.Tensor, w: torch.Tensor, cuda: bool, repeats: int) -> tuple[float, float, float, float]:
    """The same four figures for the project's INT4 form (quantized on the CPU, run on x's device)."""
    layer = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
    layer.weight.data = w.detach().float().cpu()
    q = Int4Linear(layer).to(x.device)
    got = q(x)
    ref = x.double() @ effective_weight(q.weight_form(), torch.float64).t()
    exact = x.double() @ w.double().t()
    dense_ms = timed_ms(lambda: x @ w.t(), repeats, cuda)
    return relative(got, ref), relative(got, exact), timed_ms(lambda: q(x), repeats, cuda), dense_ms


def lowbit_check(name: str, device: torch.device, dtype: torch.dtype = torch.bfloat16, rows=(1, 256),
                 repeats: int = 20) -> bool:
    """Print the table; True when every FP8 and INT4 product is within TOLERANCE of its reference."""
    cuda = device.type == "cuda"
    g = torch.Generator(device="cpu").manual_seed(36)
    out, ok = [], True
    for linear, n, k in decoder_shapes(name):
        w = (torch.randn(n, k, generator=g) * 0.02).to(device, dtype)
        for m in rows:
            padded = max(m, 16) if cuda else m          # cuBLASLt's FP8 GEMM wants dimensions in 16s
            x = torch.randn(padded, k, generator=g).to(device, dtype)
            for form, run in (("fp8", fp8_row), ("int4", int4_row)):
                err, cost, ms, ms16 = run(x, w, cuda, repeats)
                ok = ok and err <= TOLERANCE
                out.append([linear, f"{n}x{k}", m, form, f"{err:.1e}", f"{cost:.1e}", f"{ms:.3f}", f"{ms16:.3f}",
                            f"{ms16 / max(ms, 1e-9):.2f}x"])
            print(f"  {linear} {n}x{k} rows {m}: done", flush=True)
    print(table(["linear", "N x K", "rows", "form", "err vs its float64 product", "err vs unquantized", "ms",
                 f"{str(dtype).removeprefix('torch.')} ms", "speed-up"], out))
    print(f"low-bit matmuls within {TOLERANCE:g} of their float64 references: {'yes' if ok else 'NO'}")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="internvl2_5-2b")
    ap.add_argument("--allow-cpu", action="store_true", help="run without CUDA (tests the script)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_lowbit: no CUDA device; this check needs an NVIDIA GPU (or --allow-cpu)", file=sys.stderr)
        return 2
    return 0 if lowbit_check(args.preset, torch.device("cuda" if cuda else "cpu")) else 1


if __name__ == "__main__":
    sys.exit(main())
