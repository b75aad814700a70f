"""PyTorch engines: the model's own modules, eager (on a GPU, see cuda_graph.py for capture).

The decoder runs the one layer forward (models/decoder.py) over the live columns of the arena's
cache and stores the new K/V rows at their slots itself (the graph backends do the same store
after their graph has run: bound_stages.py).
"""

from __future__ import annotations

import torch

from ..weights.lowbit import GEMV_MAX_ROWS, runs_kernels, small_ops_on_one_thread
from .base import BatchDecoderEngine, DecoderEngine, DraftEngine, Engines, HeadEngine, VisionEngine


class TorchVision(VisionEngine):
    backend = "torch"

    def __init__(self, model, pos_embed):
        self.model, self.pos_embed = model, pos_embed

    def run(self, pixels):
        """pixels [n, 3, S, S] -> visual [n, tokens_per_tile, D]. On the CPU one tile a call: the same
        numbers (every operator is per tile), and each intermediate a tile's size. Why: glibc's malloc
        maps a block above its mmap threshold (at most 32 MB) afresh and unmaps it on free, and torch's
        CPU allocator keeps no cache, so six tiles' 100 MB MLP activations were new pages, faulted in and
        zeroed, in every layer; one tile's 17 MB are reused from the heap. InternVL3-2B shapes, int8
        vision GEMMs, 2 threads, Zen 4: six tiles 11.4 s at once, 9.6 s one at a time (alternating, in one
        process; the outputs equal)."""
        if pixels.device.type == "cpu" and pixels.shape[0] > 1:
            return torch.cat([self.model.encode_images(tile[None], self.pos_embed) for tile in pixels])
        return self.model.encode_images(pixels, self.pos_embed)


def prefill_eager(lm, k_cache, v_cache, embeds, positions, mask):
    """embeds [T, D], positions [T], mask [T, T] -> hidden [T, D]; the K/V rows into k_cache, v_cache [layers,
    Hkv, S, hd] at slots 0..T-1. The prompt through the model's own forward, its K/V rows stored at the
    cache's first slots
    (also what torch-compile runs on the CPU: bound_stages.py)."""
    hidden, k, v = lm(embeds, positions, mask)
    k_cache[:, :, :k.shape[2]] = k
    v_cache[:, :, :v.shape[2]] = v
    return hidden


def step_eager(lm, k_cache, v_cache, embeds, positions, slots, mask_cache, mask_new):
    """Rows after the cache's first L columns (mask_cache [T, L]) through the model's own forward,
    their K/V rows stored at `slots` (also torch-compile's prompt after a cached prefix on the CPU).
    Where the slots are the T columns right after those L (a decode step, a tree after its prompt) in a
    float cache on the CPU, each layer writes its rows there itself and reads its cache without a copy
    (LayerCall.rows_in_cache)."""
    live, t = mask_cache.shape[1], embeds.shape[0]
    if follows_live(k_cache, slots, live, t, embeds.dtype):
        hidden, _, _ = lm(embeds, positions, mask_new, k_cache[:, :, :live + t], v_cache[:, :, :live + t], mask_cache,
                          rows_in_cache=True)
        return hidden
    hidden, k, v = lm(embeds, positions, mask_new, k_cache[:, :, :live], v_cache[:, :, :live], mask_cache)
    k_cache.index_copy_(2, slots, k)
    v_cache.index_copy_(2, slots, v)
    return hidden


def follows_live(k_cache, slots, live: int, t: int, dtype: torch.dtype) -> bool:
    """Whether `slots` [T] are live, live + 1, ..., live + T - 1 of a plain cache of the rows' `dtype` on
    the CPU (a quantized cache stores codes; a GPU reads `slots` without a host sync in its graphs)."""
    if (not isinstance(k_cache, torch.Tensor) or k_cache.device.type != "cpu" or k_cache.dtype != dtype
            or live + t > k_cache.shape[2]):
        return False
    if t == 1:
        return int(slots[0]) == live
    return torch.equal(slots, torch.arange(live, live + t, dtype=slots.dtype, device=slots.device))


def few_rows_on_kernels(lm, embeds) -> bool:
    """A call the low-bit kernels run as small calls (decode steps, small trees: lowbit.py), on the CPU."""
    return embeds.shape[0] <= GEMV_MAX_ROWS and embeds.device.type == "cpu" and runs_kernels(lm.layers[0])


