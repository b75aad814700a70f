"""Rotary position embedding: the cos/sin table (with the config's rope_scaling) and its application.

Tables are computed in float32 exactly as the upstream models compute theirs, so positions far
into the sequence round the same way the checkpoint was trained with.

rope_scaling, as upstream implements it:
- linear: angles of position p are those of p / factor at every length. InternLM2's modeling
  divides the positions (t / factor); transformers' Qwen2 divides inv_freq instead. Both orders are
  kept so that each family's table matches its own upstream to the bit (they differ by rounding
  for factors that are not powers of two).
- dynamic (NTK): upstream leaves the table unscaled up to max_position_embeddings; past it, it
  recomputes the base from the running sequence length L, base * (factor * L / max_pos -
  (factor - 1)) ** (d / (d - 2)), and re-rotates every later query and key with it (keys already
  cached keep their old rotation). That depends on the history of lengths, which a static table
  indexed by position cannot reproduce, so a table longer than max_position_embeddings under
  dynamic scaling is refused; up to that length it is exactly the unscaled table, as upstream's.
"""

from __future__ import annotations

import torch
from torch import nn

from .config import LLMConfig
from ..errors import CheckpointError


def check_rope_length(cfg: LLMConfig, max_len: int) -> None:
    s = cfg.rope_scaling
    if s is not None and s.type == "dynamic" and max_len > cfg.max_position_embeddings:
        raise CheckpointError(
            f"llm_config.rope_scaling {s.to_dict()}: a RoPE table of {max_len} positions exceeds "
            f"llm_config.max_position_embeddings {cfg.max_position_embeddings}; upstream's dynamic NTK scaling "
            f"rescales past that length by the running sequence length, which the static KV cache cannot reproduce. "
            f"Keep the arena (prompt + new tokens + draft tree) within {cfg.max_position_embeddings} positions")


class RotaryTable(nn.Module):
    """cos/sin tables for every position up to max_len, computed once (rotate-half convention).

    Kept in float32 whatever dtype the model is moved to (`.to(dtype)` moves the tables to the
    device only). One table serves the decoder, the token selector and the EAGLE-2 head of a
    pipeline: it is built once, at the arena's max_len, and shared.
    """

    def __init__(self, cfg: LLMConfig, max_len: int):
        super().__init__()
        check_rope_length(cfg, max_len)
        dim = cfg.head_dim
        inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        t = torch.arange(max_len, dtype=torch.int64).float()
        s = cfg.rope_scaling
        if s is not None and s.type == "linear":
            if cfg.architecture == "internlm2":
                t = t / s.factor
            else:
                inv_freq = inv_freq / s.factor
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def _apply(self, fn, recurse=True):
        device = fn(torch.empty(0)).device          # where the module goes; the tables stay float32
        self.cos, self.sin = self.cos.to(device), self.sin.to(device)
        return self

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]
