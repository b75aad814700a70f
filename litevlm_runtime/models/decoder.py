"""The decoder machinery InternLM2 and Qwen2 share: RMSNorm, RoPE, attention over a static KV
cache, SwiGLU, and the layer/stack forward. The two families differ only in how q/k/v are
projected and what the parameters are called (see internlm2.py, qwen2.py).

The KV cache is two plain tensors, k and v, each [layers, kv_heads, max_len, head_dim], owned by
the caller (the memory arena). A forward pass writes its keys/values at explicit `slots` and
attends under an explicit boolean `mask` [T, kv_len] (True = may attend). Slots, RoPE positions
and mask are independent on purpose: token selection keeps original position ids in compacted
slots, and EAGLE-2 tree verification writes a tree into scratch slots under an ancestor mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LLMConfig
from .rope import RotaryTable, apply_rope  # the rest of the code imports them from here


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def attend_with_cache(q, k, v, slots, mask, k_cache, v_cache):
    """Write k/v [T, Hkv, D] at `slots` of this layer's cache [Hkv, S, D]; attend q [T, Hq, D].

    Returns [T, Hq*D]. The cache is updated in place (index_copy_), so the same tensors serve
    every step; kv_len is the mask's width.
    """
    kv_len = mask.shape[-1]
    # Stored in the cache's dtype: under autocast (bf16 training on a GPU) the projections come out
    # in bf16 and RoPE's float tables promote k back, while the cache keeps one dtype (no-op otherwise).
    k_cache.index_copy_(1, slots, k.transpose(0, 1).to(k_cache.dtype))
    v_cache.index_copy_(1, slots, v.transpose(0, 1).to(v_cache.dtype))
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),                 # [1, Hq, T, D]
        k_cache[None, :, :kv_len],
        v_cache[None, :, :kv_len],
        attn_mask=mask,
        enable_gqa=True,
    )
    t = q.shape[0]
    return out[0].transpose(0, 1).reshape(t, -1)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU block. Subclasses define `qkv(x)`, `out_proj`, `mlp_gate_up_down`
    and the two norms under their upstream names, exposed through `attn_norm`/`ffn_norm`."""

    num_heads: int
    num_kv_heads: int
    head_dim: int

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def forward(self, x, cos, sin, slots, mask, k_cache, v_cache, probe=None):
        q, k, v = self.qkv(self.attn_norm(x))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if probe is not None:
            probe(q, k)                                     # token selection / FastV read q, k here
        x = x + self.out_proj(attend_with_cache(q, k, v, slots, mask, k_cache, v_cache))
        h = self.ffn_norm(x)
        gate, up, down = self.mlp_gate_up_down()
        return x + down(F.silu(gate(h)) * up(h))


class CausalLM(nn.Module):
    """Shared stack forward. Subclasses build `embed`, `layers`, `norm`, `head` (upstream names)."""

    cfg: LLMConfig

    def init_rope(self, max_len: int) -> None:
        self.rope = RotaryTable(self.cfg, max_len)

    def forward(self, embeds, positions, slots, mask, k_cache, v_cache, *, num_layers=None, probe=None,
                first_layer=0, layer_masks=None):
        """embeds [T, D] -> final-norm hidden states [T, D] (the EAGLE-2 feature).

        `num_layers` runs only the first layers and returns their raw (un-normed) output: the token
        selector is this with num_layers=1. `probe(layer_index, q, k)` sees post-RoPE q/k.
        `first_layer` starts the stack there (`embeds` are then that layer's input hidden states),
        and `layer_masks[i]`, where given and not None, replaces `mask` in layer i: FastV runs
        layers >= K on the kept rows only, under masks that hide the dropped visual slots.
        """
        cos, sin = self.rope(positions, embeds.dtype)
        x = embeds
        end = len(self.layers) if num_layers is None else num_layers
        for i in range(first_layer, end):
            layer_probe = None if probe is None else (lambda q, k, i=i: probe(i, q, k))
            layer_mask = mask if layer_masks is None or layer_masks[i] is None else layer_masks[i]
            x = self.layers[i](x, cos, sin, slots, layer_mask, k_cache[i], v_cache[i], layer_probe)
        return x if num_layers is not None else self.norm(x)
