"""Pixel shuffle 0.5 and the `mlp1` projector: InternViT patches -> decoder-width visual tokens."""

from __future__ import annotations

import torch
from torch import nn


def pixel_shuffle(x: torch.Tensor, scale: float = 0.5) -> torch.Tensor:
    """[B, W, H, C] -> [B, W*scale, H*scale, C/scale^2], InternVL's `ps_version v2` ordering.

    Written out rather than using nn.PixelUnshuffle because InternVL's channel ordering (two
    view/permute rounds over a (w, h) grid) is what the checkpoint's mlp1 was trained on.
    """
    n, w, h, c = x.shape
    x = x.reshape(n, w, int(h * scale), int(c / scale))
    x = x.permute(0, 2, 1, 3)
    x = x.reshape(n, int(h * scale), int(w * scale), int(c / (scale * scale)))
    return x.permute(0, 2, 1, 3)


class Projector(nn.Sequential):
    """`mlp1`: LayerNorm(4C) -> Linear(4C, D) -> GELU -> Linear(D, D); keys mlp1.0/1/3 as upstream."""

    def __init__(self, vision_width: int, llm_width: int, downsample_ratio: float = 0.5):
        wide = vision_width * int(1 / downsample_ratio) ** 2
        super().__init__(nn.LayerNorm(wide), nn.Linear(wide, llm_width), nn.GELU(), nn.Linear(llm_width, llm_width))


def vit_to_visual_tokens(vit_out: torch.Tensor, projector: Projector, scale: float) -> torch.Tensor:
    """InternViT output [B, 1 + N, C] -> visual tokens [B, N*scale^2, D]: drop CLS, shuffle, project."""
    patches = vit_out[:, 1:]
    b, n, c = patches.shape
    side = int(round(n ** 0.5))
    shuffled = pixel_shuffle(patches.reshape(b, side, side, c), scale)
    return projector(shuffled.reshape(b, -1, shuffled.shape[-1]))
