"""How far each stage is from what the machine allows (`litevlm bench --roofline`, and the decode
step's line in every `litevlm bench` and `--costs` table).

    machine   memory bandwidth: STREAM-like read (sum), copy and triad kernels in torch, at this
              process's thread count, over arrays as large as the stage's working set (capped at
              2 GiB: a 30 MB decoder is served from the last-level cache, a 7 GB one from DRAM,
              and each floor is against the bandwidth its own size gets); peak FLOP/s: a
              1024 x 1024 float32 matmul (torch's GEMM, the kernel the stages use)
    stage     bytes it must move (every weight it reads, plus the KV cache columns attention
              reads: the live ones for eager torch, the whole static cache (or torch-compile's
              cache bucket) for the graph
              backends) and FLOPs (torch.utils.flop_counter over the stage's own modules at the
              same shapes)
    floor     max(bytes / bandwidth, FLOPs / peak); fraction = floor / measured time (1.0 = at the
              limit; above 1 means the measured bandwidth underestimates what the stage got)

A decode step is one row through every layer: its floor is the weight bytes over the bandwidth
(gpt-fast's argument); prefill and vision are many rows per weight and compute-bound.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

from ..kernels import lowbit_kernels
from ..report import table
from ..timing import median_ms
from ..weights.bf16 import BF16_MIN_ROWS
from ..weights.gemm import onednn_linear
from ..weights.linear_forms import LinearForms, Quantized, quantized_folder, weight_bytes

CAP_BYTES = 2 << 30
MIN_BYTES = 8 << 20


@dataclass(frozen=True)
class Bandwidth:
    array_bytes: int          # per array
    read_gbs: float           # sum(a): bytes of a
    copy_gbs: float           # b.copy_(a): 2 arrays (STREAM counts no write-allocate)
    triad_gbs: float          # a = b + s * c: 3 arrays

    @property
    def best_gbs(self) -> float:
        return max(self.read_gbs, self.copy_gbs, self.triad_gbs)


def _best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


@torch.inference_mode()
def measure_bandwidth(working_set_bytes: int, repeats: int = 5) -> Bandwidth:
    """STREAM-like kernels over three float32 arrays that together hold `working_set_bytes`
    (between 8 MiB and 2 GiB). Best of `repeats`, as STREAM reports."""
    total = min(max(working_set_bytes, MIN_BYTES), CAP_BYTES)
    n = total // 3 // 4
    a, b, c = torch.ones(n), torch.full((n,), 2.0), torch.empty(n)
    nbytes = n * 4
    read = _best_seconds(lambda: a.sum(), repeats)
    copy = _best_seconds(lambda: c.copy_(a), repeats)
    triad = _best_seconds(lambda: torch.add(b, a, alpha=3.0, out=c), repeats)
    return Bandwidth(nbytes, nbytes / read / 1e9, 2 * nbytes / copy / 1e9, 3 * nbytes / triad / 1e9)


@torch.inference_mode()
def measure_peak_flops(repeats: int = 5, n: int = 1024, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (best of repeats): float32, or bfloat16 for the
    stages `backend.weights bf16` runs on the matrix units. float32: the faster of torch's matmul
    (MKL) and oneDNN's, which `backend.gemm` runs where MKL takes its AVX2 path (weights/gemm.py:
    2.3x MKL's on an AMD EPYC Zen 5), so that a stage on oneDNN is measured against its own roof."""
    x, y = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    best = _best_seconds(lambda: x @ y, repeats)
    if dtype == torch.float32 and torch.backends.mkldnn.is_available():
        best = min(best, _best_seconds(lambda: onednn_linear(x, y), repeats))
    return 2 * n ** 3 / best


@dataclass
class StageCost:
    name: str
    ms: float
    bytes: int
    flops: int
    rows: int = 1             # rows per weight (a decode step 1; prefill and vision many: compute-bound)

    def floor_ms(self, bw: Bandwidth, peak_flops: float) -> float:
        return max(self.memory_ms(bw), self.compute_ms(peak_flops))

    def memory_ms(self, bw: Bandwidth) -> float:
        return self.bytes / (bw.best_gbs * 1e9) * 1000

    def compute_ms(self, peak_flops: float) -> float:
        return self.flops / peak_flops * 1000


def _linear_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """x [M, K] @ W [N, K].T: 2 M K N, as the float matmul it replaces (the low-bit forms' kernels,
    weights/lowbit.py, whose first two operands are x and the weight's codes [N, ...])."""
    return 2 * a_shape[0] * a_shape[1] * b_shape[0]


register_flop_formula(torch.ops.aten._weight_int8pack_mm)(_linear_flops)


