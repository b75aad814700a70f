"""InternVL2.5 / 3 / 3.5 = InternViT + pixel shuffle + mlp1 + (InternLM2 | Qwen2 | Qwen3). Top-level names as upstream:
`vision_model`, `mlp1`, `language_model`."""

from __future__ import annotations

import torch
from torch import nn

from .config import ModelConfig
from .intern_vit import InternViT
from .internlm2 import InternLM2ForCausalLM
from .projector import Projector, vit_to_visual_tokens
from .qwen2 import Qwen2ForCausalLM
from .qwen3 import Qwen3ForCausalLM

DECODERS = {"internlm2": InternLM2ForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}


class InternVL(nn.Module):
    def __init__(self, cfg: ModelConfig, max_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.vision_model = InternViT(cfg.vision)
        self.mlp1 = Projector(cfg.vision.hidden_size, cfg.llm.hidden_size, cfg.downsample_ratio)
        self.language_model = DECODERS[cfg.llm.architecture](cfg.llm, max_len)
        # stages/motion.py's network, from the folder's motion/ where it has one (not an upstream
        # tensor: it is saved and loaded beside the checkpoint, never in it)
        self.motion: nn.Module | None = None

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        """The upstream checkpoint's tensors: the state without the motion network."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("motion.")}

    def encode_images(self, pixels: torch.Tensor, pos_embed: torch.Tensor | None = None) -> torch.Tensor:
        """pixels [B, 3, S, S] -> visual tokens [B, tokens_per_tile, D]."""
        return vit_to_visual_tokens(self.vision_model(pixels, pos_embed), self.mlp1, self.cfg.downsample_ratio)
