"""EAGLE-2 draft head: fc(concat(token_embedding, feature)) -> one decoder layer -> the target's LM head.

The layer is the target family's own decoder layer with its first input norm skipped (the fc
output is not normalized, as in EAGLE), run by the same layer forward as the decoder (export form:
its one-layer cache in, the new K/V rows out). Features are the target's last hidden states after
the final norm; the pair (embedding of x_(t+1), feature f_t) predicts f_(t+1). The embedding
table, the LM head and the RoPE table are the target's and are not stored with the draft
(weights/draft_head.py reads and writes its folder).
"""

from __future__ import annotations

import torch
from torch import nn

from .config import LLMConfig
from .decoder import RotaryTable
from .internlm2 import InternLM2Layer
from .qwen2 import Qwen2Layer
from .qwen3 import Qwen3Layer

LAYERS = {"internlm2": InternLM2Layer, "qwen2": Qwen2Layer, "qwen3": Qwen3Layer}


class DraftHead(nn.Module):
    def __init__(self, cfg: LLMConfig, rope: RotaryTable | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = LAYERS[cfg.architecture](cfg)
        # EAGLE skips the first input norm: replace it by identity (it keeps no weights then).
        if cfg.architecture == "internlm2":
            self.layer.attention_norm = nn.Identity()
        else:
            self.layer.input_layernorm = nn.Identity()
        self.rope = rope                   # the target decoder's table (shared, sized once)

    def forward(self, token_embeds, features, positions, mask_new, k_cache=None, v_cache=None, mask_cache=None):
        """token_embeds, features [T, D] -> (predicted next features [T, D], new k, v rows
        [1, Hkv, T, hd]); k/v_cache: the draft's own one-layer cache [1, Hkv, L, hd]."""
        x = self.fc(torch.cat([token_embeds, features], dim=-1))
        cos, sin = self.rope(positions, x.dtype)
        x, k, v = self.layer(x, cos, sin, mask_new, None if k_cache is None else k_cache[0],
                             None if v_cache is None else v_cache[0], mask_cache)
        return x, k[None], v[None]
