"""The engine interface. A stage engine has fixed named inputs and outputs and one `run()`; the
pipeline never knows which backend is behind it.

Stages and their tensors (T = rows in this call, L = cache length attended, n = tiles):
  vision   pixels [n, 3, S, S]                                   -> visual [n, tokens_per_tile, D]
  decoder  embeds [T, D], positions [T], slots [T], mask [T, L]   -> hidden [T, D]
           (k_cache, v_cache [layers, kv_heads, max_len, head_dim]: arena tensors the engine
           updates at `slots`; an engine whose graph cannot alias them copies the new rows in)
  head     hidden [T, D]                                          -> logits [T, V]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import torch

# Backend name -> factory(pipeline) -> Engines. Backends other than torch register themselves.
BACKENDS: dict[str, Callable] = {}


class StageEngine(ABC):
    stage: str = ""
    backend: str = ""

    @abstractmethod
    def run(self, **inputs: torch.Tensor) -> torch.Tensor:
        """Run the stage on named inputs; return its single output tensor."""


@dataclass
class Engines:
    vision: StageEngine
    decoder: StageEngine
    head: StageEngine

    @property
    def backend(self) -> str:
        return self.decoder.backend
