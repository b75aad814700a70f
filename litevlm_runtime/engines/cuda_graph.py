"""PyTorch on a GPU with CUDA graphs (backend `torch-cudagraph`).

Each stage is captured once per shape bucket with torch.cuda.CUDAGraph over static buffers (the
arena's pixels, visual tokens and KV cache; engine buffers for the small per-call inputs, see
bound_stages.py) and replayed; a replay launches the whole stage with one call and no Python.
The captured modules are the export forms of the stages (export.py): static shapes, the cache
read in place and the new K/V rows written to fixed outputs, so no shape or address ever
changes between replays. All buckets share one memory pool (they never run concurrently).

`capture=False` runs the very same modules on the same bound buffers without capturing: that is
what runs (and is tested) on machines without CUDA, so everything but the capture itself is
checked on the CPU.
"""

from __future__ import annotations

import torch

from ..errors import LiteVLMError
from .bound_stages import bound_engines
from .buckets import batch_sizes, check_fits, default_buckets, parse_buckets
from .stages import BatchDecoderStage, DecoderStage, DraftStage, HeadStage, PrefillStage, VisionStage

WARMUP_RUNS = 2   # cuBLAS/cuDNN handles and autotuning happen outside the capture


class StaticStage:
    """module(*inputs) -> outputs, copied into the bound output buffers; eager (no capture)."""

    def __init__(self, module, inputs: dict, outputs: dict):
        self.module, self.inputs, self.outputs = module, list(inputs.values()), list(outputs.values())

    def step(self) -> None:
        result = self.module(*self.inputs)
        result = result if isinstance(result, tuple) else (result,)
        for out, value in zip(self.outputs, result):
            out.copy_(value)

    def run(self) -> None:
        self.step()


class CapturedStage(StaticStage):
    def __init__(self, module, inputs: dict, outputs: dict, pool):
        super().__init__(module, inputs, outputs)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.step()

    def run(self) -> None:
        self.graph.replay()


def require_cuda(rt) -> None:
    if not torch.cuda.is_available():
        raise LiteVLMError("backend torch-cudagraph needs CUDA: torch.cuda.is_available() is False "
                           "(this torch build or machine has no GPU); use backend torch on the CPU")
    if rt.device.type != "cuda":
        raise LiteVLMError(f"backend torch-cudagraph captures CUDA work; the pipeline is on {rt.device} "
                           f"(set device cuda)")


def cuda_graph_engines(rt, capture: bool = True, buckets=None):
    """Every stage (the EAGLE-2 draft head too, when the runtime has one, and the batched step per
    batch bucket when the arena has several KV regions) captured per bucket; capture=False runs
    the same bound modules eagerly (the CPU form of this backend)."""
    if capture:
        require_cuda(rt)
    defaults = default_buckets(rt.arena)
    buckets = buckets or parse_buckets(rt.options.backend.buckets, defaults)
    check_fits(buckets, rt.arena)
    modules = {"vision": VisionStage(rt.model, rt.pos_embed).eval(), "decoder": DecoderStage(rt.lm).eval(),
               "prefill": PrefillStage(rt.lm).eval(), "head": HeadStage(rt.lm).eval()}
    if rt.draft is not None:
        modules["eagle_draft"] = DraftStage(rt.draft).eval()
    pool = torch.cuda.graph_pool_handle() if capture else None

    def bind(stage, bucket, inputs, outputs):
        with torch.inference_mode():
            if capture:
                return CapturedStage(modules[stage], inputs, outputs, pool)
            return StaticStage(modules[stage], inputs, outputs)

    sizes = {stage: buckets.for_stage(stage) for stage in ("vision", "prefill", "decoder", "head")}
    sizes["decoder_cache"] = buckets.cache          # () unless backend.buckets sets cache=: the whole cache
    if rt.draft is not None:
        sizes["eagle_draft"] = buckets.decoder()        # the draft's pending rows reach prompt sizes
    sizes["decoder_batch"] = batch_sizes(buckets.batch, rt.arena.limits.batch, "backend torch-cudagraph's buckets")
    if sizes["decoder_batch"]:
        modules["decoder_batch"] = BatchDecoderStage(rt.lm).eval()
    return bound_engines(rt, sizes, bind, "torch-cudagraph" if capture else "torch-static")
