"""FastV baseline for the ablation (Chen et al. 2024, "An Image is Worth 1/2 Tokens After Layer 2"):
inside the decoder, rank the visual tokens by the attention the last prompt token pays them
(averaged over heads) and drop the lowest-ranked fraction R of them from layers >= K.

The ranking uses layer K-1, the last layer that still sees every token (FastV's reference code
takes the attention map of the layer before the pruning layer). With K = 2 and R = 0.7 this is
the paper's "FastV r=0.3" row (keeps 30% of the visual tokens: 3214 -> 1063 input tokens).

Static cache, no re-layout: layers < K run over every prompt row and fill every slot; layers >= K
run only on the kept rows (same slots, same original position ids) under masks that hide the
dropped slots, so their cache rows at dropped slots are never written and never read. Every later
decoder pass (greedy steps, tree verification) runs under per-layer masks: the caller's mask in
layers < K, that mask with the dropped slots cleared in layers >= K. The token selector (prompt
rows removed before the decoder) and FastV (rows removed inside it) compose.

FastV needs per-layer masks and a row drop inside the stack, so it is a decoder engine of its
own over the PyTorch modules (the same layer forward), not an exported graph.
"""

from __future__ import annotations

import torch

from ..engines.base import DecoderEngine
from ..errors import InputError
from ..models.decoder import attention_probs
from .token_selector import kept_count


class FastV(DecoderEngine):
    backend = "torch"

    def __init__(self, lm, arena, k: int = 2, drop_ratio: float = 0.5):
        layers = len(lm.layers)
        if not 1 <= k < layers:
            raise InputError(f"fastv.k must lie in [1, {layers - 1}] for a {layers}-layer decoder, got {k}")
        if not 0.0 <= drop_ratio < 1.0:
            raise InputError(f"fastv.ratio must lie in [0, 1), got {drop_ratio}")
        self.lm, self.arena, self.k, self.drop_ratio = lm, arena, k, drop_ratio
        self.visible = arena.slot_visible          # [max_len] bool: False at dropped visual slots
        self.masks = arena.layer_mask              # scratch for the masks of layers >= K

    def store(self, layers: range, k, v, slots) -> None:
        a = self.arena
        a.k_cache[layers.start:layers.stop].index_copy_(2, slots, k)
        a.v_cache[layers.start:layers.stop].index_copy_(2, slots, v)

    def prune(self, embeds, positions, mask, visual_rows: torch.Tensor):
        """Prefill with pruning. visual_rows: rows of `embeds` holding visual tokens.

        Returns (final hidden states of the kept rows, kept row indices, kept visual token count)."""
        a, lm = self.arena, self.lm
        t = embeds.shape[0]
        slots = a.slots[:t]
        self.visible.fill_(True)
        captured = {}

        def probe(layer, q, k):
            if layer == self.k - 1:
                captured["q"], captured["k"] = q[-1:], k

        early = range(0, self.k)
        h, k, v = lm.run_layers(embeds, positions, mask, layers=early, probe=probe)
        self.store(early, k, v, slots)
        n_visual = int(visual_rows.numel())
        n_keep = kept_count(n_visual, 1.0 - self.drop_ratio) if self.drop_ratio > 0 else n_visual
        if n_keep < n_visual:
            everything = torch.ones(1, t, dtype=torch.bool, device=embeds.device)
            score = attention_probs(captured["q"], captured["k"], everything).mean(0)[0][visual_rows]
            self.visible[slots[visual_rows]] = False
            self.visible[slots[visual_rows[score.topk(n_keep).indices]]] = True
        rows = self.visible[:t].nonzero().squeeze(1)
        late = range(self.k, len(lm.layers))
        x, k, v = lm.run_layers(h[rows], positions[rows], mask[rows][:, rows], layers=late)
        self.store(late, k, v, slots[rows])
        return lm.norm(x), rows, n_keep

    def prefill(self, embeds, positions, mask):
        raise InputError("FastV prefill needs the visual rows: call FastV.prune")

    def step(self, embeds, positions, slots, mask_cache, mask_new):
        """A decoder pass after prefill (a greedy step or a draft-tree verification)."""
        a = self.arena
        t, live = mask_cache.shape
        pruned = torch.logical_and(mask_cache, self.visible[:live], out=self.masks[:t, :live])
        per_layer = [mask_cache] * self.k + [pruned] * (len(self.lm.layers) - self.k)
        hidden, k, v = self.lm(embeds, positions, mask_new, a.k_cache[:, :, :live], a.v_cache[:, :, :live], per_layer)
        a.k_cache.index_copy_(2, slots, k)
        a.v_cache.index_copy_(2, slots, v)
        return hidden
