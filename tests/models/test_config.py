"""config.json keys (issue 13 item 3): upstream InternVL2.5 files parse without a warning, rope_scaling
is typed, values the runtime does not implement are refused, and any other key gets one warning."""

import copy
import logging

import pytest

from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.models.config import ModelConfig, RopeScaling
from litevlm_runtime.weights.presets import PRESETS, preset

# What transformers 4.37's PretrainedConfig.to_dict writes into every sub-config of InternVL2.5's
# config.json (InternVLChatConfig serialises llm_config and vision_config in full).
PRETRAINED_DEFAULTS = {
    "add_cross_attention": False, "bad_words_ids": None, "begin_suppress_tokens": None, "chunk_size_feed_forward": 0,
    "cross_attention_hidden_size": None, "decoder_start_token_id": None, "diversity_penalty": 0.0, "do_sample": False,
    "early_stopping": False, "encoder_no_repeat_ngram_size": 0, "exponential_decay_length_penalty": None,
    "finetuning_task": None, "forced_bos_token_id": None, "forced_eos_token_id": None,
    "id2label": {"0": "LABEL_0", "1": "LABEL_1"}, "is_decoder": False, "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "length_penalty": 1.0, "max_length": 20, "min_length": 0,
    "no_repeat_ngram_size": 0, "num_beam_groups": 1, "num_beams": 1, "num_return_sequences": 1,
    "output_attentions": False, "output_hidden_states": False, "output_scores": False, "prefix": None,
    "problem_type": None, "pruned_heads": {}, "remove_invalid_values": False, "repetition_penalty": 1.0,
    "return_dict": True, "return_dict_in_generate": False, "sep_token_id": None, "suppress_tokens": None,
    "task_specific_params": None, "temperature": 1.0, "tf_legacy_loss": False, "tie_encoder_decoder": False,
    "tokenizer_class": None, "top_k": 50, "top_p": 1.0, "torch_dtype": "bfloat16", "torchscript": False,
    "transformers_version": "4.37.2", "typical_p": 1.0, "use_bfloat16": True,
}
VISION_2B = PRETRAINED_DEFAULTS | {
    "architectures": ["InternVisionModel"], "attention_dropout": 0.0, "drop_path_rate": 0.0, "dropout": 0.0,
    "hidden_act": "gelu", "hidden_size": 1024, "image_size": 448, "initializer_factor": 1.0,
    "initializer_range": 0.02, "intermediate_size": 4096, "layer_norm_eps": 1e-06, "model_type": "intern_vit_6b",
    "norm_type": "layer_norm", "num_attention_heads": 16, "num_channels": 3, "num_hidden_layers": 24,
    "patch_size": 14, "qk_normalization": False, "qkv_bias": True, "use_flash_attn": True,
}
TOP = {
    "_commit_hash": None, "architectures": ["InternVLChatModel"],
    "auto_map": {"AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                 "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                 "AutoModelForCausalLM": "modeling_internvl_chat.InternVLChatModel"},
    "downsample_ratio": 0.5, "dynamic_image_size": True, "force_image_size": 448, "max_dynamic_patch": 12,
    "min_dynamic_patch": 1, "model_type": "internvl_chat", "pad2square": False, "ps_version": "v2",
    "select_layer": -1, "template": "internvl2_5", "torch_dtype": "bfloat16", "transformers_version": None,
    "use_backbone_lora": 0, "use_llm_lora": 0, "use_thumbnail": True,
}
INTERNVL2_5_2B = TOP | {"hidden_size": 2048, "vision_config": VISION_2B, "llm_config": PRETRAINED_DEFAULTS | {
    "_name_or_path": "internlm/internlm2_5-1_8b-chat", "architectures": ["InternLM2ForCausalLM"],
    "attn_implementation": "flash_attention_2",
    "auto_map": {"AutoConfig": "configuration_internlm2.InternLM2Config",
                 "AutoModel": "modeling_internlm2.InternLM2ForCausalLM",
                 "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
                 "AutoModelForSequenceClassification": "modeling_internlm2.InternLM2ForSequenceClassification"},
    "bias": False, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 32768, "model_type": "internlm2",
    "num_attention_heads": 16, "num_hidden_layers": 24, "num_key_value_heads": 8, "pad_token_id": 2,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 2.0, "type": "dynamic"},
    "rope_theta": 1000000, "tie_word_embeddings": False, "use_cache": True, "vocab_size": 92553,
}}
INTERNVL2_5_1B = TOP | {"hidden_size": 896, "vision_config": VISION_2B, "llm_config": PRETRAINED_DEFAULTS | {
    "_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896,
    "initializer_range": 0.02, "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
    "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
    "pad_token_id": None, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
    "tie_word_embeddings": False, "use_cache": False, "use_sliding_window": False, "vocab_size": 151674,
}}


