"""Shared by the InternVL3 / InternVL3.5 tests: the real widths of their decoders, random weights
for transformers' own models, and relative error.

The reference direction is the one a user's checkpoint takes: transformers builds the model
(random weights at the real widths, reduced depth and vocabulary) and saves it with
save_pretrained; the runtime loads that folder.
"""

from __future__ import annotations

import math

import torch

TOL = 1e-4

# llm_config / text_config widths of the upstream checkpoints (their config.json files): InternVL3-1B
# is Qwen2.5-0.5B, InternVL3-2B Qwen2.5-1.5B, InternVL3.5-1B Qwen3-0.6B, InternVL3.5-2B Qwen3-1.7B.
# All four tie the LM head to the embedding. Qwen3's head_dim (128) is not hidden / heads.
# InternVL2.5-2B's InternLM2 is what transformers' converter makes of it in -hf folders: a Llama
# model (wqkv split into q/k/v), its own LM head.
REAL_TEXT = {
    "internvl2_5-2b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                                     num_key_value_heads=8, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "internvl3-1b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                                   num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "internvl3-2b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                                   num_key_value_heads=2, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "internvl3_5-1b": ("qwen3", dict(hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                                     tie_word_embeddings=True)),
    "internvl3_5-2b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6,
                                     tie_word_embeddings=True)),
}
ROPE = {"rope_type": "default", "rope_theta": 1_000_000.0}
# InternViT-300M-448px-V2_5, the vision tower of all four
REAL_VISION = dict(hidden_size=1024, num_attention_heads=16, intermediate_size=4096, image_size=448, patch_size=14,
                   attention_bias=True, layer_norm_eps=1e-6)



def hf_text_config(shape: str, vocab_size: int, layers: int = 2):
    """transformers' Qwen2Config / Qwen3Config / LlamaConfig at the real width of `shape`, `layers`
    deep, fp32, eager."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    family, widths = REAL_TEXT[shape]
    if family == "llama":
        return LlamaConfig(vocab_size=vocab_size, num_hidden_layers=layers, rope_parameters=dict(ROPE),
                           max_position_embeddings=32768, attn_implementation="eager", **widths)
    cls = Qwen3Config if family == "qwen3" else Qwen2Config
    return cls(
        vocab_size=vocab_size,
        num_hidden_layers=layers,
        rope_parameters=dict(ROPE),
        max_position_embeddings=32768,
        use_sliding_window=False,
        attn_implementation="eager",
        **widths,
    )


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random, norms, biases and layer scales included (an init of ones and zeros
    would hide a dropped or misplaced one); matrices scaled 1/sqrt(fan_in). Names are transformers'."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            leaf = name.rsplit(".", 1)[-1]
            if leaf in ("lambda_1", "lambda_2"):
                p.copy_(0.5 + 0.2 * r)
            elif leaf == "bias":
                p.copy_(0.2 * r)
            elif p.dim() == 1:                                  # norm weights (q_norm/k_norm included)
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("embed_tokens.weight"):
                # upstream's init scale: a unit-scale embedding, tied to the head as in all four
                # models, makes every greedy step repeat the last token (a test that cannot tell)
                p.copy_(0.02 * r)
            elif name.endswith("cls_token"):
                p.copy_(r)
            elif name.endswith("position_embeddings"):
                p.copy_(0.5 * r)
            else:
                p.copy_(r / math.sqrt(p[0].numel()))


def run_ours_decoder(lm, ids: list[int], new_tokens: int):
    """Prefill + greedy decode through our decoder's static KV cache, as the pipeline drives it
    (the pipeline's torch engine). Returns (prefill logits [T, V], decode-step logits [n-1, V], ids)."""
    from litevlm_runtime.engines.torch_engine import TorchDecoder

    cfg = lm.cfg
    max_len = len(ids) + new_tokens
    k_cache = torch.zeros(cfg.num_hidden_layers, cfg.num_key_value_heads, max_len, cfg.head_dim)
    decoder = TorchDecoder(lm, k_cache, torch.zeros_like(k_cache))
    t = len(ids)
    hidden = decoder.prefill(lm.embed(torch.tensor(ids)), torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril())
    prefill = lm.head(hidden)
    out, steps = [int(prefill[-1].argmax())], []
    for slot in range(t, t + new_tokens - 1):
        s = torch.tensor([slot])
        hidden = decoder.step(lm.embed(torch.tensor([out[-1]])), s, s, torch.ones(1, slot, dtype=torch.bool),
                              torch.ones(1, 1, dtype=torch.bool))
        steps.append(lm.head(hidden)[0])
        out.append(int(steps[-1].argmax()))
    return prefill, torch.stack(steps), out


# The processor chat template of the -hf folders (InternVL3-1B-hf's chat_template.jinja): one
# `<IMG_CONTEXT>\n` per image entry, no default system turn.
HF_CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n'}}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}{% elif content['type'] == 'text' %}"
    "{{ content['text'] }}{% endif %}{% endfor %}{% endif %}{{'<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{'<|im_start|>assistant\\n' }}{% endif %}"
)
EXTRA_SPECIAL = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
                 "video_token": "<video>"}