@register_flop_formula(torch.ops.mkldnn._linear_pointwise)
def _onednn_linear_flops(x_shape, w_shape, *args, out_shape=None, **kwargs) -> int:
    """oneDNN's linear (backend.gemm onednn, weights/gemm.py): x [..., K] @ W [N, K].T; torch counts none."""
    return 2 * math.prod(x_shape) * w_shape[0]


@register_flop_formula(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu)
def _cpu_attention_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs) -> int:
    """The CPU flash kernel SDPA runs (torch counts only the CUDA kernels'): q [B, H, N, D] over k, v
    [B, Hkv, S, D], every column it is given (a mask is applied after the products)."""
    b, h, n, d = q_shape
    return 2 * b * h * n * k_shape[-2] * (d + v_shape[-1])
_lowbit_flops_registered = False


def register_lowbit_flops() -> None:
    """FLOP formulas of the low-bit kernels' operators (registered once they are loaded)."""
    global _lowbit_flops_registered
    if _lowbit_flops_registered or not lowbit_kernels.load():
        return
    ops = torch.ops.litevlm_lowbit
    for op in (ops.int4_linear, ops.int8_linear, ops.fp16_linear):
        register_flop_formula(op)(_linear_flops)
    _lowbit_flops_registered = True


def count_flops(fn) -> int:
    register_lowbit_flops()
    with FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())


def kv_bytes(rt, columns: int, rows: int) -> int:
    """Bytes of the KV cache a pass of `rows` reads over `columns` cache columns (+ its rows written)."""
    llm, a = rt.cfg.llm, rt.arena
    per_column = 2 * llm.num_hidden_layers * llm.num_key_value_heads * llm.head_dim * a.k_cache.element_size()
    return per_column * (columns + rows)


def columns_read(rt, live: int) -> int:
    """Cache columns a decode step over `live` columns reads: eager torch the live ones, a graph
    backend (bound_stages.py) the smallest of its step graphs' cache buckets that holds them (the
    whole static cache unless torch-compile's cache buckets)."""
    if rt.engines.backend == "torch":
        return live
    sizes = getattr(rt.engines.decoder, "cache_sizes", (rt.arena.max_len,))
    return min(n for n in sizes if n >= live)


def head_modules(lm) -> list:
    """What the LM head reads: its Linear (or low-bit form), or, tied (InternVL3/3.5), the embedding
    table it multiplies by (float, or the one low-bit copy that also serves the lookup)."""
    return [lm.head] if isinstance(lm.head, torch.nn.Module) else [lm.embed]


def decoder_modules(rt) -> list:
    """Every module a decode step reads the weights of: the layers, the final norm and the head."""
    lm = rt.lm
    return list(lm.layers) + [lm.norm] + head_modules(lm)


def decode_step(rt, context: int):
    """One decode step as greedy decoding runs it through the runtime's engines: a row over
    `context` cached rows, the LM head, the argmax (what a token costs; the KV row is written)."""
    a, e = rt.arena, rt.engines
    context = min(context, a.max_len - 2)
    x = torch.zeros(1, rt.cfg.llm.hidden_size, dtype=rt.dtype, device=rt.device)

    def run():
        hidden = e.decoder.step(x, a.positions[context:context + 1], a.slots[context:context + 1],
                                a.all_visible(1, context), a.causal_mask(1))
        e.head.run(hidden).argmax(-1)
    return run


