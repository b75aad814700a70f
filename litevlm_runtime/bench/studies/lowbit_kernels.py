"""The low-bit matmul candidates against the float32 matmul at a model's decoder shapes, in one run:
what chose the kernel of `backend.weights int4 | int8 | fp16` (kernels/lowbit_kernels.cpp).

    litevlm bench --study lowbit_kernels [--preset internvl3-2b] [--threads 2] [--rounds 5] [--rows 1,256]
                                     [--only float,own-int4,...]

For each linear shape of one decoder layer (q, k, v, o, gate, up, down) and the LM head, every
candidate holds its own copies of the weight (enough to total 256 MB, so that a one-row call
streams from memory as in a decode step, not from the cache), and the candidates run in turn,
round after round (the order reversed every other round), so that a loaded machine hits them
alike. A decode step's matmul time is then 28 x (the layer's shapes) + the head at 1 row; a
prompt's, the layer's shapes at --rows (default 256) x layers. Printed: ms per candidate, its ratio
to float32 in the same run, and the bytes its weights read per token.

Candidates (those whose library is missing are listed as such):
    float         F.linear, float32 (MKL)                                  the baseline
    torch-int8    torch._weight_int8pack_mm, bfloat16 activations (what weights/int8.py ran before)
    torch-int4    torch._weight_int4pack_mm_for_cpu, bfloat16 activations, group 128
    torchao-int4  torchao 0.18 Int4WeightOnlyConfig, group 128 (pip install torchao==0.18.0 --no-deps)
    torchao-int8  torchao 0.18 Int8WeightOnlyConfig, float32 activations
    torchao-da8w4 torchao 0.18 Int8DynamicActivationIntxWeightConfig(int4, group 128), its CPU-portable layout
    ov-int4       OpenVINO's CPU plugin: a one-MatMul model with u4 weights (+ scale, zero) per group 128,
                  float32 activations
    ov-int4-dq    the same with OpenVINO's dynamic quantization of the activations (int8 per group of 32)
    own-int4      ours: int4 x int8 activations, AVX2 (lowbit_kernels.cpp)
    own-int8      ours: int8 x int8 activations, AVX2
    own-fp16      ours: fp16 weights widened in registers (F16C), float32 activations
    own-X-gemm8   int4 / int8 with the prompt's int8 GEMM above GEMV_MAX_ROWS rows (backend.lowbit_prefill
                  int8, the default: AVX-512 VNNI or AVX2 micro-tiles); own-X alone dequantizes float32 tiles
    own-X-fused / own-X-tiled   the same kernels forced to their small-call path or to the
                  dequantized-tile GEMM at every row count (not in the default list: --only)
"""

from __future__ import annotations

import litevlm_runtime  # noqa: F401 - before torch, so that its threads sleep when idle (threads.py)

# isort: split
# (libgomp reads OMP_WAIT_POLICY once, when `import torch` loads it: sorted after torch, the
# package's PASSIVE came too late and these measurements ran with spinning threads)
import argparse
import math
import os
import statistics
import time

import torch
import torch.nn.functional as F

from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.kernels.cpuinfo import read_cpuinfo
from litevlm_runtime.report import table
from litevlm_runtime.weights.presets import preset
from litevlm_runtime.weights.quantize import GROUP_SIZE, quantize_int4, quantize_int8, unpack_nibbles

COPY_BYTES = 256 << 20
GEMV_MAX_ROWS, TILE_BYTES = 16, 2 << 20


def layer_shapes(cfg) -> list[tuple[str, int, int]]:
    """(name, N, K) of one decoder layer's linears."""
    llm = cfg.llm
    d, f, hd = llm.hidden_size, llm.intermediate_size, llm.head_dim
    return [("q", llm.num_attention_heads * hd, d), ("k", llm.num_key_value_heads * hd, d),
            ("v", llm.num_key_value_heads * hd, d), ("o", d, llm.num_attention_heads * hd),
            ("gate", f, d), ("up", f, d), ("down", d, f)]


# ------------------------------------------------------------------------------ candidates
def make_float(w):
    return lambda x: F.linear(x, w), w.numel() * 4


def make_torch_int8(w):
    q = quantize_int8(w)
    scales = q.scales.bfloat16()
    return lambda x: torch._weight_int8pack_mm(x.bfloat16(), q.codes, scales).float(), q.nbytes()


def make_torch_int4(w):
    q = quantize_int4(w, GROUP_SIZE)
    codes = unpack_nibbles(q.codes).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
    # torch's int4pack: w = (q - 8) * scale + zero_offset, per group: [K / G, N, 2] (scale, offset)
    s = q.scales.float().T
    offset = (8 - q.zeros.float().T) * s
    sz = torch.stack([s, offset], -1).bfloat16().contiguous()
    return (lambda x: torch._weight_int4pack_mm_for_cpu(x.bfloat16(), packed, GROUP_SIZE, sz).float(),
            packed.numel() * packed.element_size() + sz.numel() * 2)


