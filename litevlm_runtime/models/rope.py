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

from ..errors import CheckpointError
from .config import LLMConfig


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

    `forward(positions)` gives the factors `apply_rope` multiplies by, [T, 1, D] (one row per
    position, broadcast over heads): cos, and sin with rotate-half's sign folded in ([-sin, +sin]
    over the two halves), so that a layer applies RoPE with no cat, neg or unsqueeze of its own
    (a decode step runs it twice per layer: fewer operators, the same numbers to the bit).
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
        half = dim // 2
        self.register_buffer("sin_signed", torch.cat([-self.sin[:, :half], self.sin[:, half:]], -1), persistent=False)

    def _apply(self, fn, recurse=True):
        device = fn(torch.empty(0)).device          # where the module goes; the tables stay float32
        self.cos, self.sin, self.sin_signed = self.cos.to(device), self.sin.to(device), self.sin_signed.to(device)
        return self

    @property
    def max_len(self) -> int:
        return self.cos.shape[0]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, signed sin) [T, 1, D] in `dtype`: apply_rope's factors."""
        return self.cos[positions, None].to(dtype), self.sin_signed[positions, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos, sin [T, 1, D] from RotaryTable (sin signed): x*cos + rotate_half(x)*sin,
    rotate_half(x) = [-x2, x1], written as the halves swapped ([x2, x1]) times the signed sin.
    The swap is a concatenation of the two halves: the same values as a flip of the halves, but the
    CPU's flip is a gather: apply_rope on a 500-row prompt's q took 139-158 us with the flip, 61-75
    us with the concatenation (1 thread, Zen 5); bit-identical."""
    first, second = x.chunk(2, -1)
    return x * cos + torch.cat((second, first), -1) * sin
