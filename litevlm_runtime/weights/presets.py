"""Model shapes: the real InternVL2.5 / InternVL3 / InternVL3.5 sizes, and the project's own small ones for
tests and the
bundled model (same architecture and layout, narrower and shallower, smaller tiles)."""

from __future__ import annotations

from dataclasses import replace

from ..models.config import LLMConfig, ModelConfig, RopeScaling, VisionConfig

SMALL_SYSTEM_MESSAGE = "You are a driving assistant. Answer about the six camera views."


def preset(name: str, vocab_size: int | None = None) -> ModelConfig:
    """The shape of preset `name` with an LM head of `vocab_size` ids (the tokenizer's; default: an
    InternVL3/3.5 preset's upstream vocabulary, else InternLM2's 92553)."""
    if name in INTERNVL3:
        return internvl3_preset(name, vocab_size)
    vocab_size = 92553 if vocab_size is None else vocab_size
    if name == "internvl2_5-2b":
        # upstream llm_config.rope_scaling: InternLM2's dynamic NTK, acting only past 32768 positions
        return ModelConfig(VisionConfig(), LLMConfig(vocab_size=vocab_size, rope_scaling=RopeScaling("dynamic", 2.0)))
    if name == "internvl2_5-1b":
        return ModelConfig(VisionConfig(), LLMConfig(
            architecture="qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14,
            num_key_value_heads=2, num_hidden_layers=24, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
            vocab_size=vocab_size))
    if name == "tiny":       # seconds to build; unit tests
        return ModelConfig(
            VisionConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128,
                         image_size=112, patch_size=14),
            LLMConfig(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                      num_hidden_layers=2, vocab_size=vocab_size),
            force_image_size=112, system_message=SMALL_SYSTEM_MESSAGE)
    if name == "tiny-qwen3":  # "tiny" with an InternVL3.5-style decoder: Qwen3, head_dim 64 != 128 / 4, tied head
        tiny = preset("tiny", vocab_size)
        return replace(tiny, llm=replace(tiny.llm, architecture="qwen3", head_size=64, rms_norm_eps=1e-6,
                                         rope_theta=1_000_000.0, tie_word_embeddings=True))
    if name == "small":      # the bundled model: trains on a 2-core CPU
        return ModelConfig(
            VisionConfig(hidden_size=128, num_attention_heads=4, num_hidden_layers=4, intermediate_size=384,
                         image_size=224, patch_size=14),
            LLMConfig(hidden_size=256, intermediate_size=768, num_attention_heads=8, num_key_value_heads=4,
                      num_hidden_layers=4, vocab_size=vocab_size),
            force_image_size=224, system_message=SMALL_SYSTEM_MESSAGE)
    if name == "bundled":    # the first bundled model (v1); v2 grew from it: trains on a 2-core CPU in < 1 h
        # 140 px tiles: 10 x 10 patches -> 25 visual tokens per camera (150 for the six views);
        # a 3-layer decoder: the answers are short and templated, the budget goes to seeing frames.
        return ModelConfig(
            VisionConfig(hidden_size=128, num_attention_heads=4, num_hidden_layers=4, intermediate_size=512,
                         image_size=140, patch_size=14),
            LLMConfig(hidden_size=256, intermediate_size=512, num_attention_heads=8, num_key_value_heads=4,
                      num_hidden_layers=3, vocab_size=vocab_size),
            force_image_size=140, system_message=SMALL_SYSTEM_MESSAGE)
    if name == "bundled-v2":  # the bundled default model v2: "bundled" at 224 px tiles, 12 decoder layers
        # Grown from "bundled" (its vision tower keeps the 140 px position grid it was trained with,
        # interpolated to 16 x 16 patches at 224 px). 12 layers: one EAGLE-2 draft step (fc, one
        # layer, LM head) then costs at most 1/8 of a target step on the CPU (litevlm bench --study draft_cost).
        v1 = preset("bundled", vocab_size)
        return replace(v1, llm=replace(v1.llm, num_hidden_layers=12), force_image_size=224)
    raise ValueError(f"unknown preset {name!r}")


# InternVL3 (Qwen2.5 decoders) and InternVL3.5 (Qwen3 decoders), the llm_config of each upstream
# config.json: every one ties its LM head to the embedding, uses RoPE base 1e6 without scaling and
# InternViT-300M-448px-V2_5 (VisionConfig's defaults). Qwen3's head size is 128 at both widths.
INTERNVL3 = {
    "internvl3-1b": dict(architecture="qwen2", hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                         num_key_value_heads=2, num_hidden_layers=24, vocab_size=151674),        # Qwen2.5-0.5B
    "internvl3-2b": dict(architecture="qwen2", hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                         num_key_value_heads=2, num_hidden_layers=28, vocab_size=151674),        # Qwen2.5-1.5B
    "internvl3_5-1b": dict(architecture="qwen3", hidden_size=1024, intermediate_size=3072, num_attention_heads=16,
                           num_key_value_heads=8, num_hidden_layers=28, head_size=128, vocab_size=151936,
                           max_position_embeddings=40960),                                     # Qwen3-0.6B
    "internvl3_5-2b": dict(architecture="qwen3", hidden_size=2048, intermediate_size=6144, num_attention_heads=16,
                           num_key_value_heads=8, num_hidden_layers=28, head_size=128, vocab_size=151936,
                           max_position_embeddings=40960),                                     # Qwen3-1.7B
}
# The vocabulary of each InternVL3/3.5 preset's own tokenizer (what `--preset` benchmarks size the LM head by).
UPSTREAM_VOCAB = {name: d["vocab_size"] for name, d in INTERNVL3.items()}


def internvl3_preset(name: str, vocab_size: int | None) -> ModelConfig:
    shape = dict(INTERNVL3[name], rms_norm_eps=1e-6, rope_theta=1_000_000.0, tie_word_embeddings=True)
    if vocab_size is not None:
        shape["vocab_size"] = vocab_size
    return ModelConfig(VisionConfig(), LLMConfig(**shape))


PRESETS = ("tiny", "tiny-qwen3", "small", "bundled", "bundled-v2", "internvl2_5-1b", "internvl2_5-2b", *INTERNVL3)
