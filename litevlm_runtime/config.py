"""Model configuration, parsed from (and written back to) an InternVL2.5 `config.json`.

Only the fields the runtime needs are kept; unknown upstream keys are ignored on read, and the
writer emits the upstream key names so that our small checkpoints look like the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import CheckpointError

# Upstream `llm_config.architectures[0]` -> our decoder family.
LLM_ARCHITECTURES = {"InternLM2ForCausalLM": "internlm2", "Qwen2ForCausalLM": "qwen2"}

# InternVL2.5's default system prompt (upstream `internvl2_5` template).
INTERNVL_SYSTEM_MESSAGE = (
    "你是书生·万象，英文名是InternVL，是由上海人工智能实验室、清华大学及多家合作单位联合开发的多模态大语言模型。"
)


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
    architecture: str = "internlm2"   # "internlm2" | "qwen2"
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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass
class ModelConfig:
    vision: VisionConfig
    llm: LLMConfig
    downsample_ratio: float = 0.5
    template: str = "internvl2_5"
    force_image_size: int = 448      # tile size fed to the vision encoder
    system_message: str = INTERNVL_SYSTEM_MESSAGE

    @property
    def patches_per_side(self) -> int:
        return self.force_image_size // self.vision.patch_size

    @property
    def tokens_per_tile(self) -> int:
        side = int(self.patches_per_side * self.downsample_ratio)
        return side * side

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "ModelConfig":
        try:
            v, l = d["vision_config"], d["llm_config"]
        except KeyError as exc:
            raise CheckpointError(f"{source}: missing {exc.args[0]!r} (not an InternVL2.5 config)") from None
        arch_list = l.get("architectures") or ["?"]
        arch = LLM_ARCHITECTURES.get(arch_list[0])
        if arch is None:
            raise CheckpointError(
                f"{source}: unknown llm_config architecture {arch_list[0]!r}; "
                f"supported: {', '.join(LLM_ARCHITECTURES)}"
            )
        if d.get("ps_version", "v2") != "v2":
            raise CheckpointError(f"{source}: ps_version {d.get('ps_version')!r} unsupported (InternVL2.5 uses v2)")
        if v.get("qk_normalization", False):
            raise CheckpointError(f"{source}: vision qk_normalization (InternViT-6B) is not supported")
        vision = VisionConfig(
            hidden_size=v["hidden_size"],
            num_attention_heads=v["num_attention_heads"],
            num_hidden_layers=v["num_hidden_layers"],
            intermediate_size=v["intermediate_size"],
            image_size=v.get("image_size", 448),
            patch_size=v.get("patch_size", 14),
            layer_norm_eps=v.get("layer_norm_eps", 1e-6),
            qkv_bias=v.get("qkv_bias", True),
        )
        llm = LLMConfig(
            architecture=arch,
            hidden_size=l["hidden_size"],
            intermediate_size=l["intermediate_size"],
            num_attention_heads=l["num_attention_heads"],
            num_key_value_heads=l.get("num_key_value_heads", l["num_attention_heads"]),
            num_hidden_layers=l["num_hidden_layers"],
            rms_norm_eps=l.get("rms_norm_eps", 1e-6),
            rope_theta=float(l.get("rope_theta", 10000.0)),
            vocab_size=l["vocab_size"],
            max_position_embeddings=l.get("max_position_embeddings", 32768),
            tie_word_embeddings=bool(l.get("tie_word_embeddings", False)),
        )
        return cls(
            vision=vision,
            llm=llm,
            downsample_ratio=d.get("downsample_ratio", 0.5),
            template=d.get("template", "internvl2_5"),
            force_image_size=d.get("force_image_size") or vision.image_size,
            system_message=d.get("system_message", INTERNVL_SYSTEM_MESSAGE),
        )

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
            "tie_word_embeddings": l.tie_word_embeddings,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }
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
