"""Stage engines over static-shape graphs bound once to fixed buffers: the part ONNX Runtime,
TensorRT and CUDA-graph-captured PyTorch share. Only how one bucket's graph is run differs; a
backend passes a `bind(stage, bucket, inputs, outputs) -> runner` whose `runner.run()` reads the
bound inputs and writes the bound outputs (same addresses on every call).

Binding (see export.py for the graphs' tensors):
  vision   pixels -> the arena's pixels, visual -> the arena's visual tokens (zero copy)
  decoder  k_cache, v_cache -> the arena's KV cache (read in place); embeds, positions and the two
           masks are copied into engine buffers; the new K/V rows come out into engine buffers
           and are stored at their slots after the run. A call that sees no earlier cache row
           (the prompt) runs the prefill graph instead, which has no cache input.
  head     logits -> the arena's logits rows where the bucket fits, else an engine buffer
Engine buffers are allocated once, for the largest bucket, each bucket using a prefix view.

Outputs are views of bound buffers: valid until the same engine runs again.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from ..errors import LiteVLMError
from ..export import decoder_masks
from .base import Engines, StageEngine
from .buckets import pick


class Runner(Protocol):
    def run(self) -> None: ...


Bind = Callable[[str, int, dict, dict], Runner]


def flat_views(shapes: dict[int, tuple], dtype, device) -> dict[int, torch.Tensor]:
    """One buffer for the largest bucket; each bucket gets a contiguous view of its start."""
    numel = max(torch.Size(s).numel() for s in shapes.values())
    flat = torch.zeros(numel, dtype=dtype, device=device)
    return {b: flat[:torch.Size(s).numel()].view(s) for b, s in shapes.items()}


class BoundVision(StageEngine):
    stage = "vision"

    def __init__(self, pipe, sizes, bind: Bind, backend: str):
        a = pipe.arena
        self.arena, self.backend, self.sizes = a, backend, tuple(sorted(sizes))
        self.runners = {n: bind("vision", n, {"pixels": a.pixels[:n]}, {"visual": a.visual[:n]}) for n in self.sizes}

    def run(self, pixels):
        n = pixels.shape[0]
        bucket = pick(self.sizes, n, "vision")
        if pixels.data_ptr() != self.arena.pixels.data_ptr():
            self.arena.pixels[:n].copy_(pixels)      # tiles past n are stale: independent, dropped
        self.runners[bucket].run()
        return self.arena.visual[:n]


class BoundDecoder(StageEngine):
    stage = "decoder"

    def __init__(self, pipe, sizes, bind: Bind, backend: str, prefill_sizes=()):
        a, cfg = pipe.arena, pipe.cfg.llm
        self.arena, self.backend, self.sizes = a, backend, tuple(sorted(sizes))
        self.prefill_sizes = tuple(sorted(prefill_sizes))
        dev, dt = pipe.device, pipe.dtype
        layers, kv, hd, d = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        s = a.max_len
        every = sorted(set(self.sizes) | set(self.prefill_sizes))
        self.embeds = flat_views({t: (t, d) for t in every}, dt, dev)
        self.positions = flat_views({t: (t,) for t in every}, torch.long, dev)
        self.mask_cache = flat_views({t: (t, s) for t in self.sizes}, torch.bool, dev)
        self.mask_new = flat_views({t: (t, t) for t in every}, torch.bool, dev)
        self.hidden = flat_views({t: (t, d) for t in every}, dt, dev)
        self.k_new = flat_views({t: (layers, kv, t, hd) for t in every}, dt, dev)
        self.v_new = flat_views({t: (layers, kv, t, hd) for t in every}, dt, dev)
        self.prefill_runners = {}
        for t in self.prefill_sizes:
            self.mask_new[t].copy_(torch.eye(t, dtype=torch.bool, device=dev))
            inputs = {"embeds": self.embeds[t], "positions": self.positions[t], "mask_new": self.mask_new[t]}
            outputs = {"hidden": self.hidden[t], "k_new": self.k_new[t], "v_new": self.v_new[t]}
            self.prefill_runners[t] = bind("prefill", t, inputs, outputs)
        self.runners = {}
        for t in self.sizes:
            # Valid masks before any capture/warm-up run: each row sees itself only.
            decoder_masks(torch.zeros(0, 1, dtype=torch.bool, device=dev), torch.zeros(0, dtype=torch.long, device=dev),
                          s, self.mask_cache[t], self.mask_new[t])
            inputs = {"embeds": self.embeds[t], "positions": self.positions[t], "mask_cache": self.mask_cache[t],
                      "mask_new": self.mask_new[t], "k_cache": a.k_cache, "v_cache": a.v_cache}
            outputs = {"hidden": self.hidden[t], "k_new": self.k_new[t], "v_new": self.v_new[t]}
            self.runners[t] = bind("decoder", t, inputs, outputs)

    def run(self, embeds, positions, slots, mask, k_cache, v_cache):
        if k_cache.data_ptr() != self.arena.k_cache.data_ptr() or v_cache.data_ptr() != self.arena.v_cache.data_ptr():
            raise LiteVLMError(f"backend {self.backend}: the decoder is bound to the arena's KV cache; got another cache")
        t = embeds.shape[0]
        # No earlier cache row visible (every allowed column is one of this call's own slots):
        # the prompt, run by the prefill graph, which has no cache input.
        prompt = bool(self.prefill_sizes) and t <= self.prefill_sizes[-1] and bool((slots < mask.shape[1]).all())
        prompt = prompt and int(mask.sum()) == int(mask.index_select(1, slots).sum())
        b = pick(self.prefill_sizes, t, "prefill") if prompt else pick(self.sizes, t, "decoder")
        self.embeds[b][:t].copy_(embeds)
        self.positions[b][:t].copy_(positions)
        self.positions[b][t:].zero_()
        if prompt:
            new = self.mask_new[b]
            new.zero_()
            new[:t, :t] = mask.index_select(1, slots)
            pad = torch.arange(t, b, device=new.device)
            new[pad, pad] = True
            self.prefill_runners[b].run()
        else:
            decoder_masks(mask, slots, self.arena.max_len, self.mask_cache[b], self.mask_new[b])
            self.runners[b].run()
        # Store this call's K/V rows at their slots (the graph reads the cache, never writes it).
        k_cache.index_copy_(2, slots, self.k_new[b][:, :, :t])
        v_cache.index_copy_(2, slots, self.v_new[b][:, :, :t])
        return self.hidden[b][:t]


class BoundHead(StageEngine):
    stage = "head"

    def __init__(self, pipe, sizes, bind: Bind, backend: str):
        a = pipe.arena
        self.backend, self.sizes = backend, tuple(sorted(sizes))
        d, v = pipe.cfg.llm.hidden_size, pipe.cfg.llm.vocab_size
        self.hidden = flat_views({t: (t, d) for t in self.sizes}, pipe.dtype, pipe.device)
        # Logits go straight into the arena's logits rows where the bucket fits there.
        big = [t for t in self.sizes if t > a.logits.shape[0]]
        spare = flat_views({t: (t, v) for t in big}, pipe.dtype, pipe.device) if big else {}
        self.logits = {t: spare[t] if t in spare else a.logits[:t] for t in self.sizes}
        self.runners = {t: bind("head", t, {"hidden": self.hidden[t]}, {"logits": self.logits[t]}) for t in self.sizes}

    def run(self, hidden):
        t = hidden.shape[0]
        b = pick(self.sizes, t, "head")
        self.hidden[b][:t].copy_(hidden)
        self.runners[b].run()
        return self.logits[b][:t]


def bound_engines(pipe, sizes: dict[str, tuple[int, ...]], bind: Bind, backend: str) -> Engines:
    """sizes: graph stage (vision, prefill, decoder, head) -> its buckets."""
    return Engines(vision=BoundVision(pipe, sizes["vision"], bind, backend),
                   decoder=BoundDecoder(pipe, sizes["decoder"], bind, backend, sizes.get("prefill", ())),
                   head=BoundHead(pipe, sizes["head"], bind, backend))
