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


class StageEngine(ABC):
    stage: str = ""
    backend: str = ""


class VisionEngine(StageEngine):
    stage = "vision"

    @abstractmethod
    def run(self, pixels: torch.Tensor) -> torch.Tensor: ...


class DecoderEngine(StageEngine):
    stage = "decoder"

    @abstractmethod
    def prefill(self, embeds: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def step(self, embeds: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
             mask_cache: torch.Tensor, mask_new: torch.Tensor) -> torch.Tensor: ...


class HeadEngine(StageEngine):
    stage = "head"

    @abstractmethod
    def run(self, hidden: torch.Tensor) -> torch.Tensor: ...


class DraftEngine(StageEngine):
    stage = "draft"

    @abstractmethod
    def step(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
             slots: torch.Tensor, mask_cache: torch.Tensor, mask_new: torch.Tensor) -> torch.Tensor: ...


@dataclass
class Engines:
    vision: VisionEngine
    decoder: DecoderEngine
    head: HeadEngine
    draft: DraftEngine | None = None

    @property
    def backend(self) -> str:
        return self.decoder.backend