@torch.inference_mode()
def stage_costs(rt, stages: tuple[str, ...], context: int, prompt_rows: int, tiles: int,
                repeats: int = 5) -> list[StageCost]:
    """Each stage timed through the runtime's engines (median of `repeats`) with its bytes and
    FLOPs: `step` = one decode step (decoder over `context` cache rows + head + argmax, what a
    token costs), `prefill` over `prompt_rows`, `vision` over `tiles`, `head` one row."""
    a, e, lm, dev, dt = rt.arena, rt.engines, rt.lm, rt.device, rt.dtype
    d = rt.cfg.llm.hidden_size
    context = min(context, a.max_len - 2)
    x = torch.zeros(1, d, dtype=dt, device=dev)
    out = []
    head_bytes = weight_bytes(head_modules(lm))
    for stage in stages:
        if stage == "step":
            run = decode_step(rt, context)

            def eager():
                hidden, _, _ = lm(x, a.positions[context:context + 1], a.causal_mask(1),
                                  a.k_cache[:, :, :context], a.v_cache[:, :, :context], a.all_visible(1, context))
                lm.head(hidden)
            columns = columns_read(rt, context)
            nbytes = weight_bytes(decoder_modules(rt)) + kv_bytes(rt, columns, 1)
            out.append(StageCost(f"decode step (1 row, {context} cached)", median_ms(run, repeats, dev), nbytes,
                                 count_flops(eager)))
        elif stage == "head":
            def run():
                e.head.run(x)
            out.append(StageCost("head (1 row)", median_ms(run, repeats, dev), head_bytes,
                                 count_flops(lambda: lm.head(x))))
        elif stage == "prefill":
            t = min(prompt_rows, a.max_prompt)
            emb = torch.zeros(t, d, dtype=dt, device=dev)

            def run():
                e.decoder.prefill(emb, a.positions[:t], a.causal_mask(t))
            nbytes = weight_bytes(list(lm.layers) + [lm.norm], many_rows=True) + kv_bytes(rt, 0, t)
            out.append(StageCost(f"prefill ({t} rows)", median_ms(run, repeats, dev), nbytes,
                                 count_flops(lambda: lm(emb, a.positions[:t], a.causal_mask(t))), rows=t))
        elif stage == "vision":
            n = min(tiles, a.pixels.shape[0])
            pixels = a.pixels[:n]

            def run():
                e.vision.run(pixels)
            vision_modules = [rt.model.vision_model, rt.model.mlp1]
            out.append(
                StageCost(
                    f"vision ({n} tiles)",
                    median_ms(run, repeats, dev),
                    weight_bytes(vision_modules, many_rows=True),
                    count_flops(lambda: rt.model.encode_images(pixels, rt.pos_embed)),
                    rows=n * rt.cfg.patches_per_side**2,
                )
            )
        else:
            raise ValueError(f"roofline stage {stage!r}: one of step, head, prefill, vision")
    return out


def roofline_rows(costs: list[StageCost], bw_of, peak_of, label: str = "") -> list[list]:
    """Table rows: stage, ms, MB, GFLOP, memory floor, compute floor, floor, bound, fraction.
    `bw_of(bytes)` gives the bandwidth measured at that working-set size, `peak_of(cost)` the
    FLOP/s roof of the GEMMs that stage runs."""
    rows = []
    for c in costs:
        bw = bw_of(c.bytes)
        mem, comp = c.memory_ms(bw), c.compute_ms(peak_of(c))
        floor = max(mem, comp)
        rows.append(([label] if label else []) + [c.name, c.ms, c.bytes / 1e6, c.flops / 1e9, mem, comp, floor,
                                                  "memory" if mem >= comp else "compute", f"{floor / c.ms:.2f}"])
    return rows


ROOFLINE_HEADERS = ["stage", "ms", "MB moved", "GFLOP", "memory floor ms", "compute floor ms", "floor ms", "bound",
                    "fraction of floor"]


class Machine:
    """Bandwidth measured once per working-set size class (rounded to a power of two), peak FLOP/s
    once per matmul dtype (float32; bfloat16 when bf16 weights are measured)."""

    def __init__(self):
        self.peak_flops = measure_peak_flops()
        self._bw: dict[int, Bandwidth] = {}
        self.bf16_peak_flops: float | None = None

    def peak_for(self, weights: str, cost: StageCost) -> float:
        """The compute roof of the GEMMs a stage runs with `weights` (bf16: calls of many rows)."""
        if weights != "bf16" or cost.rows < BF16_MIN_ROWS:
            return self.peak_flops
        if self.bf16_peak_flops is None:
            self.bf16_peak_flops = measure_peak_flops(dtype=torch.bfloat16)
        return self.bf16_peak_flops

    def bandwidth(self, nbytes: int) -> Bandwidth:
        key = 1 << max(0, int(min(max(nbytes, MIN_BYTES), CAP_BYTES) - 1).bit_length())
        if key not in self._bw:
            self._bw[key] = measure_bandwidth(key)
        return self._bw[key]

    def rows(self) -> list[list]:
        return [[f"{3 * bw.array_bytes / 2 ** 20:.0f} MiB", bw.read_gbs, bw.copy_gbs, bw.triad_gbs]
                for _, bw in sorted(self._bw.items())]


BANDWIDTH_HEADERS = ["working set (3 arrays)", "read GB/s", "copy GB/s", "triad GB/s"]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


# ---------------------------------------------------------------------- the benchmark
@dataclass(frozen=True)
class RooflineStages:
    """What run_roofline times: these stages (vision, prefill, step, head), at these sizes."""
    stages: tuple[str, ...]
    context: int                # cached rows a decode step reads
    prompt_rows: int            # rows of the prefill
    tiles: int                  # tiles of the vision stage


