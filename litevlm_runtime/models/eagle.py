"""EAGLE-2 draft head: fc(concat(token_embedding, feature)) -> one decoder layer -> the target's LM head.

The layer is the target family's own decoder layer with its first input norm skipped (the fc
output is not normalized, as in EAGLE), run by the same layer forward as the decoder (export form:
its one-layer cache in, the new K/V rows out). Features are the target's last hidden states after
the final norm; the pair (embedding of x_(t+1), feature f_t) predicts f_(t+1). The embedding
table, the LM head and the RoPE table are the target's and are not stored with the draft.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from ..weights.checkpoint import check_state_dict, read_safetensors
from .config import LLMConfig
from ..errors import CheckpointError
from ..weights.integrity import verify_model_folder
from .decoder import RotaryTable
from .internlm2 import InternLM2Layer
from .qwen2 import Qwen2Layer

LAYERS = {"internlm2": InternLM2Layer, "qwen2": Qwen2Layer}


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


def save_draft_head(draft: DraftHead, folder: Path, record: dict) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in draft.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"architecture": "eagle2_draft_head",
                                                    "llm_architecture": draft.cfg.architecture, **record}, indent=2) + "\n")


def load_draft_head(folder: Path, cfg: LLMConfig, rope: RotaryTable, dtype: torch.dtype) -> DraftHead:
    folder = Path(folder)
    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{weights}: EAGLE-2 draft head weights missing")
    verify_model_folder(folder)
    draft = DraftHead(cfg)
    state = read_safetensors(weights)
    check_state_dict(weights, state, draft.state_dict())
    draft.load_state_dict(state)
    draft.rope = rope
    return draft.to(dtype).eval()
