"""Qwen2 / Qwen2.5 (the decoder of InternVL2.5-1B): separate q/k/v projections with bias, GQA.

Parameter names as upstream: language_model.model.{embed_tokens, layers.N.self_attn.{q,k,v,o}_proj,
layers.N.mlp.{gate,up,down}_proj, layers.N.{input_layernorm,post_attention_layernorm}, norm},
language_model.lm_head (absent when tie_word_embeddings: the embedding is reused).
"""

from __future__ import annotations

from torch import nn

from .config import LLMConfig
from .decoder import QKV_SIDE_BY_SIDE, CausalLM, DecoderLayer, Embedding, RMSNorm, project, stacked


class Qwen2Attention(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=True)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=True)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=True)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=False)


class Qwen2MLP(nn.Module):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)


class Qwen2Layer(DecoderLayer):
    def __init__(self, cfg: LLMConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.self_attn = Qwen2Attention(cfg)
        self.mlp = Qwen2MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def attn_norm(self):
        return self.input_layernorm

    @property
    def ffn_norm(self):
        return self.post_attention_layernorm

    @property
    def out_proj(self):
        return self.self_attn.o_proj

    def mlp_gate_up_down(self):
        return self.mlp.gate_proj, self.mlp.up_proj, self.mlp.down_proj

    def qkv(self, x):
        """x [T, D] (normed) -> q [T, Hq, hd], k [T, Hkv, hd], v [T, Hkv, hd]"""
        t = x.shape[0]
        q, k, v = project(x, self.qkv_projections())
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.view(t, self.num_kv_heads, self.head_dim))

    def qkv_projections(self) -> tuple[nn.Module, nn.Module, nn.Module]:
        a = self.self_attn
        return a.q_proj, a.k_proj, a.v_proj

    def same_input(self):
        return [*super().same_input(), self.qkv_projections()]

    def qkv_stacked(self):
        return stacked(self.qkv_projections()), QKV_SIDE_BY_SIDE


class Qwen2Model(nn.Module):
    def __init__(self, cfg: LLMConfig, layer_class: type[DecoderLayer]):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_class(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen2ForCausalLM(CausalLM):
    layer_class: type[DecoderLayer] = Qwen2Layer      # Qwen3 (qwen3.py) swaps in its own layer

    def __init__(self, cfg: LLMConfig, max_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = Qwen2Model(cfg, self.layer_class)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if max_len is not None:          # else whoever runs it sizes the table (init_rope)
            self.init_rope(max_len)

    @property
    def embed(self):
        return self.model.embed_tokens

    @property
    def layers(self):
        return self.model.layers

    @property
    def norm(self):
        return self.model.norm

    def head(self, hidden):
        """hidden [T, D] -> logits [T, V]"""
        if self.cfg.tie_word_embeddings:
            return self.model.embed_tokens.logits(hidden)
        return self.lm_head(hidden)