def run_roofline(pipe, weights: list[str], measured: RooflineStages, rounds: int = 3, repeats: int = 5,
                 progress=print) -> dict:
    """Each stage's time, bytes, FLOPs and floor; with several `weights` kinds (float, int8, int4, ...)
    they alternate round by round in this process, in reversed order every other round (every
    form of the linears kept: LinearForms), so a loaded machine hits them alike. Returns the
    figures for roofline_table."""
    rt = pipe.rt
    swap = None
    if len(weights) > 1 or weights[0] != rt.options.backend.weights:
        if rt.engines.backend != "torch":
            raise ValueError(f"--weights {','.join(weights)}: alternating weights in one process needs backend torch "
                             f"(a compiled backend would recompile per switch); run one --backend.weights per process")
        quantized = None
        if "int4" in weights:        # the stored AWQ weights (int4-rtn quantizes at load)
            folder = quantized_folder(rt.options.backend.quantized, rt.model_dir)
            if folder is None:
                raise ValueError("--weights int4 reads AWQ weights from `litevlm quantize` (--backend.quantized DIR); "
                                 "int4-rtn quantizes at load")
            quantized = Quantized(folder, rt.model_dir)
        swap = LinearForms(rt.model, weights, extra=(rt.token_selector, rt.draft), quantized=quantized,
                           keep_float="float" in weights)
    machine = Machine()
    load_before = os.getloadavg()[0]
    times: dict[str, dict[str, list[float]]] = {w: {} for w in weights}
    costs: dict[str, list[StageCost]] = {}
    for r in range(rounds):
        for w in (weights if r % 2 == 0 else weights[::-1]):       # A B, B A, ...: a load trend hits both alike
            if swap is not None:
                swap.use(w)
            costs[w] = stage_costs(rt, measured.stages, measured.context, measured.prompt_rows, measured.tiles,
                                   repeats)
            for c in costs[w]:
                times[w].setdefault(c.name, []).append(c.ms)
            progress(f"[round {r + 1}/{rounds}] weights {w}: " + "  ".join(f"{c.name} {c.ms:.2f} ms" for c in costs[w]))
    for w in weights:                                   # median over the rounds
        for c in costs[w]:
            c.ms = median(times[w][c.name])
    if swap is not None and "float" in weights:
        swap.use(rt.options.backend.weights)
    rows = []
    for w in weights:
        rows += roofline_rows(costs[w], machine.bandwidth, lambda c, w=w: machine.peak_for(w, c), label=w)
    ratios = []
    pairs = [(w, weights[0]) for w in weights[1:]]
    pairs += [(w, "int8") for w in weights if w.startswith("int4") and "int8" in weights[1:]]   # int4's own bar
    for w, ref in pairs:
        ratios += [[f"{w} vs {ref}", b.name, b.ms / c.ms] for b, c in zip(costs[ref], costs[w])]
    return {"model": rt.name, "backend": rt.engines.backend, "threads": torch.get_num_threads(),
            "dtype": rt.options.dtype, "rounds": rounds, "load": (load_before, os.getloadavg()[0]),
            "peak_gflops": machine.peak_flops / 1e9, "bf16_peak_gflops": (machine.bf16_peak_flops or 0) / 1e9,
            "bandwidth": machine.rows(), "rows": rows, "ratios": ratios}


def roofline_table(result: dict) -> str:
    out = [f"model {result['model']}  backend {result['backend']}  {result['dtype']}  {result['threads']} thread(s)  "
           f"median of {result['rounds']} alternating rounds  1-min load average {result['load'][0]:.2f} before, "
           f"{result['load'][1]:.2f} after",
           "", f"machine: peak {result['peak_gflops']:.1f} GFLOP/s (1024^3 float32 matmul)"
           + (f", {result['bf16_peak_gflops']:.1f} GFLOP/s bfloat16 (the bf16 rows' compute roof)"
              if result.get("bf16_peak_gflops") else "") + "; bandwidth at each working set:",
           table(BANDWIDTH_HEADERS, result["bandwidth"]), "",
           table(["weights"] + ROOFLINE_HEADERS, result["rows"])]
    if result["ratios"]:
        out += ["", table(["same run", "stage", "speed-up"], result["ratios"])]
    return "\n".join(out)


def decode_step_line(rt, context: int) -> str:
    """One line for `litevlm bench`: the decode step at `context` cached rows against its floor."""
    machine = Machine()
    (cost,) = stage_costs(rt, ("step",), context, 0, 0)
    bw = machine.bandwidth(cost.bytes)
    floor = cost.floor_ms(bw, machine.peak_flops)
    return (f"decode step ({context} cached rows): {cost.ms:.2f} ms; floor {floor:.2f} ms = {cost.bytes / 1e6:.1f} MB "
            f"(weights + KV read) / {bw.best_gbs:.1f} GB/s measured at that working set; fraction of the floor "
            f"reached {floor / cost.ms:.2f}")
