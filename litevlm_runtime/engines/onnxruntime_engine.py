"""ONNX Runtime engines: the exported stage graphs (see export.py), one session per bucket, with
every input and output bound once, at start-up, to fixed torch buffers through io_binding.

Zero-copy where the pipeline's tensors are arena buffers: the vision graph reads the arena's
pixels and writes the arena's visual tokens in place; the decoder graph reads the arena's KV
cache in place (its new K/V rows come out into engine buffers and are stored at their slots);
the head writes the arena's logits. Small per-call inputs (a step's embeddings, positions,
masks) are copied into engine buffers allocated once for the largest bucket. A run therefore
allocates nothing in torch, and ORT sees the same addresses every call.

Outputs are views of those buffers: valid until the same engine runs again (as with TensorRT
and CUDA graphs).

Execution providers: CPU here; on a CUDA device the CUDA provider (TensorRT's provider first
when ONNX Runtime has it), binding device memory the same way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import LiteVLMError
from ..export import check_bundle_matches, decoder_masks, graphs_of, read_manifest, verify_files
from .base import Engines, StageEngine
from .buckets import pick

ELEMENT_TYPES = {torch.float32: "float32", torch.float16: "float16", torch.int64: "int64", torch.bool: "bool"}


def import_onnxruntime():
    try:
        import onnxruntime
    except ImportError:
        raise LiteVLMError("backend onnxruntime: onnxruntime is not installed (pip install onnxruntime)") from None
    return onnxruntime


def providers_for(device: torch.device) -> list:
    ort = import_onnxruntime()
    available = ort.get_available_providers()
    if device.type == "cuda":
        wanted = ["TensorrtExecutionProvider", "CUDAExecutionProvider"]
        chosen = [p for p in wanted if p in available]
        if not chosen:
            raise LiteVLMError(f"backend onnxruntime on {device}: this onnxruntime has no CUDA provider "
                               f"(available: {', '.join(available)}); install onnxruntime-gpu or run on cpu")
        return [(p, {"device_id": device.index or 0}) for p in chosen]
    return ["CPUExecutionProvider"]


class BoundGraph:
    """One bucket's session with its inputs/outputs bound to fixed tensors."""

    def __init__(self, path: Path, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor],
                 device: torch.device, threads: int | None = None):
        import numpy as np

        ort = import_onnxruntime()
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if threads:
            opts.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(path), opts, providers=providers_for(device))
        self.binding = self.session.io_binding()
        device_type = "cuda" if device.type == "cuda" else "cpu"
        names_in = [i.name for i in self.session.get_inputs()]
        names_out = [o.name for o in self.session.get_outputs()]
        if sorted(names_in) != sorted(inputs) or sorted(names_out) != sorted(outputs):
            raise LiteVLMError(f"{path.name}: graph has {names_in} -> {names_out}, engine binds "
                               f"{list(inputs)} -> {list(outputs)}")
        self.tensors = {**inputs, **outputs}   # keep the bound memory alive with the binding
        for kind, tensors in (("input", inputs), ("output", outputs)):
            for name, t in tensors.items():
                if not t.is_contiguous():
                    raise LiteVLMError(f"{path.name}: {name} must be bound to contiguous memory")
                if t.dtype not in ELEMENT_TYPES:
                    raise LiteVLMError(f"backend onnxruntime: {t.dtype} is not supported (float32 or float16)")
                bind = self.binding.bind_input if kind == "input" else self.binding.bind_output
                bind(name, device_type, device.index or 0, np.dtype(ELEMENT_TYPES[t.dtype]), tuple(t.shape),
                     t.data_ptr())

    def run(self) -> None:
        self.session.run_with_iobinding(self.binding)


def flat_views(shapes: dict[int, tuple], dtype, device) -> dict[int, torch.Tensor]:
    """One buffer for the largest bucket; each bucket gets a contiguous view of its start."""
    numel = max(torch.Size(s).numel() for s in shapes.values())
    flat = torch.zeros(numel, dtype=dtype, device=device)
    return {b: flat[:torch.Size(s).numel()].view(s) for b, s in shapes.items()}


class Bundle:
    def __init__(self, pipe, bundle: Path):
        self.dir = Path(bundle)
        self.manifest = read_manifest(self.dir)
        check_bundle_matches(self.manifest, pipe, self.dir)
        verify_files(self.manifest, self.dir)

    def graphs(self, stage: str) -> dict[int, dict]:
        g = graphs_of(self.manifest, stage)
        if not g:
            raise LiteVLMError(f"{self.dir}: no {stage} graphs in the bundle")
        return g


class OrtVision(StageEngine):
    stage, backend = "vision", "onnxruntime"

    def __init__(self, pipe, bundle: Bundle, threads=None):
        a = pipe.arena
        self.arena = a
        self.sizes = tuple(sorted(bundle.graphs("vision")))
        self.graphs = {n: BoundGraph(bundle.dir / g["file"], {"pixels": a.pixels[:n]}, {"visual": a.visual[:n]},
                                     pipe.device, threads)
                       for n, g in bundle.graphs("vision").items()}

    def run(self, pixels):
        n = pixels.shape[0]
        bucket = pick(self.sizes, n, "vision")
        if pixels.data_ptr() != self.arena.pixels.data_ptr():
            self.arena.pixels[:n].copy_(pixels)      # tiles past n are stale: independent, dropped
        self.graphs[bucket].run()
        return self.arena.visual[:n]


