"""Model shapes: the real InternVL2.5 sizes, and the project's own small ones for tests and the
bundled model (same architecture and layout, narrower and shallower, smaller tiles)."""

from __future__ import annotations

from dataclasses import replace

from ..models.config import LLMConfig, ModelConfig, RopeScaling, VisionConfig

SMALL_SYSTEM_MESSAGE = "You are a driving assistant. Answer about the six camera views."


def preset(name: str, vocab_size: int = 92553) -> ModelConfig:
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
        # layer, LM head) then costs at most 1/8 of a target step on the CPU (scripts/draft_cost.py).
        v1 = preset("bundled", vocab_size)
        return replace(v1, llm=replace(v1.llm, num_hidden_layers=12), force_image_size=224)
    raise ValueError(f"unknown preset {name!r}")


PRESETS = ("tiny", "small", "bundled", "bundled-v2", "internvl2_5-1b", "internvl2_5-2b")
