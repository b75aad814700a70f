"""Stage engines over static-shape graphs bound once to fixed buffers: the part ONNX Runtime,
TensorRT and CUDA-graph-captured PyTorch share. Only how one bucket's graph is run differs; a
backend passes a `bind(stage, bucket, inputs, outputs) -> runner` whose `runner.run()` reads the
bound inputs and writes the bound outputs (same addresses on every call).

Binding (see export.py for the graphs' tensors):
  vision   pixels -> the arena's pixels, visual -> the arena's visual tokens (zero copy)
  decoder  k_cache, v_cache -> the arena's KV cache (read in place; a quantized cache as its codes
           and its scales, k_cache_scale and v_cache_scale); embeds, positions and the two
           masks are copied into engine buffers; the new K/V rows come out into engine buffers
           and are stored at their slots after the run (quantized there when the cache is). `prefill`
           runs the prefill graph, which
           has no cache input (without prefill sizes the prompt runs the model's eager forward:
           torch-compile on the CPU); `step` runs the step graph over the whole static cache, or over
           the smallest bound prefix of its columns that holds the live ones (torch-compile)
           `on_region(k, v)`: the same graphs with the step bound again over another KV region
           (each query of a batch prefills and, when alone, steps in its own region)
  decoder_batch  k_regions, v_regions -> the arena's first B KV regions [B, layers, Hkv, S, D]
           (read in place); the rows of the regions past the running span are padding that
           sees only itself; row b's new K/V row is stored at its slot in region b
  draft    the same as a step, over the arena's one-layer draft cache (when the bundle has
           eagle_draft graphs)
  head     logits -> the arena's logits rows where the bucket fits, else an engine buffer
Engine buffers are allocated once, for the largest bucket, each bucket using a prefix view.
Padding rows see only themselves (an identity block in mask_new), so their softmax stays finite.

Outputs are views of bound buffers: valid until the same engine runs again.
"""

from __future__ import annotations

import copy
from typing import Callable, Protocol

import torch

from ..models.kv_cache import cache_inputs
from .base import BatchDecoderEngine, DecoderEngine, DraftEngine, Engines, HeadEngine, VisionEngine
from .buckets import pick, step_cache_sizes
from .torch_engine import TorchDraft, TorchVision, prefill_eager, step_eager, store_batched


def kv_inputs(*caches) -> dict[str, torch.Tensor]:
    """(name, cache) pairs as a graph's inputs, in the stage modules' order: the caches (float, or a
    quantized cache's codes), then a quantized cache's scales (name + "_scale")."""
    parts = [cache_inputs(name, cache) for name, cache in caches]
    return {k: v for part in parts for k, v in list(part.items())[:1]} | \
        {k: v for part in parts for k, v in list(part.items())[1:]}


class Runner(Protocol):
    def run(self) -> None: ...


Bind = Callable[[str, int, dict, dict], Runner]


def flat_views(shapes: dict[int, tuple], dtype, device) -> dict[int, torch.Tensor]:
    """One buffer for the largest bucket; each bucket gets a contiguous view of its start."""
    numel = max(torch.Size(s).numel() for s in shapes.values())
    flat = torch.zeros(numel, dtype=dtype, device=device)
    return {b: flat[:torch.Size(s).numel()].view(s) for b, s in shapes.items()}


class BoundVision(VisionEngine):
    def __init__(self, rt, sizes, bind: Bind, backend: str):
        a = rt.arena
        self.arena, self.backend, self.sizes = a, backend, tuple(sorted(sizes))
        self.runners = {n: bind("vision", n, {"pixels": a.pixels[:n]}, {"visual": a.visual[:n]}) for n in self.sizes}

    def run(self, pixels):
        """pixels [n, 3, S, S] -> visual [n, tokens_per_tile, D] (a view of the bound output)"""
        n = pixels.shape[0]
        bucket = pick(self.sizes, n, "vision")
        if pixels.data_ptr() != self.arena.pixels.data_ptr():
            self.arena.pixels[:n].copy_(pixels)      # tiles past n are stale: independent, dropped
        self.runners[bucket].run()
        return self.arena.visual[:n]


