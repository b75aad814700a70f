"""Model configuration, parsed from (and written back to) an InternVL2.5 `config.json`.

Every value the runtime uses is type-checked with its key path (`llm_config.hidden_size must be
an integer, got '2048'`), sizes must be positive and heads must divide widths. No key is ignored
silently: a key is either read, checked to hold the one value the runtime implements (refused
otherwise), or on the allow-list below of keys upstream InternVL2.5 files carry that do not change
inference; any other key gets one warning naming it. The writer emits the upstream key names so
that our small checkpoints look like the real ones.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ..errors import CheckpointError

log = logging.getLogger(__name__)

# Upstream `llm_config.architectures[0]` -> our decoder family.
LLM_ARCHITECTURES = {"InternLM2ForCausalLM": "internlm2", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# The head size a config without `head_dim` means, per family, as its upstream modeling reads it:
# InternLM2 and Qwen2 hidden_size / heads, transformers' Qwen3Config a default of 128.
DEFAULT_HEAD_DIM = {"internlm2": None, "qwen2": None, "qwen3": 128}
ROPE_SCALING_TYPES = ("linear", "dynamic")

# InternVL2.5's default system prompt (upstream `internvl2_5` template).
INTERNVL_SYSTEM_MESSAGE = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
)

# Keys upstream InternVL2.5-1B/2B config.json files carry that inference may ignore.
# transformers' PretrainedConfig.to_dict writes all of these into every (sub-)config: bookkeeping,
# generation defaults (the runtime's own options decide decoding; EOS comes from the tokenizer
# files), label maps and training-only switches.
HF_BOOKKEEPING = frozenset({
    "_name_or_path", "_commit_hash", "_attn_implementation_autoset", "transformers_version", "torch_dtype",
    "dtype", "use_bfloat16", "model_type", "architectures", "auto_map", "return_dict", "output_hidden_states",
    "output_attentions", "torchscript", "tf_legacy_loss", "chunk_size_feed_forward", "is_encoder_decoder",
    "is_decoder", "cross_attention_hidden_size", "add_cross_attention", "tie_encoder_decoder", "max_length",
    "min_length", "do_sample", "early_stopping", "num_beams", "num_beam_groups", "diversity_penalty",
    "temperature", "top_k", "top_p", "typical_p", "repetition_penalty", "length_penalty",
    "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids", "num_return_sequences",
    "output_scores", "return_dict_in_generate", "forced_bos_token_id", "forced_eos_token_id",
    "remove_invalid_values", "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens",
    "finetuning_task", "id2label", "label2id", "tokenizer_class", "prefix", "bos_token_id", "pad_token_id",
    "eos_token_id", "sep_token_id", "decoder_start_token_id", "task_specific_params", "problem_type",
    "use_cache", "initializer_range", "initializer_factor",
})
IGNORABLE = {
    # hidden_size / tie_word_embeddings: InternVLChatConfig's copies of llm_config's; the dynamic
    # tiling keys: upstream's tiling policy, the runtime tiles per camera by its own options.
    "": HF_BOOKKEEPING | {"hidden_size", "tie_word_embeddings", "dynamic_image_size", "use_thumbnail",
                          "min_dynamic_patch", "max_dynamic_patch"},
    # flash attention is a kernel choice; dropout and drop path act in training only.
    "vision_config": HF_BOOKKEEPING | {"use_flash_attn", "dropout", "attention_dropout", "drop_path_rate"},
    # attn_implementation is a kernel choice; InternLM2's modeling never reads pretraining_tp;
    # Qwen2's sliding_window / max_window_layers act only with use_sliding_window (checked false).
    # Qwen3's use_sliding_window likewise (checked false); InternVL3.5's llm_config carries `_sliding_window_pattern`
    # only as bookkeeping of layer_types (read and checked).
    "llm_config": HF_BOOKKEEPING | {"attn_implementation", "pretraining_tp", "attention_dropout", "sliding_window",
                                    "max_window_layers", "_sliding_window_pattern"},
}
# Keys whose value changes the model: accepted only with the value the runtime implements
# (absent = that value, as in every InternVL2.5 file).
REQUIRED_VALUES = {
    "": {
        "ps_version": ("v2", "InternVL2.5's pixel shuffle"),
        "select_layer": (-1, "features of the last ViT layer"),
        "use_backbone_lora": (0, "merge LoRA weights before loading"),
        "use_llm_lora": (0, "merge LoRA weights before loading"),
        "pad2square": (False, "InternVL2.5 squashes tiles, it does not pad"),
    },
    "vision_config": {
        "qk_normalization": (False, "InternViT-6B's qk norm is not implemented"),
        "norm_type": ("layer_norm", "InternViT-300M's norm"),
        "hidden_act": ("gelu", "InternViT's MLP"),
        "num_channels": (3, "RGB tiles"),
        "pruned_heads": ({}, "pruned heads are not implemented"),
    },
    "llm_config": {"hidden_act": ("silu", "the SwiGLU MLP"), "pruned_heads": ({}, "pruned heads are not implemented")},
}
LLM_REQUIRED_VALUES = {
    "internlm2": {"bias": (False, "InternVL2.5's InternLM2 has no projection biases")},
    "qwen2": {
        "use_sliding_window": (False, "sliding-window attention is not implemented; InternVL2.5-1B ships it off")
    },
    "qwen3": {
        "use_sliding_window": (False, "sliding-window attention is not implemented; InternVL3.5 ships it off"),
        "attention_bias": (False, "Qwen3 projections without bias, as in every InternVL3.5"),
    },
}


class Section:
    """One object of config.json (the top level, vision_config or llm_config) read key by key: each
    value type-checked, every error naming the file and the key path; the keys read are recorded."""

    KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string", list: "a list",
             dict: "an object"}

    def __init__(self, data, name: str, source: str):
        self.name, self.source = name, source
        if not isinstance(data, dict):
            raise CheckpointError(f"{source}: {name} must be an object, got {data!r}")
        self.data = data
        self.read: set[str] = set()

    def key(self, key: str) -> str:
        return f"{self.name}.{key}" if self.name else key

    def error(self, key: str, message: str) -> CheckpointError:
        return CheckpointError(f"{self.source}: {self.key(key)} {message}")

    def get(self, key: str, kind: type, default=..., *, positive: bool = False, null_is_default: bool = False):
        self.read.add(key)
        value = self.data.get(key, ...)
        if value is ... or (value is None and null_is_default):
            if default is ...:
                raise self.error(key, "missing")
            return default
        if not self.is_kind(value, kind):
            raise self.error(key, f"must be {self.KINDS[kind]}, got {value!r}")
        if kind is float:
            value = float(value)
            if not math.isfinite(value):
                raise self.error(key, f"must be finite, got {value!r}")
        if positive and value <= 0:
            raise self.error(key, f"must be positive, got {value!r}")
        return value

    @staticmethod
    def is_kind(value, kind: type) -> bool:
        if kind is bool or isinstance(value, bool):
            return kind is bool and isinstance(value, bool)
        return isinstance(value, (int, float) if kind is float else kind)

    def require(self, values: dict) -> None:
        for key, (want, why) in values.items():
            self.read.add(key)
            if key in self.data and self.data[key] != want:
                raise self.error(key, f"is {self.data[key]!r}; only {want!r} is supported ({why})")

    def unknown(self) -> list[str]:
        return sorted(k for k in self.data if k not in self.read and k not in IGNORABLE[self.name])


@dataclass(frozen=True)
class RopeScaling:
    """`llm_config.rope_scaling`: linear (positions / factor) or dynamic NTK (base grows past
    max_position_embeddings), the two kinds InternLM2's modeling implements."""

    type: str
    factor: float

    def to_dict(self) -> dict:
        return {"type": self.type, "factor": self.factor}


