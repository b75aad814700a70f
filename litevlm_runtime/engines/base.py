"""The engine interface. A stage engine has fixed named inputs and outputs; the pipeline never
knows which backend is behind it. Shapes (T = rows in this call, L = cache columns a step may see,
n = tiles, S = the arena's max_len):

  vision   run(pixels [n, 3, s, s])                                      -> visual [n, tokens_per_tile, D]
  decoder  prefill(embeds [T, D], positions [T], mask [T, T])            -> hidden [T, D]
             the prompt: no earlier cache; its K/V rows are stored at slots 0..T-1
           step(embeds [T, D], positions [T], slots [T],
                mask_cache [T, L], mask_new [T, T])                      -> hidden [T, D]
             decode steps and tree verification over the arena's KV cache: columns < L of the
             old cache under mask_cache, this call's rows under mask_new; the rows are stored at
             `slots` (>= L: a step never sees the columns it writes)
           on_region(k_cache, v_cache [layers, Hkv, S, D])                -> DecoderEngine
             the same engine over another KV region of the arena (k_regions[r]: batching.py
             runs each query of a batch in its own region); it shares the graphs/modules
  batch    step(embeds [B, D], positions [B], slots [B],
                mask_cache [B, L], mask_new [B, B])                      -> hidden [B, D]
             one batched decode step over the arena's KV regions k_regions, v_regions
             [batch, layers, Hkv, S, D]: row b is region b's next token; it sees the first L
             columns of region b under mask_cache[b] and its own new row (mask_new is the
             identity: rows never see each other); its K/V row is stored at slots[b] of region
             b. A row of a free region (mask_cache row all False) sees only itself
  head     run(hidden [T, D])                                            -> logits [T, V]
  draft    step(token_embeds [T, D], features [T, D], positions [T], slots [T],
                mask_cache [T, L], mask_new [T, T])                      -> features [T, D]
             the EAGLE-2 head over its own one-layer cache (the arena's draft_k/draft_v)

Outputs are views of engine buffers (bound backends) or fresh tensors (eager torch): valid until
the same engine runs again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from ..errors import LiteVLMError


class StageEngine(ABC):
    stage: str = ""
    backend: str = ""


class VisionEngine(StageEngine):
    stage = "vision"

    @abstractmethod
    def run(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [n, 3, S, S] -> visual [n, tokens_per_tile, D]"""


class DecoderEngine(StageEngine):
    stage = "decoder"

    @abstractmethod
    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """embeds [T, D], positions [T], mask [T, T] -> hidden [T, D]; K/V rows stored at slots 0..T-1"""

    @abstractmethod
    def step(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             mask_cache: torch.Tensor, mask_new: torch.Tensor) -> torch.Tensor:
        """embeds [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T] -> hidden [T, D]"""

    def on_region(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> "DecoderEngine":
        """k_cache, v_cache [layers, Hkv, S, hd]: another KV region of the arena"""
        raise LiteVLMError(f"{type(self).__name__} ({self.backend}) runs over one KV region only: no batching")

    # Whether `prefill_after` runs the rest of a prompt after a cached prefix (pipeline/prefix.py) in
    # one call of the model's own forward; an engine whose prompt runs as fixed-row graphs would run
    # it as chunks of its step graphs instead, slower than its prefill graph: it prefills whole.
    extends_prompt: bool = False

    def prefill_after(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                      mask_cache: torch.Tensor, mask_new: torch.Tensor) -> torch.Tensor:
        """Prompt rows embeds [T, D] at `slots` after the cache columns mask_cache [T, L] sees (the
        shared prefix), causal among themselves (mask_new [T, T]) -> hidden [T, D]."""
        raise LiteVLMError(f"{type(self).__name__} ({self.backend}) prefills whole prompts only")


class BatchDecoderEngine(StageEngine):
    """The batched decode step (shapes above); `sizes`: the batch buckets it runs (rows are
    padded up to one; eager torch: every row count up to the arena's batch)."""

    stage = "decoder_batch"
    sizes: tuple[int, ...] = ()

    @abstractmethod
    def step(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             mask_cache: torch.Tensor, mask_new: torch.Tensor) -> torch.Tensor:
        """embeds [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T] -> hidden [T, D]"""


class HeadEngine(StageEngine):
    stage = "head"

    @abstractmethod
    def run(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V]"""


class DraftEngine(StageEngine):
    stage = "draft"

    @abstractmethod
    def step(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, mask_cache: torch.Tensor, mask_new: torch.Tensor) -> torch.Tensor:
        """token_embeds [T, D], features [T, D], positions [T], slots [T], mask_cache [T, L], mask_new [T, T]
        -> features [T, D]"""


@dataclass(frozen=True)
class KVRegion:
    """One KV region of the arena and the decoder engine bound to it: region 0 is the cache every
    single-query stage uses; a batch gives each of its queries one (pipeline/batching.py). Built
    once per set of engines (Runtime.region)."""
    index: int
    k: torch.Tensor               # [layers, Hkv, S, D]
    v: torch.Tensor               # [layers, Hkv, S, D]
    decoder: DecoderEngine


@dataclass
class Engines:
    vision: VisionEngine
    decoder: DecoderEngine
    head: HeadEngine
    draft: DraftEngine | None = None
    batch: BatchDecoderEngine | None = None     # None: one query at a time (arena batch 1)

    @property
    def backend(self) -> str:
        return self.decoder.backend
