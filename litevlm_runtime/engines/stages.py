"""The stage modules: each stage of the pipeline as a plain nn.Module with fixed named inputs and
outputs, the form every bound backend runs (ONNX export, TensorRT, CUDA graphs, calibration).

  vision      pixels [n, 3, s, s]                                  -> visual [n, tokens_per_tile, D]
  prefill     embeds [T, D], positions [T], mask_new [T, T]        -> hidden [T, D],
                                                                      k_new, v_new [layers, kv, T, hd]
  decoder     embeds [T, D], positions [T], mask_cache [T, S],
              mask_new [T, T], k_cache, v_cache [layers, kv, S, hd] -> hidden [T, D],
              (+ k_cache_scale, v_cache_scale [layers, kv, S]        k_new, v_new [layers, kv, T, hd]
              with arena.kv_dtype int8 / fp8: the codes' scales)
  decoder_batch embeds [B, D], positions [B], mask_cache [B, S],
              mask_new [B, B], k_regions, v_regions [B, layers, kv, S, hd] -> hidden [B, D],
                                                                      k_new, v_new [layers, kv, B, hd]
              one batched decode step: row b over region b only (B is the graph's dynamic
              batch dimension in the export; each backend runs it at fixed batch buckets)
  head        hidden [T, D]                                        -> logits [T, V]
  eagle_draft token_embeds, features [T, D], positions, the two masks,
              k_cache, v_cache [1, kv, S, hd]                      -> features_out [T, D], k_new, v_new

The decoder stages are the decoder's one forward (models/decoder.py): the cache is an explicit
input and the new K/V rows are explicit outputs (the engine stores them at their slots), so the
graph has no in-place update and no aliasing, which ONNX Runtime, TensorRT and CUDA graphs need.
"""

from __future__ import annotations

import torch
from torch import nn

from ..models.kv_cache import wrap


class VisionStage(nn.Module):
    """pixels -> visual tokens (InternViT + pixel shuffle + mlp1), position table baked in."""

    def __init__(self, model, pos_embed: torch.Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("pos_embed", pos_embed.detach().clone(), persistent=False)

    def forward(self, pixels):
        """pixels [n, 3, S, S] -> visual [n, tokens_per_tile, D]"""
        return self.model.encode_images(pixels, self.pos_embed)


class DecoderStage(nn.Module):
    """The decoder over the static cache: cache in, new rows out (the decoder's own forward). A
    quantized cache (arena.kv_dtype) comes in as codes (k_cache, v_cache) and scales (k_cache_scale,
    v_cache_scale [layers, kv, S]) and is read dequantized (models/kv_cache.py)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(
        self, embeds, positions, mask_cache, mask_new, k_cache, v_cache, k_cache_scale=None, v_cache_scale=None
    ):
        """embeds [T, D], positions [T], mask_cache [T, S], mask_new [T, T], k_cache, v_cache [layers, Hkv, S, hd]
        (8-bit codes with k/v_cache_scale [layers, Hkv, S] under arena.kv_dtype int8|fp8)
        -> (hidden [T, D], k, v [layers, Hkv, T, hd])"""
        return self.lm(embeds, positions, mask_new, wrap(k_cache, k_cache_scale), wrap(v_cache, v_cache_scale),
                       mask_cache)


class BatchDecoderStage(nn.Module):
    """The batched decode step over the arena's KV regions (the decoder's own forward: each
    layer reads its [B, Hkv, S, D] slice of the regions, models/decoder.py attend_batched)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, embeds, positions, mask_cache, mask_new, k_regions, v_regions, k_regions_scale=None,
                v_regions_scale=None):
        # unbind(1): layer i's [B, Hkv, S, D], one split of the regions (a transpose to
        # [layers, B, ...] would copy the whole cache in the exported graph first)
        """embeds [B, D], positions [B], mask_cache [B, S], mask_new [B, B], k_regions, v_regions [B, layers,
        Hkv, S, hd] -> (hidden [B, D], k, v [layers, B, Hkv, hd])"""
        k, v = wrap(k_regions, k_regions_scale), wrap(v_regions, v_regions_scale)
        return self.lm(embeds, positions, mask_new, k.unbind(1), v.unbind(1), mask_cache)


class PrefillStage(nn.Module):
    """The decoder over a prompt that starts an empty cache: no cache input, the prompt's K/V
    rows as outputs (attention over T x T rather than T x (max_len + T))."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, embeds, positions, mask_new):
        """embeds [T, D], positions [T], mask_new [T, T] -> (hidden [T, D], k, v [layers, Hkv, T, hd])"""
        return self.lm(embeds, positions, mask_new)


class DraftStage(nn.Module):
    """One EAGLE-2 draft step (models/eagle.py DraftHead): its own one-layer KV cache
    [1, Hkv, S, D] as input, the new rows as outputs. Its logits come from the head graph."""

    def __init__(self, draft):
        super().__init__()
        self.draft = draft

    def forward(self, token_embeds, features, positions, mask_cache, mask_new, k_cache, v_cache):
        """embeds [T, D], positions [T], mask_cache [T, S], mask_new [T, T], k_cache, v_cache [layers, Hkv, S,
        hd] -> (hidden [T, D], k, v [layers, Hkv, T, hd])"""
        return self.draft(token_embeds, features, positions, mask_new, k_cache, v_cache, mask_cache)


class HeadStage(nn.Module):
    def __init__(self, lm):
        super().__init__()
        self.head = lm.head

    def forward(self, hidden):
        """hidden [T, D] -> logits [T, V]"""
        return self.head(hidden)