def make_torchao(config_name):
    def make(w):
        import warnings

        from torchao.quantization import (
            Int4WeightOnlyConfig,
            Int8DynamicActivationIntxWeightConfig,
            Int8WeightOnlyConfig,
            PerGroup,
            quantize_,
        )

        warnings.filterwarnings("ignore")
        config = {"torchao-int4": lambda: Int4WeightOnlyConfig(group_size=GROUP_SIZE),
                  "torchao-int8": lambda: Int8WeightOnlyConfig(),
                  "torchao-da8w4": lambda: Int8DynamicActivationIntxWeightConfig(
                      weight_dtype=torch.int4, weight_granularity=PerGroup(GROUP_SIZE))}[config_name]()
        lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
        with torch.no_grad():
            lin.weight.copy_(w)
        quantize_(lin, config)
        bits = 8 if config_name == "torchao-int8" else 4
        return lin, w.numel() * bits // 8
    return make


def make_openvino_int4(w, dynamic_quantization: bool = False):
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    q = quantize_int4(w, GROUP_SIZE)
    n, k = w.shape
    g = k // GROUP_SIZE
    codes = unpack_nibbles(q.codes).numpy().reshape(n, g, GROUP_SIZE)
    x = ops.parameter([-1, k], np.float32, name="x")
    wc = ops.constant(codes.astype(np.uint8), dtype=ov.Type.u4)
    zc = ops.constant(q.zeros.numpy().reshape(n, g, 1).astype(np.uint8), dtype=ov.Type.u4)
    sc = ops.constant(q.scales.numpy().reshape(n, g, 1))
    deq = ops.multiply(ops.subtract(ops.convert(wc, ov.Type.f16), ops.convert(zc, ov.Type.f16)), sc)
    wf = ops.reshape(ops.convert(deq, ov.Type.f32), ops.constant(np.array([n, k], np.int64)), False)
    model = ov.Model([ops.matmul(x, wf, False, True)], [x])
    config = {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": "f32",
              # its int8 quantization of the activations per group of 32 (the scheme ours uses), or off
              "DYNAMIC_QUANTIZATION_GROUP_SIZE": 32 if dynamic_quantization else 0}
    compiled = ov.Core().compile_model(model, "CPU", config)
    request = compiled.create_infer_request()

    def run(xt):
        request.infer({0: xt.numpy()}, share_inputs=True)
        return torch.from_numpy(request.get_output_tensor(0).data)
    return run, w.numel() // 2 + w.numel() // GROUP_SIZE * 3


def make_own_int4(w, gemv_max_rows=GEMV_MAX_ROWS, int8_gemm=False):
    q = quantize_int4(w, GROUP_SIZE)
    ops = torch.ops.litevlm_lowbit
    return (lambda x: ops.int4_linear(x, q.codes, q.scales, q.zeros, None, GROUP_SIZE, gemv_max_rows, TILE_BYTES,
                                      False, int8_gemm), q.nbytes())


def make_own_int8(w, gemv_max_rows=GEMV_MAX_ROWS, int8_gemm=False):
    q = quantize_int8(w)
    ops = torch.ops.litevlm_lowbit
    return lambda x: ops.int8_linear(x, q.codes, q.scales, gemv_max_rows, TILE_BYTES, False, int8_gemm), q.nbytes()


def make_own_fp16(w, gemv_max_rows=GEMV_MAX_ROWS):
    h = w.half()
    ops = torch.ops.litevlm_lowbit
    return lambda x: ops.fp16_linear(x, h, gemv_max_rows, TILE_BYTES), h.numel() * 2


CANDIDATES = {"float": make_float, "torch-int8": make_torch_int8, "torch-int4": make_torch_int4,
              "torchao-int4": make_torchao("torchao-int4"), "torchao-int8": make_torchao("torchao-int8"),
              "torchao-da8w4": make_torchao("torchao-da8w4"), "ov-int4": make_openvino_int4,
              "ov-int4-dq": lambda w: make_openvino_int4(w, True), "own-int4": make_own_int4,
              "own-int8": make_own_int8, "own-fp16": make_own_fp16,
              "own-int4-gemm8": lambda w: make_own_int4(w, int8_gemm=True),
              "own-int8-gemm8": lambda w: make_own_int8(w, int8_gemm=True),
              # the two paths of each at every row count (where GEMV_MAX_ROWS should sit: --rows 2,4,8,16,32)
              **{f"own-{kind}-{path}": (lambda w, make=make, rows=rows: make(w, rows))
                 for kind, make in (("int4", make_own_int4), ("int8", make_own_int8), ("fp16", make_own_fp16))
                 for path, rows in (("fused", 1 << 30), ("tiled", 0))}}


