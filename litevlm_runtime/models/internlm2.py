"""InternLM2 (the decoder of InternVL2.5-2B): packed `wqkv`, GQA, RMSNorm, RoPE, SwiGLU.

Parameter names as upstream: language_model.model.{tok_embeddings, layers.N.attention.{wqkv,wo},
layers.N.feed_forward.{w1,w2,w3}, layers.N.{attention_norm,ffn_norm}, norm}, language_model.output.
"""

from __future__ import annotations

from torch import nn

from .config import LLMConfig
from .decoder import QKV_GROUPED, CausalLM, DecoderLayer, Embedding, RMSNorm


class InternLM2Attention(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.hidden_size, (hq + 2 * hkv) * d, bias=False)
        self.wo = nn.Linear(hq * d, cfg.hidden_size, bias=False)


class InternLM2FeedForward(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)   # gate
        self.w3 = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)   # up
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)   # down


class InternLM2Layer(DecoderLayer):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.attention = InternLM2Attention(cfg)
        self.feed_forward = InternLM2FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def attn_norm(self):
        return self.attention_norm

    @property
    def out_proj(self):
        return self.attention.wo

    def mlp_gate_up_down(self):
        f = self.feed_forward
        return f.w1, f.w3, f.w2

    def qkv_stacked(self):
        return self.attention.wqkv, QKV_GROUPED

    def qkv(self, x):
        # wqkv rows are grouped per KV head as [q_(g*h) .. q_(g*h+g-1), k_h, v_h], each head_dim rows.
        """x [T, D] (normed) -> q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd]"""
        t = x.shape[0]
        group = self.num_heads // self.num_kv_heads
        packed = self.attention.wqkv(x).view(t, self.num_kv_heads, group + 2, self.head_dim)
        q = packed[:, :, :group].reshape(t, self.num_heads, self.head_dim)
        return q, packed[:, :, group], packed[:, :, group + 1]


class InternLM2Model(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.tok_embeddings = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(InternLM2Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class InternLM2ForCausalLM(CausalLM):
    def __init__(self, cfg: LLMConfig, max_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = InternLM2Model(cfg)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if max_len is not None:          # else whoever runs it sizes the table (init_rope)
            self.init_rope(max_len)

    @property
    def embed(self):
        return self.model.tok_embeddings

    @property
    def layers(self):
        return self.model.layers

    @property
    def norm(self):
        return self.model.norm

    @property
    def head(self):
        return self.output
