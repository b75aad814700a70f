"""FastV baseline for the ablation (Chen et al. 2024, "An Image is Worth 1/2 Tokens After Layer 2"):
inside the decoder, rank the visual tokens by the attention the last prompt token pays them
(averaged over heads) and drop the lowest-ranked fraction R of them from layers >= K.

The ranking uses layer K-1, the last layer that still sees every token (FastV's reference code
takes the attention map of the layer before the pruning layer). With K = 2 and R = 0.7 this is
the paper's "FastV r=0.3" row (keeps 30% of the visual tokens: 3214 -> 1063 input tokens).

Static cache, no re-layout: layers < K run over every prompt row and fill every slot; layers >= K
run only on the kept rows (same slots, same original position ids) under a mask that hides the
dropped slots, so their cache rows at dropped slots are never written and never read. Every later
decoder pass (greedy steps, tree verification) runs under the same per-layer masks: the caller's
mask in layers < K, that mask with the dropped slots cleared in layers >= K. The token selector
(prompt rows removed before the decoder) and FastV (rows removed inside it) compose.

FastV needs per-layer masks and a row drop inside the stack, so it drives the PyTorch decoder
directly (`CausalLM.forward(first_layer=, layer_masks=)`), not an exported engine.
"""

from __future__ import annotations

import math

import torch

from .errors import InputError
from .token_selector import kept_count


def last_token_attention(q_last: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """q_last [1, Hq, D] (the last prompt row), k [T, Hkv, D] (every row, post-RoPE) ->
    attention probabilities [T] of the last row, averaged over heads (float32)."""
    group = q_last.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    logits = torch.einsum("hd,khd->hk", q_last[0].float(), k.float()) / math.sqrt(q_last.shape[-1])
    return torch.softmax(logits, dim=-1).mean(0)        # the last row sees every row: no mask needed


class FastV:
    def __init__(self, lm, arena, k: int = 2, drop_ratio: float = 0.5):
        layers = len(lm.layers)
        if not 1 <= k < layers:
            raise InputError(f"FastV layer K must lie in [1, {layers - 1}] for a {layers}-layer decoder, got {k}")
        if not 0.0 <= drop_ratio < 1.0:
            raise InputError(f"FastV drop ratio must lie in [0, 1), got {drop_ratio}")
        self.lm, self.arena, self.k, self.drop_ratio = lm, arena, k, drop_ratio
        self.visible = arena.slot_visible          # [max_len] bool: False at dropped visual slots
        self.masks = arena.layer_mask              # scratch for the masks of layers >= K

    def prefill(self, embeds, positions, slots, mask, visual_rows: torch.Tensor):
        """Prefill with pruning. visual_rows: rows of `embeds` holding visual tokens.

        Returns (final hidden states of the kept rows, kept row indices, kept visual token count).
        """
        a, lm = self.arena, self.lm
        self.visible.fill_(True)
        captured = {}

        def probe(layer, q, k):
            if layer == self.k - 1:
                captured["q"], captured["k"] = q[-1:], k

        h = lm(embeds, positions, slots, mask, a.k_cache, a.v_cache, num_layers=self.k, probe=probe)
        n_visual = int(visual_rows.numel())
        n_keep = kept_count(n_visual, 1.0 - self.drop_ratio) if self.drop_ratio > 0 else n_visual
        if n_keep < n_visual:
            score = last_token_attention(captured["q"], captured["k"])[visual_rows]
            self.visible[slots[visual_rows]] = False
            self.visible[slots[visual_rows[score.topk(n_keep).indices]]] = True
        rows = self.visible[slots].nonzero().squeeze(1)
        kv_len = mask.shape[-1]
        pruned = mask[rows] & self.visible[:kv_len]
        hidden = lm(h[rows], positions[rows], slots[rows], pruned, a.k_cache, a.v_cache,
                    first_layer=self.k, layer_masks=self.layer_masks(pruned, prepared=True))
        return hidden, rows, n_keep

    def layer_masks(self, mask: torch.Tensor, prepared: bool = False) -> list:
        """Per-layer masks for a pass under `mask`: as is below K, dropped slots hidden from K on."""
        if not prepared:
            t, kv_len = mask.shape
            mask = torch.logical_and(mask, self.visible[:kv_len], out=self.masks[:t, :kv_len])
        return [None] * self.k + [mask] * (len(self.lm.layers) - self.k)

    def run(self, embeds, positions, slots, mask):
        """A decoder pass after prefill (a greedy step or a draft-tree verification)."""
        a = self.arena
        return self.lm(embeds, positions, slots, mask, a.k_cache, a.v_cache, layer_masks=self.layer_masks(mask))