class BoundRows:
    """The per-call inputs and new-row outputs of a decoder-like graph, per bucket: embeds (and
    features), positions, the two masks, hidden, k_new, v_new."""

    def __init__(self, rt, every: list[int], layers: int, cache_len: int, with_features: bool = False):
        cfg, dev, dt = rt.cfg.llm, rt.device, rt.dtype
        kv, hd, d = cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.embeds = flat_views({t: (t, d) for t in every}, dt, dev)
        self.features = flat_views({t: (t, d) for t in every}, dt, dev) if with_features else None
        self.positions = flat_views({t: (t,) for t in every}, torch.long, dev)
        self.mask_cache = flat_views({t: (t, cache_len) for t in every}, torch.bool, dev)
        self.mask_new = flat_views({t: (t, t) for t in every}, torch.bool, dev)
        self.eye = {t: torch.eye(t, dtype=torch.bool, device=dev) for t in every}
        self.hidden = flat_views({t: (t, d) for t in every}, dt, dev)
        self.k_new = flat_views({t: (layers, kv, t, hd) for t in every}, dt, dev)
        self.v_new = flat_views({t: (layers, kv, t, hd) for t in every}, dt, dev)
        for t in every:
            self.mask_new[t].copy_(self.eye[t])      # valid masks before any capture/warm-up run

    def load(self, b: int, embeds, positions, mask_new, mask_cache=None, features=None) -> None:
        """Copy this call's rows into bucket `b`'s static inputs: embeds [T, D], positions [T],
        mask_new [T, T], mask_cache [T, L], features [T, D] (the draft's); padding rows masked."""
        t = embeds.shape[0]
        self.embeds[b][:t].copy_(embeds)
        if features is not None:
            self.features[b][:t].copy_(features)
        self.positions[b][:t].copy_(positions)
        self.positions[b][t:].zero_()
        new = self.mask_new[b]
        new.copy_(self.eye[b])
        new[:t, :t] = mask_new
        if mask_cache is not None:
            old = self.mask_cache[b]
            old.zero_()
            old[:t, :mask_cache.shape[1]] = mask_cache

    def store(self, b: int, t: int, slots, k_cache, v_cache) -> None:
        """This call's K/V rows (bucket `b`'s first t) into k_cache, v_cache [layers, Hkv, S, hd] at
        slots [t] (the graph reads the cache, never writes it)."""
        k_cache.index_copy_(2, slots, self.k_new[b][:, :, :t])
        v_cache.index_copy_(2, slots, self.v_new[b][:, :, :t])


