"""Qwen3 (the decoder of InternVL3.5-1B/2B: Qwen3-0.6B/1.7B): Qwen2's layer with two changes in
attention, both before RoPE: q and k are RMS-normalized per head (`q_norm`, `k_norm`, one weight
vector of head_dim each, shared by all heads), and q/k/v carry no bias. Its head size is the
config's `head_dim` (128 in both), not hidden_size / heads (64 in Qwen3-0.6B).

Parameter names as upstream (transformers' Qwen3ForCausalLM, which InternVL3.5's remote code
imports): language_model.model.{embed_tokens, layers.N.self_attn.{q,k,v,o}_proj,
layers.N.self_attn.{q,k}_norm, layers.N.mlp.{gate,up,down}_proj,
layers.N.{input_layernorm,post_attention_layernorm}, norm}, language_model.lm_head (absent when
tie_word_embeddings, as in both InternVL3.5 sizes: the embedding is reused).
"""

from __future__ import annotations

from torch import nn

from .config import LLMConfig
from .decoder import RMSNorm, project
from .qwen2 import Qwen2ForCausalLM, Qwen2Layer, Qwen2MLP


class Qwen3Attention(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=False)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)


class Qwen3Layer(Qwen2Layer):
    """Qwen2's pre-norm layer (same norms, MLP and output projection) with Qwen3's attention."""

    def __init__(self, cfg: LLMConfig):
        nn.Module.__init__(self)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.self_attn = Qwen3Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def qk_norms(self):
        return self.self_attn.q_norm, self.self_attn.k_norm

    def qkv(self, x):
        # The per-head norms act here, so everything after (RoPE, the selectors' query_key probe,
        # attention, the KV cache) sees what transformers' Qwen3Attention rotates and caches.
        """x [T, D] (normed) -> q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd] (each head's q, k RMS-normed)"""
        t, a = x.shape[0], self.self_attn
        q, k, v = project(x, self.qkv_projections())
        return (a.q_norm(q.view(t, self.num_heads, self.head_dim)),
                a.k_norm(k.view(t, self.num_kv_heads, self.head_dim)),
                v.view(t, self.num_kv_heads, self.head_dim))


class Qwen3ForCausalLM(Qwen2ForCausalLM):
    """Qwen2's stack (embedding, final norm, tied or separate head) of Qwen3 layers."""

    layer_class = Qwen3Layer
