"""InternViT-300M (the vision tower of InternVL2.5-1B/2B): a pre-norm ViT with layer scale.

Differences from a textbook ViT that matter for exactness: the position embedding is bicubically
interpolated when the tile size differs from the size it was trained at; every block scales its
residual branches by learned per-channel `ls1`/`ls2`; there is no final norm (InternVL takes the
last block's output as is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import lowbit_kernels
from .config import VisionConfig
from .decoder import in_graph


class VisionEmbeddings(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        c = cfg.hidden_size
        self.grid = cfg.image_size // cfg.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(1, 1, c))
        self.patch_embedding = nn.Conv2d(3, c, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Parameter(torch.zeros(1, 1 + self.grid * self.grid, c))

    def position_embedding_for(self, h: int, w: int) -> torch.Tensor:
        """[1, 1 + h*w, C]: the CLS entry plus the patch grid resized (bicubic) to h x w."""
        cls_pos, patch_pos = self.position_embedding[:, :1], self.position_embedding[:, 1:]
        if (h, w) != (self.grid, self.grid):
            grid = patch_pos.float().reshape(1, self.grid, self.grid, -1).permute(0, 3, 1, 2)
            grid = F.interpolate(grid, size=(h, w), mode="bicubic", align_corners=False)
            patch_pos = grid.reshape(1, -1, h * w).permute(0, 2, 1).to(cls_pos.dtype)
        return torch.cat([cls_pos, patch_pos], dim=1)

    def forward(self, pixels: torch.Tensor, pos_embed: torch.Tensor | None = None) -> torch.Tensor:
        """pixels [B, 3, S, S], pos_embed [1, 1 + h*w, C] -> tokens [B, 1 + h*w, C]"""
        patches = self.patch_embedding(pixels)                 # [B, C, h, w]
        b, _, h, w = patches.shape
        patches = patches.flatten(2).transpose(1, 2)           # [B, h*w, C]
        x = torch.cat([self.class_embedding.expand(b, 1, -1), patches], dim=1)
        return x + (pos_embed if pos_embed is not None else self.position_embedding_for(h, w))


def tile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """q, k, v [B, H, N, D] -> [B, H, N, D]: every token of a tile over every token of it (no mask).
    `bf16` (a vision tower whose GEMMs run in bfloat16 or int8, backend.vision_gemm), eager, float32 on
    a CPU with AVX-512 BF16: the kernels' bfloat16 attention (kernels/lowbit_kernels.cpp: bfloat16 products,
    float32 scores, softmax and sums; 1.8x torch's CPU SDPA at InternViT's 1,025 tokens x 16 heads on Zen
    4, whose float32 path runs MKL's AVX2 GEMM there). Otherwise torch's scaled_dot_product_attention."""
    if (bf16 and q.dtype == torch.float32 and q.device.type == "cpu" and not in_graph()
            and lowbit_kernels.takes_attention(q.shape[-1])
            and not (torch.is_grad_enabled() and q.requires_grad)):
        return lowbit_kernels.attention_bf16(q, k, v)
    return F.scaled_dot_product_attention(q, k, v)


class VisionAttention(nn.Module):
    bf16_attention = False          # tile_attention's bfloat16 kernel (set with the vision GEMMs' form)

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=cfg.qkv_bias)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, C] -> [B, N, C]"""
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.num_heads, c // self.num_heads).permute(2, 0, 3, 1, 4)
        out = tile_attention(q, k, v, self.bf16_attention)     # [B, H, N, D]
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, C] -> [B, N, C]"""
        return self.fc2(F.gelu(self.fc1(x)))


class VisionLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = VisionAttention(cfg)
        self.ls1 = nn.Parameter(torch.ones(cfg.hidden_size))
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = VisionMLP(cfg)
        self.ls2 = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, N, C] -> [B, N, C]"""
        x = x + self.attn(self.norm1(x)) * self.ls1
        return x + self.mlp(self.norm2(x)) * self.ls2


class VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.layers = nn.ModuleList(VisionLayer(cfg) for _ in range(cfg.num_hidden_layers))


class InternViT(nn.Module):
    """pixels [B, 3, S, S] (normalized) -> last hidden state [B, 1 + (S/14)^2, C] (CLS first)."""

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.embeddings = VisionEmbeddings(cfg)
        self.encoder = VisionEncoder(cfg)

    def forward(self, pixels: torch.Tensor, pos_embed: torch.Tensor | None = None) -> torch.Tensor:
        """pixels [B, 3, S, S], pos_embed [1, 1 + h*w, C] -> tokens [B, 1 + h*w, C]"""
        x = self.embeddings(pixels, pos_embed)
        for layer in self.encoder.layers:
            x = layer(x)
        return x
