"""PyTorch compiled with torch.compile (backend `torch-compile`, CPU and GPU).

The same export-form stage modules and bound buffers as the CUDA-graph backend (export.py,
bound_stages.py), each compiled once per shape bucket with static shapes: inductor fuses the
small kernels of a layer (RMSNorm, RoPE, SiLU x up, residual adds) into a few C++/OpenMP loops on
the CPU (Triton kernels on a GPU) and runs the stage as one call, without Python between the
operators. That per-operator overhead is most of a decode step's time for the bundled model
(docs/performance.md).

Why bound buffers: every call of a bucket sees the same shapes, strides and dtypes, so dynamo's
guards hold and nothing recompiles in steady state (`dynamic=False`: a new bucket is a new static
graph, never a symbolic one). A decode-step graph attends over a prefix of the static cache under
its mask, one graph per (rows, cache columns) bucket (`cache_buckets`; the exported graphs read the
whole cache); the outputs are written into the bound buffers inside the graph
(`out.copy_(value)` compiles to the kernels writing there).

Compile time: every bucket is compiled at start-up (`CompiledStage.__init__` runs it once) and the
seconds per stage are kept in `compile_seconds` (`litevlm bench` prints them). Inductor's FX graph
cache and AOTAutograd cache (on by default in torch 2.13, under TORCHINDUCTOR_CACHE_DIR, default
/tmp/torchinductor_$USER) make a second start-up of the same model and buckets reuse the
generated code: only dynamo's tracing runs again.
"""

from __future__ import annotations

import sys
import time
import types

import torch
from tqdm import tqdm

from ..errors import LiteVLMError
from .bound_stages import bound_engines
from .buckets import Buckets, batch_sizes, check_fits, default_buckets, parse_buckets, step_cache_sizes
from .stages import BatchDecoderStage, DecoderStage, DraftStage, HeadStage, PrefillStage, VisionStage

BACKEND = "torch-compile"
PREFILL_STEP = 64
FIRST_CACHE_BUCKET = 256            # cache columns of the smallest step graph (a one-camera prompt is ~120 rows)