class OrtDecoder(StageEngine):
    stage, backend = "decoder", "onnxruntime"

    def __init__(self, pipe, bundle: Bundle, threads=None):
        a, cfg = pipe.arena, pipe.cfg.llm
        self.arena = a
        graphs = bundle.graphs("decoder")
        self.sizes = tuple(sorted(graphs))
        dev, dt = pipe.device, pipe.dtype
        layers, kv, hd, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        s = a.max_len
        self.embeds = flat_views({t: (t, d) for t in self.sizes}, dt, dev)
        self.positions = flat_views({t: (t,) for t in self.sizes}, torch.long, dev)
        self.mask_cache = flat_views({t: (t, s) for t in self.sizes}, torch.bool, dev)
        self.mask_new = flat_views({t: (t, t) for t in self.sizes}, torch.bool, dev)
        self.hidden = flat_views({t: (t, d) for t in self.sizes}, dt, dev)
        self.k_new = flat_views({t: (layers, kv, t, hd) for t in self.sizes}, dt, dev)
        self.v_new = flat_views({t: (layers, kv, t, hd) for t in self.sizes}, dt, dev)
        self.graphs = {}
        for t, g in graphs.items():
            inputs = {"embeds": self.embeds[t], "positions": self.positions[t], "mask_cache": self.mask_cache[t],
                      "mask_new": self.mask_new[t], "k_cache": a.k_cache, "v_cache": a.v_cache}
            outputs = {"hidden": self.hidden[t], "k_new": self.k_new[t], "v_new": self.v_new[t]}
            self.graphs[t] = BoundGraph(bundle.dir / g["file"], inputs, outputs, dev, threads)

    def run(self, embeds, positions, slots, mask, k_cache, v_cache):
        if k_cache.data_ptr() != self.arena.k_cache.data_ptr() or v_cache.data_ptr() != self.arena.v_cache.data_ptr():
            raise LiteVLMError("backend onnxruntime: the decoder is bound to the arena's KV cache; got another cache")
        t = embeds.shape[0]
        b = pick(self.sizes, t, "decoder")
        self.embeds[b][:t].copy_(embeds)
        self.positions[b][:t].copy_(positions)
        self.positions[b][t:].zero_()
        decoder_masks(mask, slots, self.arena.max_len, self.mask_cache[b], self.mask_new[b])
        self.graphs[b].run()
        # Store this call's K/V rows at their slots (the graph reads the cache, never writes it).
        k_cache.index_copy_(2, slots, self.k_new[b][:, :, :t])
        v_cache.index_copy_(2, slots, self.v_new[b][:, :, :t])
        return self.hidden[b][:t]


class OrtHead(StageEngine):
    stage, backend = "head", "onnxruntime"

    def __init__(self, pipe, bundle: Bundle, threads=None):
        a = pipe.arena
        graphs = bundle.graphs("head")
        self.sizes = tuple(sorted(graphs))
        d, v = pipe.cfg.llm.hidden_size, pipe.cfg.llm.vocab_size
        self.hidden = flat_views({t: (t, d) for t in self.sizes}, pipe.dtype, pipe.device)
        # Logits go straight into the arena's logits rows where the bucket fits there.
        big = [t for t in self.sizes if t > a.logits.shape[0]]
        spare = flat_views({t: (t, v) for t in big}, pipe.dtype, pipe.device) if big else {}
        self.logits = {t: spare[t] if t in spare else a.logits[:t] for t in self.sizes}
        self.graphs = {t: BoundGraph(bundle.dir / g["file"], {"hidden": self.hidden[t]}, {"logits": self.logits[t]},
                                     pipe.device, threads)
                       for t, g in graphs.items()}

    def run(self, hidden):
        t = hidden.shape[0]
        b = pick(self.sizes, t, "head")
        self.hidden[b][:t].copy_(hidden)
        self.graphs[b].run()
        return self.logits[b][:t]


def bundle_path(pipe) -> Path:
    bundle = pipe.options.extra.get("bundle")
    if not bundle:
        raise LiteVLMError(f"backend {pipe.options.backend}: no bundle given (PipelineOptions(extra={{'bundle': DIR}}) "
                           f"or --bundle DIR); make one with `litevlm export --model MODEL --out DIR`")
    return Path(bundle)


def onnxruntime_engines(pipe) -> Engines:
    import_onnxruntime()
    if pipe.dtype not in (torch.float32, torch.float16):
        raise LiteVLMError(f"backend onnxruntime: dtype {pipe.options.dtype} is not supported (float32 or float16)")
    bundle = Bundle(pipe, bundle_path(pipe))
    threads = pipe.options.extra.get("ort_threads")
    return Engines(vision=OrtVision(pipe, bundle, threads), decoder=OrtDecoder(pipe, bundle, threads),
                   head=OrtHead(pipe, bundle, threads))