class BoundDecoder(DecoderEngine):
    """`cache_sizes`: the cache columns a step graph reads, per bucket (a step over L live columns
    runs in the smallest >= L), the whole static cache always among them; () = that one only
    (ONNX Runtime and TensorRT bind contiguous buffers: a column prefix of the cache is not)."""

    def __init__(self, rt, step_sizes, bind: Bind, backend: str, prefill_sizes, cache_sizes=()):
        a = rt.arena
        self.arena, self.backend, self.bind = a, backend, bind
        self.k_cache, self.v_cache = a.k_cache, a.v_cache
        self.sizes, self.prefill_sizes = tuple(sorted(step_sizes)), tuple(sorted(prefill_sizes))
        self.cache_sizes = step_cache_sizes(cache_sizes, a.max_len)
        self.lm = rt.lm                   # prefill without graphs (no prefill sizes): the model's own forward
        every = sorted(set(self.sizes) | set(self.prefill_sizes))
        self.rows = r = BoundRows(rt, every, rt.cfg.llm.num_hidden_layers, a.max_len)
        self.prefill_runners = {
            t: bind("prefill", t, {"embeds": r.embeds[t], "positions": r.positions[t], "mask_new": r.mask_new[t]},
                    {"hidden": r.hidden[t], "k_new": r.k_new[t], "v_new": r.v_new[t]}) for t in self.prefill_sizes}
        self.step_runners = self.bind_steps()
        self.regions: dict[int, BoundDecoder] = {self.k_cache.data_ptr(): self}    # shared by every region's copy

    def bind_steps(self) -> dict:
        """(rows, cache columns) -> the step graph bound to the first columns of the cache and mask."""
        r = self.rows
        return {(t, n): self.bind("decoder", t, {"embeds": r.embeds[t], "positions": r.positions[t],
                                                 "mask_cache": r.mask_cache[t][:, :n], "mask_new": r.mask_new[t],
                                                 **kv_inputs(("k_cache", self.k_cache[:, :, :n]),
                                                             ("v_cache", self.v_cache[:, :, :n]))},
                                  {"hidden": r.hidden[t], "k_new": r.k_new[t], "v_new": r.v_new[t]})
                for t in self.sizes for n in self.cache_sizes}

    def on_region(self, k_cache, v_cache):
        """k_cache, v_cache [layers, Hkv, S, hd]: the same graphs over another KV region. The
        prefill graphs and row buffers shared (a prompt has no cache input: only where its
        rows are stored changes), the step graphs bound again over this region's cache, once per
        region for the engine's life (a CUDA graph is captured once, not per BatchDecoder)."""
        key = k_cache.data_ptr()
        if key not in self.regions:
            other = copy.copy(self)
            other.k_cache, other.v_cache = k_cache, v_cache
            other.step_runners = other.bind_steps()
            self.regions[key] = other
        return self.regions[key]

    def prefill(self, embeds, positions, mask):
        """embeds [T, D], positions [T], mask [T, T] -> hidden [T, D]"""
        t = embeds.shape[0]
        if not self.prefill_sizes:
            return prefill_eager(self.lm, self.k_cache, self.v_cache, embeds, positions, mask)
        b = pick(self.prefill_sizes, t, "prefill")
        self.rows.load(b, embeds, positions, mask)
        self.prefill_runners[b].run()
        self.rows.store(b, t, self.arena.slots[:t], self.k_cache, self.v_cache)
        return self.rows.hidden[b][:t]

    @property
    def extends_prompt(self) -> bool:
        return not self.prefill_sizes         # the prompt runs the model's own forward (the CPU's torch-compile)

    def prefill_after(self, embeds, positions, slots, mask_cache, mask_new):
        """embeds [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T] -> hidden [T, D]"""
        if self.prefill_sizes:
            return super().prefill_after(embeds, positions, slots, mask_cache, mask_new)
        return step_eager(self.lm, self.k_cache, self.v_cache, embeds, positions, slots, mask_cache, mask_new)

    def step(self, embeds, positions, slots, mask_cache, mask_new):
        """embeds [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T] -> hidden [T, D]"""
        t = embeds.shape[0]
        b = pick(self.sizes, t, "decoder")
        n = pick(self.cache_sizes, mask_cache.shape[1], "decoder cache")
        self.rows.load(b, embeds, positions, mask_new, mask_cache)
        self.step_runners[b, n].run()
        self.rows.store(b, t, slots, self.k_cache, self.v_cache)
        return self.rows.hidden[b][:t]


class BoundBatchDecoder(BatchDecoderEngine):
    """The batched step's graph per batch bucket, bound to the arena's first `bucket` KV
    regions; B rows run in the smallest bucket >= B, the rows past B as padding (positions 0,
    cache mask all False, their own new row only: BoundRows.load)."""

    def __init__(self, rt, sizes, bind: Bind, backend: str):
        a = rt.arena
        self.arena, self.backend, self.sizes = a, backend, tuple(sorted(sizes))
        self.rows = r = BoundRows(rt, list(self.sizes), rt.cfg.llm.num_hidden_layers, a.max_len)
        self.runners = {
            b: bind("decoder_batch", b, {"embeds": r.embeds[b], "positions": r.positions[b],
                                         "mask_cache": r.mask_cache[b], "mask_new": r.mask_new[b],
                                         **kv_inputs(("k_regions", a.k_regions[:b]), ("v_regions", a.v_regions[:b]))},
                    {"hidden": r.hidden[b], "k_new": r.k_new[b], "v_new": r.v_new[b]}) for b in self.sizes}

    def step(self, embeds, positions, slots, mask_cache, mask_new):
        """embeds [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T] -> hidden [T, D]"""
        t = embeds.shape[0]
        b = pick(self.sizes, t, "decoder_batch")
        self.rows.load(b, embeds, positions, mask_new, mask_cache)
        self.runners[b].run()
        a = self.arena
        store_batched(a.k_regions, a.v_regions, a.slots[:t], slots, self.rows.k_new[b][:, :, :t],
                      self.rows.v_new[b][:, :, :t])
        return self.rows.hidden[b][:t]