class TorchDecoder(DecoderEngine):
    backend = "torch"

    def __init__(self, lm, k_cache, v_cache):
        """k_cache, v_cache [layers, Hkv, S, hd]: the KV region it reads and writes"""
        self.lm, self.k_cache, self.v_cache = lm, k_cache, v_cache

    def prefill(self, embeds, positions, mask):
        """embeds [T, D], positions [T], mask [T, T] -> hidden [T, D]"""
        return prefill_eager(self.lm, self.k_cache, self.v_cache, embeds, positions, mask)

    extends_prompt = True

    def step(self, embeds, positions, slots, mask_cache, mask_new):
        """embeds [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T] -> hidden [T, D]"""
        with small_ops_on_one_thread(few_rows_on_kernels(self.lm, embeds)):
            return step_eager(self.lm, self.k_cache, self.v_cache, embeds, positions, slots, mask_cache, mask_new)

    prefill_after = step          # the rest of a prompt is a step of many rows

    def on_region(self, k_cache, v_cache):
        """k_cache, v_cache [layers, Hkv, S, hd]: the same modules over another KV region"""
        return TorchDecoder(self.lm, k_cache, v_cache)


class TorchBatchDecoder(BatchDecoderEngine):
    """The batched decode step (batching.py) over the arena's KV regions [batch, layers, Hkv, S,
    D]: row b is region b's next token; each row reads the first L columns of its own region
    and its K/V row is stored at its own slot there. Any row count up to the arena's batch."""

    backend = "torch"

    def __init__(self, lm, k_regions, v_regions, region_ids):
        """k_cache, v_cache [layers, Hkv, S, hd]: the KV region it reads and writes"""
        self.lm, self.k_regions, self.v_regions, self.region_ids = lm, k_regions, v_regions, region_ids
        self.sizes = tuple(range(2, k_regions.shape[0] + 1))

    def step(self, embeds, positions, slots, mask_cache, mask_new):
        """embeds [B, D], positions [B], slots [B] (within each region), mask_cache [B, L],
        mask_new [B, B] (identity) -> hidden [B, D]."""
        b, live = embeds.shape[0], mask_cache.shape[1]
        k_view = self.k_regions[:b, :, :, :live].transpose(0, 1)          # [layers, B, Hkv, L, D]
        v_view = self.v_regions[:b, :, :, :live].transpose(0, 1)
        with small_ops_on_one_thread(few_rows_on_kernels(self.lm, embeds)):
            hidden, k, v = self.lm(embeds, positions, mask_new, k_view, v_view, mask_cache)
        store_batched(self.k_regions, self.v_regions, self.region_ids[:b], slots, k, v)
        return hidden


def store_batched(k_regions, v_regions, regions, slots, k, v) -> None:
    """A batched step's new rows k, v [layers, Hkv, B, D] into k_regions, v_regions [batch,
    layers, Hkv, S, D]: row b at slot slots[b] of region regions[b]."""
    k_regions[regions, :, :, slots] = k.permute(2, 0, 1, 3)                  # [B, layers, Hkv, D]
    v_regions[regions, :, :, slots] = v.permute(2, 0, 1, 3)


class TorchHead(HeadEngine):
    backend = "torch"

    def __init__(self, lm):
        """k_cache, v_cache [layers, Hkv, S, hd]: the KV region it reads and writes"""
        self.lm = lm

    def run(self, hidden):
        """hidden [T, D] -> logits [T, V]"""
        return self.lm.head(hidden)


class TorchDraft(DraftEngine):
    backend = "torch"

    def __init__(self, draft, k_cache, v_cache):
        """k_cache, v_cache [1, Hkv, S, hd]: the draft head's own one-layer cache"""
        self.draft, self.k_cache, self.v_cache = draft, k_cache, v_cache

    def step(self, token_embeds, features, positions, slots, mask_cache, mask_new):
        """token_embeds [T, D], features [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T]
        -> features [T, D]"""
        live = mask_cache.shape[1]
        out, k, v = self.draft(token_embeds, features, positions, mask_new, self.k_cache[:, :, :live],
                               self.v_cache[:, :, :live], mask_cache)
        self.k_cache.index_copy_(2, slots, k)
        self.v_cache.index_copy_(2, slots, v)
        return out


def torch_engines(rt) -> Engines:
    a = rt.arena
    return Engines(
        vision=TorchVision(rt.model, rt.pos_embed),
        decoder=TorchDecoder(rt.lm, a.k_cache, a.v_cache),
        head=TorchHead(rt.lm),
        draft=TorchDraft(rt.draft, a.draft_k, a.draft_v) if rt.draft is not None else None,
        batch=TorchBatchDecoder(rt.lm, a.k_regions, a.v_regions, a.slots) if a.limits.batch > 1 else None,
    )