def build(name, w, copies: int):
    """`copies` independent instances of candidate `name` over w (clones: separate memory)."""
    fns = []
    for i in range(copies):
        fn, nbytes = CANDIDATES[name](w if i == 0 else w.clone())
        fns.append(fn)
    return fns, nbytes


@torch.inference_mode()
def measure(shapes, names, rows, rounds, progress=print) -> tuple[dict, dict, dict]:
    """{(shape, rows): {name: median ms}}, {name: bytes per (shape)}, {name: reason unavailable}."""
    times, sizes, missing = {}, {}, {}
    g = torch.Generator().manual_seed(0)
    for label, n, k in shapes:
        w = torch.randn(n, k, generator=g) * 0.02
        built = {}
        for name in names:
            if name in missing:
                continue
            try:
                fns, nbytes = build(name, w, 1)
                copies = max(1, min(64, math.ceil(COPY_BYTES / nbytes)))
                if copies > 1:
                    fns += build(name, w, copies - 1)[0]
                built[name] = fns
                sizes.setdefault(name, {})[label] = nbytes
            except Exception as exc:     # a missing or failing library: reported, not fatal
                missing[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
        for m in rows:
            x = torch.randn(m, k, generator=g)
            samples = {name: [] for name in built}
            for r in range(rounds):
                order = list(built) if r % 2 == 0 else list(built)[::-1]
                for name in order:
                    fns = built[name] if m <= GEMV_MAX_ROWS else built[name][:2]
                    fns[0](x)                                   # warm (first call of a shape)
                    t0 = time.perf_counter()
                    for fn in fns:
                        fn(x)
                    samples[name].append((time.perf_counter() - t0) * 1000 / len(fns))
            times[(label, m)] = {name: statistics.median(v) for name, v in samples.items()}
            progress(f"[{label} {n}x{k}, {m} row(s)] "
                     + "  ".join(f"{nm} {t:.3f}" for nm, t in times[(label, m)].items()))
        del built
    return times, sizes, missing


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="internvl3-2b")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,256", help="comma list of activation rows per call (decode 1, prompt 256)")
    ap.add_argument("--only", default=",".join(n for n in CANDIDATES if not n.endswith(("-fused", "-tiled"))))
    ap.add_argument("--no-head", action="store_true", help="skip the LM head (its float copy is 0.9 GB at 2B)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    lowbit_kernels.load()
    names = [n for n in args.only.split(",") if n]
    cfg = preset(args.preset)
    rows = [int(r) for r in args.rows.split(",")]
    shapes = layer_shapes(cfg) + ([] if args.no_head else [("head", cfg.llm.vocab_size, cfg.llm.hidden_size)])
    vendor, flags = read_cpuinfo() or ("?", [])
    load0 = os.getloadavg()[0]
    times, sizes, missing = measure(shapes, names, rows, args.rounds)
    layers = cfg.llm.num_hidden_layers
    shown = " ".join(f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in flags)
    print(f"\n{args.preset}: {layers} layers, {args.threads} thread(s), median of {args.rounds} alternating rounds; "
          f"load {load0:.2f} -> {os.getloadavg()[0]:.2f}; {vendor}, {shown}")
    body = [[label, n, k, m] + [times[(label, m)].get(nm, float("nan")) for nm in names]
            for label, n, k in shapes for m in rows]
    print(table(["linear", "N", "K", "rows"] + [f"{nm} ms" for nm in names], body))
    present = [nm for nm in names if nm not in missing]
    per_layer = [lb for lb, _, _ in layer_shapes(cfg)]
    head_too = not args.no_head

    def model_total(value, m):
        """A whole model's sum of `value(linear)`: every layer's linears, the head at a step's rows."""
        return sum(value(lb) for lb in per_layer) * layers + (value("head") if head_too and m == rows[0] else 0)
    summary = []
    for nm in present:
        step = model_total(lambda lb: times[(lb, rows[0])][nm], rows[0])
        base = model_total(lambda lb: times[(lb, rows[0])]["float"], rows[0])
        row = [nm, model_total(lambda lb: sizes[nm][lb], rows[0]) / 1e6, step, base / step]
        for m in rows[1:]:
            ours, fl = (model_total(lambda lb: times[(lb, m)][c], m) for c in (nm, "float"))
            row += [ours, fl / ours]
        summary.append(row)
    head = ["candidate", "MB per token", f"matmuls of a step ({rows[0]} row) ms", "speed-up vs float"]
    for m in rows[1:]:
        head += [f"prompt ({m} rows) matmuls ms", "speed-up vs float"]
    print("\n" + table(head, summary))
    for nm, why in missing.items():
        print(f"  {nm}: not run ({why})")


if __name__ == "__main__":
    main()