def parse(d, caplog):
    with caplog.at_level(logging.WARNING):
        cfg = ModelConfig.from_dict(copy.deepcopy(d), source="config.json")
    return cfg, [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_upstream_2b_config_parses_silently_with_its_rope_scaling(caplog):
    cfg, warnings = parse(INTERNVL2_5_2B, caplog)
    assert warnings == []
    assert cfg.llm.rope_scaling == RopeScaling("dynamic", 2.0) and cfg.llm.rope_theta == 1e6
    assert (cfg.llm.hidden_size, cfg.llm.num_key_value_heads, cfg.llm.head_dim, cfg.llm.vocab_size) == (
        2048,
        8,
        128,
        92553,
    )
    assert (cfg.vision.hidden_size, cfg.force_image_size, cfg.tokens_per_tile) == (1024, 448, 256)


def test_upstream_1b_config_parses_silently(caplog):
    cfg, warnings = parse(INTERNVL2_5_1B, caplog)
    assert warnings == [] and cfg.llm.architecture == "qwen2" and cfg.llm.rope_scaling is None
    assert (cfg.llm.hidden_size, cfg.llm.num_attention_heads, cfg.llm.num_key_value_heads) == (896, 14, 2)


def test_unknown_keys_get_one_warning_naming_them(caplog):
    d = copy.deepcopy(INTERNVL2_5_2B)
    d["use_fancy_router"] = True
    d["llm_config"]["moe_experts"] = 8
    d["vision_config"]["use_rel_pos"] = True
    _, warnings = parse(d, caplog)
    assert len(warnings) == 1
    assert "use_fancy_router, vision_config.use_rel_pos, llm_config.moe_experts" in warnings[0]
    assert warnings[0].startswith("config.json: ignoring key(s)")


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("llm_config", "use_sliding_window", True, "llm_config.use_sliding_window is True; only False is supported"),
        ("llm_config", "layer_types", ["full_attention", "sliding_attention"], "llm_config.layer_types is"),
        (
            "llm_config",
            "rope_scaling",
            {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            "llm_config.rope_scaling has key(s) ['original_max_position_embeddings']",
        ),
        (
            "llm_config",
            "rope_scaling",
            {"rope_type": "llama3", "factor": 8.0},
            "llm_config.rope_scaling type 'llama3' is not supported",
        ),
        (
            "llm_config",
            "rope_scaling",
            {"type": "linear", "factor": 0.5},
            "llm_config.rope_scaling factor must be a number >= 1, got 0.5",
        ),
        (
            "llm_config",
            "rope_scaling",
            {"type": "linear", "rope_type": "dynamic", "factor": 2.0},
            "llm_config.rope_scaling type and rope_type must be one string",
        ),
    ],
)
def test_qwen2_values_the_runtime_does_not_implement_are_refused(section, key, value, message):
    d = copy.deepcopy(INTERNVL2_5_1B)
    d[section][key] = value
    with pytest.raises(CheckpointError) as err:
        ModelConfig.from_dict(d, source="config.json")
    assert str(err.value).startswith(f"config.json: {message}"), str(err.value)


def test_qwen2_head_dim_is_read_as_transformers_qwen2_reads_it():
    d = copy.deepcopy(INTERNVL2_5_1B)
    d["llm_config"]["head_dim"] = 128          # not 896 / 14: transformers' Qwen2 sizes q/k/v heads by it
    assert ModelConfig.from_dict(d, source="config.json").llm.head_dim == 128


def test_internlm2_head_dim_other_than_hidden_over_heads_is_refused():
    d = copy.deepcopy(INTERNVL2_5_2B)
    d["llm_config"]["head_dim"] = 64
    with pytest.raises(
        CheckpointError,
        match="config.json: llm_config.head_dim is 64, not hidden_size / "
        "num_attention_heads 128: InternLM2's modeling has no separate head size",
    ):
        ModelConfig.from_dict(d, source="config.json")


@pytest.mark.parametrize("key, value", [("bias", True), ("hidden_act", "gelu")])
def test_internlm2_values_the_runtime_does_not_implement_are_refused(key, value):
    d = copy.deepcopy(INTERNVL2_5_2B)
    d["llm_config"][key] = value
    with pytest.raises(CheckpointError, match=f"config.json: llm_config.{key} is {value!r}; only"):
        ModelConfig.from_dict(d, source="config.json")


def test_transformers5_rope_parameters_spelling(caplog):
    d = copy.deepcopy(INTERNVL2_5_1B)
    del d["llm_config"]["rope_theta"]
    d["llm_config"]["rope_parameters"] = {"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0}
    cfg, warnings = parse(d, caplog)
    assert warnings == [] and cfg.llm.rope_theta == 500000.0 and cfg.llm.rope_scaling == RopeScaling("linear", 2.0)
    d["llm_config"]["rope_theta"] = 1e6
    with pytest.raises(CheckpointError, match="rope_parameters rope_theta 500000.0 contradicts llm_config.rope_theta"):
        ModelConfig.from_dict(d, source="config.json")


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("scaling", [None, RopeScaling("linear", 1.5), RopeScaling("dynamic", 2.0)])
def test_written_configs_read_back_identically(name, scaling, caplog):
    cfg = preset(name)
    cfg.llm.rope_scaling = scaling
    back, warnings = parse(cfg.to_dict(), caplog)
    assert back == cfg and warnings == []