@dataclass
class VisionConfig:
    hidden_size: int = 1024
    num_attention_heads: int = 16
    num_hidden_layers: int = 24
    intermediate_size: int = 4096
    image_size: int = 448          # the size the position embedding was trained at
    patch_size: int = 14
    layer_norm_eps: float = 1e-6
    qkv_bias: bool = True


@dataclass
class LLMConfig:
    architecture: str = "internlm2"   # "internlm2" | "qwen2" | "qwen3"
    hidden_size: int = 2048
    intermediate_size: int = 8192
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    num_hidden_layers: int = 24
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1_000_000.0
    vocab_size: int = 92553
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    rope_scaling: RopeScaling | None = None
    head_size: int | None = None      # `head_dim` when it is not hidden_size / heads (Qwen3: 128 at every width)

    def __post_init__(self):
        if self.head_size == self.hidden_size // self.num_attention_heads:
            self.head_size = None             # one spelling per shape, so configs compare equal

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden_size // self.num_attention_heads


@dataclass
class ModelConfig:
    vision: VisionConfig
    llm: LLMConfig
    downsample_ratio: float = 0.5
    template: str = "internvl2_5"
    force_image_size: int = 448      # tile size fed to the vision encoder
    system_message: str = INTERNVL_SYSTEM_MESSAGE
    # The folder's tensor names: "internvl_chat" (OpenGVLab's remote code, the runtime's own module
    # names) or "hf" (transformers' InternVLForConditionalGeneration; hf_layout.py maps them).
    weights_layout: str = "internvl_chat"

    @property
    def patches_per_side(self) -> int:
        return self.force_image_size // self.vision.patch_size

    @property
    def tokens_per_side(self) -> int:
        """The side of a tile's square grid of visual tokens (pixel shuffle of the patch grid)."""
        return int(self.patches_per_side * self.downsample_ratio)

    @property
    def tokens_per_tile(self) -> int:
        return self.tokens_per_side ** 2

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        top = Section(d, "", source)
        for key in ("vision_config", "llm_config"):
            if key not in d:
                raise CheckpointError(f"{source}: missing {key!r} (not an InternVL2.5 config)")
        v, l = Section(d["vision_config"], "vision_config", source), Section(d["llm_config"], "llm_config", source)
        top.read |= {"vision_config", "llm_config"}
        arch_list = l.get("architectures", list, ["?"]) or ["?"]
        arch = LLM_ARCHITECTURES.get(arch_list[0]) if isinstance(arch_list[0], str) else None
        if arch is None:
            raise CheckpointError(
                f"{source}: unknown llm_config architecture {arch_list[0]!r}; "
                f"supported: {', '.join(LLM_ARCHITECTURES)}"
            )
        for section, values in ((top, REQUIRED_VALUES[""]), (v, REQUIRED_VALUES["vision_config"]),
                                (l, REQUIRED_VALUES["llm_config"] | LLM_REQUIRED_VALUES[arch])):
            section.require(values)
        if arch in ("qwen2", "qwen3"):
            types = l.get("layer_types", list, [])
            if any(t != "full_attention" for t in types):
                raise l.error("layer_types", f"is {types!r}; only full_attention layers are implemented")
        vision = VisionConfig(
            hidden_size=v.get("hidden_size", int, positive=True),
            num_attention_heads=v.get("num_attention_heads", int, positive=True),
            num_hidden_layers=v.get("num_hidden_layers", int, positive=True),
            intermediate_size=v.get("intermediate_size", int, positive=True),
            image_size=v.get("image_size", int, 448, positive=True),
            patch_size=v.get("patch_size", int, 14, positive=True),
            layer_norm_eps=v.get("layer_norm_eps", float, 1e-6, positive=True),
            qkv_bias=v.get("qkv_bias", bool, True),
        )
        heads = l.get("num_attention_heads", int, positive=True)
        hidden = l.get("hidden_size", int, positive=True)
        head_dim = l.get("head_dim", int, DEFAULT_HEAD_DIM[arch], positive=True, null_is_default=True)
        if arch == "internlm2" and head_dim not in (None, hidden // heads):
            raise l.error("head_dim", f"is {head_dim}, not hidden_size / num_attention_heads {hidden // heads}: "
                                      f"InternLM2's modeling has no separate head size")
        theta, rope_scaling = read_rope(l)
        llm = LLMConfig(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=l.get("intermediate_size", int, positive=True),
            num_attention_heads=heads,
            # InternLM2Config / Qwen2Config: null or absent means one KV head per query head.
            num_key_value_heads=l.get("num_key_value_heads", int, heads, positive=True, null_is_default=True),
            num_hidden_layers=l.get("num_hidden_layers", int, positive=True),
            rms_norm_eps=l.get("rms_norm_eps", float, 1e-6, positive=True),
            rope_theta=theta,
            vocab_size=l.get("vocab_size", int, positive=True),
            max_position_embeddings=l.get("max_position_embeddings", int, 32768, positive=True),
            tie_word_embeddings=l.get("tie_word_embeddings", bool, False),
            rope_scaling=rope_scaling,
            head_size=head_dim if head_dim != hidden // heads else None,
        )
        cfg = cls(
            vision=vision,
            llm=llm,
            downsample_ratio=top.get("downsample_ratio", float, 0.5, positive=True),
            template=top.get("template", str, "internvl2_5"),
            # upstream: force_image_size or vision_config.image_size
            force_image_size=top.get("force_image_size", int, vision.image_size, positive=True, null_is_default=True),
            system_message=top.get("system_message", str, INTERNVL_SYSTEM_MESSAGE),
        )
        cfg.check_shapes(source)
        unknown = [s.key(k) for s in (top, v, l) for k in s.unknown()]
        if unknown:
            log.warning("%s: ignoring key(s) this runtime does not know: %s (check that they do not change "
                        "the model)", source, ", ".join(unknown))
        return cfg

    def check_shapes(self, source: str) -> None:
        """Heads divide widths, tiles divide into patches and the pixel shuffle's grid."""
        v, m = self.vision, self.llm
        problems = []
        if v.hidden_size % v.num_attention_heads:
            problems.append(f"vision_config.hidden_size {v.hidden_size} is not a multiple of "
                            f"vision_config.num_attention_heads {v.num_attention_heads}")
        if m.head_size is None and m.hidden_size % m.num_attention_heads:
            problems.append(f"llm_config.hidden_size {m.hidden_size} is not a multiple of "
                            f"llm_config.num_attention_heads {m.num_attention_heads}")
        elif m.head_dim % 2:
            problems.append(f"llm_config head size {m.head_dim} (head_dim, else hidden_size / num_attention_heads) "
                            f"must be even for RoPE")
        if m.num_attention_heads % m.num_key_value_heads:
            problems.append(f"llm_config.num_attention_heads {m.num_attention_heads} is not a multiple of "
                            f"llm_config.num_key_value_heads {m.num_key_value_heads}")
        shuffle = 1 / self.downsample_ratio
        if self.force_image_size % v.patch_size:
            problems.append(f"force_image_size {self.force_image_size} is not a multiple of "
                            f"vision_config.patch_size {v.patch_size}")
        elif shuffle != int(shuffle) or self.patches_per_side % int(shuffle):
            problems.append(f"downsample_ratio {self.downsample_ratio} does not divide the {self.patches_per_side} "
                            f"x {self.patches_per_side} patch grid of a {self.force_image_size} px tile")
        if problems:
            raise CheckpointError(f"{source}: {problems[0]}")

    def to_dict(self) -> dict:
        v, l = self.vision, self.llm
        llm_arch = {a: k for k, a in LLM_ARCHITECTURES.items()}[l.architecture]
        llm_dict = {
            "architectures": [llm_arch],
            "model_type": l.architecture,
            "hidden_size": l.hidden_size,
            "intermediate_size": l.intermediate_size,
            "num_attention_heads": l.num_attention_heads,
            "num_key_value_heads": l.num_key_value_heads,
            "num_hidden_layers": l.num_hidden_layers,
            "rms_norm_eps": l.rms_norm_eps,
            "rope_theta": l.rope_theta,
            "vocab_size": l.vocab_size,
            "max_position_embeddings": l.max_position_embeddings,
            "rope_scaling": l.rope_scaling.to_dict() if l.rope_scaling else None,
            "tie_word_embeddings": l.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }
        if l.architecture in ("qwen2", "qwen3"):
            llm_dict["use_sliding_window"] = False
        if l.architecture == "qwen3":
            llm_dict["head_dim"] = l.head_dim        # always written: absent means 128 to Qwen3Config
            llm_dict["attention_bias"] = False
        if l.architecture == "internlm2":
            llm_dict["bias"] = False
            llm_dict["auto_map"] = {"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}
        return {
            "architectures": ["InternVLChatModel"],
            "model_type": "internvl_chat",
            "downsample_ratio": self.downsample_ratio,
            "template": self.template,
            "force_image_size": self.force_image_size,
            "ps_version": "v2",
            "select_layer": -1,
            "dynamic_image_size": False,
            "use_thumbnail": False,
            "system_message": self.system_message,
            "vision_config": {
                "architectures": ["InternVisionModel"],
                "model_type": "intern_vit_6b",
                "hidden_size": v.hidden_size,
                "num_attention_heads": v.num_attention_heads,
                "num_hidden_layers": v.num_hidden_layers,
                "intermediate_size": v.intermediate_size,
                "image_size": v.image_size,
                "patch_size": v.patch_size,
                "layer_norm_eps": v.layer_norm_eps,
                "qkv_bias": v.qkv_bias,
                "qk_normalization": False,
                "norm_type": "layer_norm",
                "hidden_act": "gelu",
            },
            "llm_config": llm_dict,
        }


def read_rope(l: Section) -> tuple[float, RopeScaling | None]:
    """rope_theta and rope_scaling, from the keys InternLM2/Qwen2 configs use (`rope_scaling`
    {type, factor}) or transformers 5's `rope_parameters` {rope_type, rope_theta, factor}."""
    theta = l.get("rope_theta", float, None, positive=True)
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        raw = l.get(key, dict, None, null_is_default=True)
        if raw is None:
            continue
        allowed = {"type", "rope_type", "factor"} | ({"rope_theta"} if key == "rope_parameters" else set())
        extra = sorted(set(raw) - allowed)
        if extra:
            raise l.error(key, f"has key(s) {extra} this runtime does not implement (got {raw!r})")
        if "rope_theta" in raw:
            sub = Section(raw, l.key(key), l.source)
            t = sub.get("rope_theta", float, positive=True)
            if theta is not None and t != theta:
                raise l.error(key, f"rope_theta {t} contradicts llm_config.rope_theta {theta}")
            theta = t
        kinds = [raw[k] for k in ("type", "rope_type") if k in raw]
        if not all(isinstance(k, str) for k in kinds) or len(set(kinds)) > 1:
            raise l.error(key, f"type and rope_type must be one string: {raw!r}")
        kind = kinds[0] if kinds else "default"
        if kind == "default":
            continue
        if kind not in ROPE_SCALING_TYPES:
            raise l.error(key, f"type {kind!r} is not supported (supported: {', '.join(ROPE_SCALING_TYPES)}, "
                               f"as InternLM2 implements them)")
        factor = raw.get("factor")
        if not Section.is_kind(factor, float) or not math.isfinite(factor) or factor < 1:
            raise l.error(key, f"factor must be a number >= 1, got {factor!r}")
        found.append(RopeScaling(kind, float(factor)))
    if len(set(found)) > 1:
        raise l.error("rope_parameters", f"contradicts llm_config.rope_scaling ({found[0]} vs {found[1]})")
    # InternLM2Config / Qwen2Config default base 10000
    return (10000.0 if theta is None else theta), (found[0] if found else None)
