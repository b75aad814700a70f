"""The prompt prefix every query shares: its KV computed once at start-up, reused by every prefill.

Every prompt begins with the same rows: the chat template's system message and the opening of the
user turn, up to its first camera (`<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`,
38 of a one-camera prompt's 134 rows for the bundled model). A row's K and V depend only on the
rows up to it, so the KV of those rows is the same for every query, whatever its cameras, kept
visual tokens or question (what token selection changes comes after them). It is computed once
into the arena (`prefix_k`, `prefix_v`, and the rows' final-norm features `prefix_hidden`, which
EAGLE-2's draft reads), copied into the query's KV region before its prefill, and the decoder
runs the rest of the prompt only: the prefix-caching of vLLM/SGLang for the one prefix an
in-vehicle runtime always has. Exact up to floating-point reassociation (the prefix's GEMMs run
at another row count): within 1e-5 of a full prefill, greedy answers identical
(tests/pipeline/test_prefix.py).

How many rows are reused is decided per query against the query's own prompt ids (their common
prefix, before its first visual row), never assumed. Engines whose prompt runs as fixed-row graphs
(ONNX Runtime, TensorRT, torch-cudagraph, prefill graphs of torch-compile) do not reuse it: the
rest of the prompt would run as chunks of their step graphs, not their prefill graph
(`DecoderEngine.extends_prompt`). Not with FastV (its per-layer pruning is one prompt's). A
follow-up question reuses its conversation's KV instead (conversation.py), which begins with
the same rows.
"""

from __future__ import annotations

import torch

from ..stages.prompt import build_prompt
from .conversation import common_rows


def prefix_ids(tok, system: str, layout: str, cameras, tokens_per_camera: int) -> tuple[int, ...]:
    """The ids of a one-camera prompt before its first visual token: the rows the prefix holds
    (a query reuses as many of them as its own prompt begins with)."""
    probe = build_prompt(tok, system, layout, list(cameras)[:1], "x", tokens_per_camera)
    return tuple(probe.input_ids[:probe.image_spans[0][0]])


class PromptPrefix:
    def __init__(self, ids: tuple[int, ...], k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor):
        self.ids = list(ids)
        self.k, self.v = k, v              # [layers, kv_heads, P, head_dim] arena buffers
        self.hidden = hidden               # [P, D] the prefix rows' final-norm features

    @classmethod
    def build(cls, rt) -> "PromptPrefix":
        """Run the decoder over the prefix rows once (on region 0, as any prefill) and keep their
        KV and features in the arena's prefix buffers."""
        a = rt.arena
        ids = prefix_ids(rt.tok, rt.cfg.system_message, rt.prompt_layout, rt.options.cameras, rt.tokens_per_camera)
        p = len(ids)
        with torch.inference_mode():
            a.token_ids[:p].copy_(torch.tensor(ids, dtype=torch.long))
            embeds = a.embeds[:p]
            rt.lm.embed.lookup(a.token_ids[:p], embeds)
            a.positions[:p].copy_(a.slots[:p])
            hidden = rt.engines.decoder.prefill(embeds, a.positions[:p], a.causal_mask(p))
            a.prefix_k.copy_(a.k_cache[:, :, :p])
            a.prefix_v.copy_(a.v_cache[:, :, :p])
            a.prefix_hidden.copy_(hidden)
        return cls(ids, a.prefix_k, a.prefix_v, a.prefix_hidden)

    def restore(self, token_ids: torch.Tensor, first_visual: int, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
        """Copy into a KV region (k_cache [layers, kv_heads, max_len, head_dim]) the prefix rows a
        prompt begins with: `token_ids` [n] its prefill rows, `first_visual` its first visual row
        (rows before it sit at their own positions). Returns how many (at most n - 1: prefill runs
        at least one row, for the first answer token's logits)."""
        bound = min(len(self.ids), first_visual, token_ids.shape[0] - 1)
        n = common_rows(self.ids[:bound], token_ids[:bound].tolist())
        k_cache[:, :, :n] = self.k[:, :, :n]
        v_cache[:, :, :n] = self.v[:, :, :n]
        return n