class WriteOutputs(torch.nn.Module):
    """module(*inputs) copied into the bound output buffers, inside the compiled graph."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        result = self.module(*inputs)
        result = result if isinstance(result, tuple) else (result,)
        for out, value in zip(outputs, result):
            out.copy_(value)


def compiled_graph(module: torch.nn.Module, name: str):
    """torch.compile of `module` (a WriteOutputs) as a function with a code object of its own,
    without guards on the module's parameters. On every call dynamo checks the guards of the
    graphs kept on the code object it intercepts; those were ~120 tensor checks of the weights
    (0.23 ms a call, 8% of a decode step; docs/performance.md), and a module compiled whole shares
    one code object with every other stage and bucket. The weights never change under a compiled
    engine (its stages are bound at start-up; `litevlm bench --roofline` refuses to swap linears
    under a compiled backend), so its own code object keeps one graph, guarded on its inputs."""
    def write_outputs(inputs, outputs):
        module(inputs, outputs)
    code = write_outputs.__code__.replace(co_name=f"write_outputs_{name}")
    own = types.FunctionType(code, write_outputs.__globals__, code.co_name, None, write_outputs.__closure__)
    return torch.compile(own, dynamic=False, fullgraph=True,
                         options={"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe})


class CompiledStage:
    """One stage at one bucket: its module compiled for the bound buffers' static shapes; the
    first run (here, at start-up) compiles."""

    def __init__(self, compiled, inputs: dict, outputs: dict):
        self.compiled, self.inputs, self.outputs = compiled, list(inputs.values()), list(outputs.values())
        t0 = time.perf_counter()
        self.run()
        self.compile_seconds = time.perf_counter() - t0

    def run(self) -> None:
        self.compiled(self.inputs, self.outputs)


def compile_counters() -> dict[str, int]:
    """dynamo's counts so far in this process: graphs compiled, and frames it was asked to
    (re)compile (what the no-recompilation test compares before and after steady-state queries)."""
    # Imported here: torch._dynamo loads for seconds, and every engine user imports this module (engines/
    # __init__.py); only a compiled backend pays for it.
    from torch._dynamo.utils import counters

    return {"graphs": int(counters["stats"]["unique_graphs"]), "frames": int(sum(counters["frames"].values()))}


def compiled_defaults(arena, coarse: Buckets) -> Buckets:
    """The arena's buckets with prefill every PREFILL_STEP rows up to the longest prompt: a prompt
    pads at most PREFILL_STEP - 1 rows (the coarse quarter/half/full buckets padded a one-camera
    prompt of 121 rows to 192: 1.6x the work of a compute-bound stage)."""
    longest = arena.max_prompt
    prefill = tuple(range(PREFILL_STEP, longest, PREFILL_STEP)) + (longest,)
    return Buckets(vision=coarse.vision, prefill=prefill, step=coarse.step, head=coarse.head, batch=coarse.batch,
                   cache=cache_buckets(arena.max_len))


def cache_buckets(max_len: int) -> tuple[int, ...]:
    """The cache columns the decode-step graphs read: 256, 512, 1024 ... below the arena's max_len,
    and max_len. A compiled step attends over every column it is given (masked or not), and the
    arena is sized for the longest conversation (follow-ups: 1911 columns for the bundled model)
    while a first question's prompt is 120-400 rows: a step over the smallest prefix that holds the
    live columns does that much less attention work."""
    sizes, n = [], FIRST_CACHE_BUCKET
    while n < max_len:
        sizes.append(n)
        n *= 2
    return tuple(sizes) + (max_len,)


def compiled_engines(rt, buckets=None):
    """Every stage (the EAGLE-2 draft head too, when the runtime has one, and the batched step
    when the arena has several KV regions) compiled per bucket."""
    if rt.device.type == "cuda" and not torch.cuda.is_available():
        raise LiteVLMError("backend torch-compile on cuda: torch.cuda.is_available() is False")
    coarse = default_buckets(rt.arena)
    buckets = buckets or parse_buckets(rt.options.backend.buckets, compiled_defaults(rt.arena, coarse))
    check_fits(buckets, rt.arena)
    modules = {"vision": VisionStage(rt.model, rt.pos_embed), "decoder": DecoderStage(rt.lm),
               "prefill": PrefillStage(rt.lm), "head": HeadStage(rt.lm)}
    if rt.draft is not None:
        modules["eagle_draft"] = DraftStage(rt.draft)
    sizes = {stage: buckets.for_stage(stage) for stage in ("vision", "prefill", "decoder", "head")}
    if rt.device.type == "cpu":
        # A compiled prefill measured no faster than the eager forward on the CPU (the same oneDNN
        # GEMMs; 256 rows: 63-68 against 62-64 ms), and it adds the bucket's padding and ~30 graphs
        # to compile (docs/performance.md): the prompt runs eager.
        sizes["prefill"] = ()
        del modules["prefill"]
        # Vision too: eager, its linears take oneDNN's float32 matmul or the bf16 GEMMs
        # (weights/gemm.py, bf16.py), which a graph cannot call; compiled it ran on F.linear's
        # kernel (AMD EPYC Zen 5, median of 16 queries: 18.7 compiled against 16.3 ms eager in
        # float32, 13.8 against 11.6-12.1 ms with bf16 weights; equal on the Intel machine).
        sizes["vision"] = ()
        del modules["vision"]
    if rt.draft is not None:
        # the draft's pending rows reach prompt sizes: the coarse buckets (only its catch-up pays the padding)
        sizes["eagle_draft"] = tuple(sorted(set(coarse.prefill) | set(buckets.step)))
    sizes["decoder_cache"] = step_cache_sizes(buckets.cache or cache_buckets(rt.arena.max_len), rt.arena.max_len)
    sizes["decoder_batch"] = batch_sizes(buckets.batch, rt.arena.limits.batch, "backend torch-compile's buckets")
    if sizes["decoder_batch"]:
        modules["decoder_batch"] = BatchDecoderStage(rt.lm)
    graphs = {stage: len(s) for stage, s in sizes.items() if stage != "decoder_cache"}
    graphs["decoder"] *= len(sizes["decoder_cache"])
    wrapped = {stage: WriteOutputs(m.eval()) for stage, m in modules.items()}
    compiled: dict[tuple, object] = {}        # (stage, input shapes) -> its graph, shared by the KV regions
    seconds: dict[str, float] = {}
    # Minutes on a cold cache: a bar on stderr. Each further KV region binds the step graphs again
    # (cache hits, no compilation).
    regions = rt.arena.limits.batch if sizes["decoder_batch"] else 1
    bar = tqdm(total=sum(graphs.values()) + graphs["decoder"] * (regions - 1), desc="torch-compile", unit="graph",
               file=sys.stderr, dynamic_ncols=True)

    def bind(stage, bucket, inputs, outputs):
        bar.set_postfix_str(f"{stage} {bucket}")
        key = (stage, tuple(tuple(x.shape) for x in inputs.values()))
        if key not in compiled:
            compiled[key] = compiled_graph(wrapped[stage], f"{stage}_{len(compiled)}")
        with torch.inference_mode():
            runner = CompiledStage(compiled[key], inputs, outputs)
        seconds[stage] = seconds.get(stage, 0.0) + runner.compile_seconds
        bar.update()
        return runner

    with bar:
        engines = bound_engines(rt, sizes, bind, BACKEND)
    engines.decoder.compile_seconds = seconds         # per stage, all its buckets (read by `litevlm bench`)
    return engines