class BoundDraft(DraftEngine):
    def __init__(self, rt, sizes, bind: Bind, backend: str):
        a = rt.arena
        self.arena, self.backend, self.sizes = a, backend, tuple(sorted(sizes))
        self.rows = r = BoundRows(rt, list(self.sizes), 1, a.max_len, with_features=True)
        self.runners = {
            t: bind("eagle_draft", t, {"token_embeds": r.embeds[t], "features": r.features[t],
                                       "positions": r.positions[t], "mask_cache": r.mask_cache[t],
                                       "mask_new": r.mask_new[t], "k_cache": a.draft_k, "v_cache": a.draft_v},
                    {"features_out": r.hidden[t], "k_new": r.k_new[t], "v_new": r.v_new[t]}) for t in self.sizes}

    def step(self, token_embeds, features, positions, slots, mask_cache, mask_new):
        """token_embeds [T, D], features [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T]
        -> features [T, D]"""
        t = token_embeds.shape[0]
        b = pick(self.sizes, t, "eagle_draft")
        self.rows.load(b, token_embeds, positions, mask_new, mask_cache, features)
        self.runners[b].run()
        self.rows.store(b, t, slots, self.arena.draft_k, self.arena.draft_v)
        return self.rows.hidden[b][:t]


class BoundHead(HeadEngine):
    def __init__(self, rt, sizes, bind: Bind, backend: str):
        a = rt.arena
        self.backend, self.sizes = backend, tuple(sorted(sizes))
        d, v = rt.cfg.llm.hidden_size, rt.cfg.llm.vocab_size
        self.hidden = flat_views({t: (t, d) for t in self.sizes}, rt.dtype, rt.device)
        # Logits go straight into the arena's logits rows where the bucket fits there.
        big = [t for t in self.sizes if t > a.logits.shape[0]]
        spare = flat_views({t: (t, v) for t in big}, rt.dtype, rt.device) if big else {}
        self.logits = {t: spare[t] if t in spare else a.logits[:t] for t in self.sizes}
        self.runners = {t: bind("head", t, {"hidden": self.hidden[t]}, {"logits": self.logits[t]}) for t in self.sizes}

    def run(self, hidden):
        """hidden [T, D] -> logits [T, V]"""
        t = hidden.shape[0]
        b = pick(self.sizes, t, "head")
        self.hidden[b][:t].copy_(hidden)
        self.runners[b].run()
        return self.logits[b][:t]


def bound_engines(rt, sizes: dict[str, tuple[int, ...]], bind: Bind, backend: str) -> Engines:
    """sizes: graph stage (vision, prefill, decoder, head, and eagle_draft / decoder_batch when
    bound) -> its buckets; `decoder_cache`: the step graphs' cache-column buckets (BoundDecoder). Without
    eagle_draft graphs the draft head runs in eager PyTorch beside
    the bound stages; without decoder_batch buckets there is no batched step."""

    a = rt.arena
    draft = None
    if rt.draft is not None:
        draft = (BoundDraft(rt, sizes["eagle_draft"], bind, backend) if sizes.get("eagle_draft")
                 else TorchDraft(rt.draft, a.draft_k, a.draft_v))
    decoder = BoundDecoder(
        rt, sizes["decoder"], bind, backend, sizes.get("prefill", ()), sizes.get("decoder_cache", ())
    )
    batch = None
    if sizes.get("decoder_batch"):
        batch = BoundBatchDecoder(rt, sizes["decoder_batch"], bind, backend)
        for r in range(1, a.limits.batch):      # every region's step bound now: nothing is captured later
            decoder.on_region(a.k_regions[r], a.v_regions[r])
    vision = BoundVision(rt, sizes["vision"], bind, backend) if sizes["vision"] else TorchVision(rt.model, rt.pos_embed)
    return Engines(vision=vision, decoder=decoder,
                   head=BoundHead(rt, sizes["head"], bind, backend), draft=draft, batch=batch)
