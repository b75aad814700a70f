"""The transformers-native `-hf` folder layout (InternVL3-1B-hf, InternVL3_5-2B-HF, ...): its
config.json read into the runtime's ModelConfig, and its tensor names mapped onto the runtime's
modules (which carry the remote-code names), read by name from the folder's safetensors: no copy of
the weights on disk.

A folder is `-hf` when its config.json says `architectures: ["InternVLForConditionalGeneration"]`
(or `model_type: "internvl"`); the remote-code layout says `InternVLChatModel` / `internvl_chat`.

Config: InternVLConfig's keys are translated to the remote-code keys that ModelConfig.from_dict
reads, so both layouts pass the same checks and refusals; an error names the key as the -hf file
spells it (`text_config.use_sliding_window`, `vision_config.attention_bias`). The keys only the -hf
layout has are checked here against what transformers' InternVL then computes and the runtime
implements (vision_feature_layer -1, the `default` feature strategy, gelu projector, absolute
position embeddings, no final ViT norm, image_seq_length = the tile's tokens).

Tensor names (transformers' convert_internvl_weights_to_hf.py, read backwards), in either of the two
spellings transformers loads: the module names of InternVLForConditionalGeneration (`model.vision_tower.`,
`model.multi_modal_projector.`, `model.language_model.`, `lm_head.`; the converted hub folders), or
the spelling transformers 5's save_pretrained writes through its llava conversion mapping
(`vision_tower.`, `multi_modal_projector.`, `language_model.model.`, `language_model.lm_head.`):
  model.vision_tower.embeddings.{cls_token, position_embeddings, patch_embeddings.projection}
      -> vision_model.embeddings.{class_embedding, position_embedding, patch_embedding}
  model.vision_tower.encoder.layer.N.attention.{q,k,v}_proj -> vision_model.encoder.layers.N.attn.qkv
      (concatenated rows [q | k | v], as upstream's fused qkv)
  ...attention.projection_layer -> attn.proj, layernorm_before/after -> norm1/norm2, lambda_1/2 -> ls1/ls2
  model.multi_modal_projector.{layer_norm, linear_1, linear_2} -> mlp1.{0, 1, 3}
  model.language_model.* -> language_model.model.*, lm_head.weight -> language_model.lm_head.weight
"""

from __future__ import annotations

import re

import torch

from ..errors import CheckpointError

HF_ARCHITECTURE = "InternVLForConditionalGeneration"
# text_config.model_type -> the llm_config architecture the runtime implements. "llama" is InternLM2
# as transformers' converter writes it (InternVL2.5-2B-hf): `wqkv` split into q/k/v, renamed.
TEXT_MODEL_TYPES = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "InternLM2ForCausalLM"}
# -hf key -> remote-code key, per section ("" = top level)
VISION_RENAMES = {"attention_bias": "qkv_bias", "use_qk_norm": "qk_normalization"}
TOP_RENAMES = {"vision_feature_layer": "select_layer"}
# Keys only the -hf config has, checked here (value the runtime implements, why), then dropped.
HF_REQUIRED = {
    "": {"vision_feature_select_strategy": ("default", "drops the CLS token, as upstream's [:, 1:]"),
         "projector_hidden_act": ("gelu", "mlp1's GELU")},
    "vision_config": {"use_absolute_position_embeddings": (True, "InternViT's learned position embedding"),
                      "use_mean_pooling": (True, "no final ViT norm; False adds one the runtime does not have")},
}
# -hf keys that do not change inference: initialisation, dropout (training only), the mask token
# (used only with bool_masked_pos, which InternVL never passes), the image token id (checked
# against the tokenizer by the runtime's own lookup of <IMG_CONTEXT>).
HF_IGNORABLE = {
    "": {"image_token_id", "image_seq_length"},
    "vision_config": {"hidden_dropout_prob", "projection_dropout", "layer_scale_init_value", "use_mask_token",
                      "initializer_range", "attention_dropout"},
}


def is_hf_layout(config: dict) -> bool:
    return HF_ARCHITECTURE in (config.get("architectures") or []) or config.get("model_type") == "internvl"


def _square(section: dict, key: str, label: str, source: str):
    """transformers writes image_size / patch_size as [h, w]; the runtime's tiles are square."""
    value = section.get(key)
    if isinstance(value, list):
        if len(value) != 2 or value[0] != value[1]:
            raise CheckpointError(f"{source}: {label}.{key} is {value!r}; only square sizes are supported")
        return value[0]
    return value


def to_remote_config(config: dict, source: str) -> tuple[dict, dict[str, str]]:
    """(the remote-code config.json this -hf config means, {remote key path: -hf key path} to name
    keys in errors as the file spells them)."""
    for key in ("vision_config", "text_config"):
        if not isinstance(config.get(key), dict):
            raise CheckpointError(f"{source}: missing {key!r} (not an InternVLForConditionalGeneration config)")
    for label, section in (("", config), ("vision_config", config["vision_config"])):
        for key, (want, why) in HF_REQUIRED[label].items():
            if key in section and section[key] != want:
                path = f"{label}.{key}" if label else key
                raise CheckpointError(f"{source}: {path} is {section[key]!r}; only {want!r} is supported ({why})")
    names = {"llm_config": "text_config"}
    text = dict(config["text_config"])
    model_type = text.pop("model_type", None)
    if model_type not in TEXT_MODEL_TYPES:
        raise CheckpointError(f"{source}: text_config.model_type {model_type!r} is not supported in the -hf layout "
                              f"(supported: {', '.join(TEXT_MODEL_TYPES)})")
    arch = TEXT_MODEL_TYPES[model_type]
    listed = text.get("architectures")
    expected_listed = "LlamaForCausalLM" if model_type == "llama" else arch
    if listed and listed != [expected_listed]:
        raise CheckpointError(f"{source}: text_config.architectures {listed!r} contradicts text_config.model_type "
                              f"{model_type!r}")
    text["architectures"] = [arch]
    if model_type == "llama":
        llama_to_internlm2(text, names, source)
    # transformers 5 ties InternVL's LM head by the top-level key (InternVLConfig default true), the
    # remote code by llm_config's: a folder where the two differ means different models to each.
    tie_top, tie_text = config.get("tie_word_embeddings", True), text.get("tie_word_embeddings", False)
    if bool(tie_top) != bool(tie_text):
        raise CheckpointError(
            f"{source}: tie_word_embeddings is {tie_top} (absent = true, InternVLConfig's default, which transformers "
            f"ties the LM head by) but text_config.tie_word_embeddings is {tie_text}; make them agree")
    vision = {}
    for key, value in config["vision_config"].items():
        if key in HF_REQUIRED["vision_config"] or key in HF_IGNORABLE["vision_config"]:
            continue
        remote = VISION_RENAMES.get(key, key)
        names[f"vision_config.{remote}"] = f"vision_config.{key}"
        vision[remote] = value
    for key in ("image_size", "patch_size"):
        if key in vision:
            vision[key] = _square(config["vision_config"], key, "vision_config", source)
    top = {}
    for key, value in config.items():
        if key in ("vision_config", "text_config", "architectures", "model_type", "tie_word_embeddings") \
                or key in HF_REQUIRED[""] or key in HF_IGNORABLE[""]:
            continue
        remote = TOP_RENAMES.get(key, key)
        names[remote] = key
        top[remote] = value
    # The -hf processor's chat template, not InternVL2.5's system message, decides the prompt (chat_template.py).
    # (A system_message key, which the runtime reads in both layouts, still sets one: thinking mode.)
    remote_config = {"system_message": "", **top, "architectures": ["InternVLChatModel"], "model_type": "internvl_chat",
                     "vision_config": vision, "llm_config": text}
    return remote_config, names


def llama_to_internlm2(text: dict, names: dict[str, str], source: str) -> None:
    """A converted InternLM2's LlamaConfig keys as InternLM2's: attention_bias is InternLM2's `bias`;
    Llama's MLP bias and its linear RoPE scaling (inv_freq / factor, where InternLM2 divides the
    positions, which rounds differently) have no InternLM2 counterpart."""
    if text.pop("mlp_bias", False):
        raise CheckpointError(
            f"{source}: text_config.mlp_bias is True; only False is supported (InternLM2's MLP has no bias)"
        )
    for key in ("rope_scaling", "rope_parameters"):
        raw = text.get(key)
        if isinstance(raw, dict) and (raw.get("rope_type") or raw.get("type")) == "linear":
            raise CheckpointError(f"{source}: text_config.{key} {raw!r}: linear scaling of a Llama text model is not "
                                  f"InternLM2's (Llama divides the frequencies, InternLM2 the positions); unsupported")
    if "attention_bias" in text:
        text["bias"] = text.pop("attention_bias")
        names["llm_config.bias"] = "text_config.attention_bias"


def rename_in_error(exc: CheckpointError, source: str, names: dict[str, str]) -> CheckpointError:
    """The parser's error with the key path as the -hf file spells it."""
    message = str(exc)
    prefix = f"{source}: "
    if message.startswith(prefix):
        rest = message[len(prefix):]
        for remote, hf in sorted(names.items(), key=lambda kv: -len(kv[0])):
            if rest.startswith(remote + " ") or rest.startswith(remote + "."):
                rest = hf + rest[len(remote):]
                break
        else:
            rest = re.sub(r"^llm_config\b", "text_config", rest)
        message = prefix + rest
    return CheckpointError(message)


def check_image_seq_length(config: dict, tokens_per_tile: int, source: str) -> None:
    n = config.get("image_seq_length")
    if n is not None and n != tokens_per_tile:
        raise CheckpointError(f"{source}: image_seq_length is {n!r}, but the tiles give {tokens_per_tile} visual "
                              f"tokens (image_size / patch_size * downsample_ratio, squared)")


_VISION_RULES = [
    ("embeddings.class_embedding", "embeddings.cls_token"),
    ("embeddings.position_embedding", "embeddings.position_embeddings"),
    ("embeddings.patch_embedding.", "embeddings.patch_embeddings.projection."),
    (".attn.proj.", ".attention.projection_layer."),
    (".norm1.", ".layernorm_before."),
    (".norm2.", ".layernorm_after."),
]
_PROJECTOR = {"0": "layer_norm", "1": "linear_1", "3": "linear_2"}


# spelling -> (vision tower, projector, decoder, LM head) prefixes
SPELLINGS = {
    "module": ("model.vision_tower.", "model.multi_modal_projector.", "model.language_model.", "lm_head."),
    "saved": ("vision_tower.", "multi_modal_projector.", "language_model.model.", "language_model.lm_head."),
}


def spelling_of(names) -> str:
    """Which of the two spellings a folder's tensor names use."""
    for spelling, (vision, *_) in SPELLINGS.items():
        if any(n.startswith(vision) for n in names):
            return spelling
    raise CheckpointError(f"an InternVLForConditionalGeneration folder without vision tower tensors "
                          f"(model.vision_tower.* or vision_tower.*)")


# InternLM2 module names -> the converted Llama names (transformers' converter, TEXT_LLAMA mapping)
_INTERNLM2_RULES = [
    ("tok_embeddings.", "embed_tokens."),
    (".attention.wo.", ".self_attn.o_proj."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".attention_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
]


def hf_names(name: str, spelling: str = "module") -> tuple[str, ...]:
    """The -hf tensor(s) that make the runtime's tensor `name` (three for InternViT's fused qkv and
    for InternLM2's packed wqkv)."""
    vision, projector, decoder, head = SPELLINGS[spelling]
    if name.startswith("language_model."):
        rest = name[len("language_model."):]
        if rest.startswith(("lm_head.", "output.")):
            return (head + rest.split(".", 1)[1],)
        rest = rest.removeprefix("model.")
        if ".attention.wqkv." in rest:
            base, leaf = rest.split(".attention.wqkv.")
            return tuple(f"{decoder}{base}.self_attn.{p}_proj.{leaf}" for p in ("q", "k", "v"))
        for ours, theirs in _INTERNLM2_RULES:
            rest = rest.replace(ours, theirs)
        return (decoder + rest,)
    if name.startswith("mlp1."):
        index, leaf = name[len("mlp1."):].split(".", 1)
        return (f"{projector}{_PROJECTOR[index]}.{leaf}",)
    if not name.startswith("vision_model."):
        raise CheckpointError(f"no -hf name for tensor {name!r}")
    hf = vision + name[len("vision_model."):].replace("encoder.layers.", "encoder.layer.")
    for ours, theirs in _VISION_RULES:
        hf = hf.replace(ours, theirs)
    hf = re.sub(r"\.ls([12])$", r".lambda_\1", hf)
    if ".attn.qkv." in hf:
        base, leaf = hf.split(".attn.qkv.")
        return tuple(f"{base}.attention.{p}_proj.{leaf}" for p in ("q", "k", "v"))
    return (hf,)


def pack_wqkv(num_heads: int, num_kv_heads: int, head_dim: int):
    """q [H*D, ...], k, v [K*D, ...] -> InternLM2's wqkv rows, grouped per KV head as [q_(g*h) ..
    q_(g*h+g-1), k_h, v_h] (the inverse of transformers' converter's split)."""
    group = num_heads // num_kv_heads

    def pack(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        tail = q.shape[1:]
        blocks = [q.reshape(num_kv_heads, group, head_dim, *tail), k.reshape(num_kv_heads, 1, head_dim, *tail),
                  v.reshape(num_kv_heads, 1, head_dim, *tail)]
        return torch.cat(blocks, dim=1).reshape((num_heads + 2 * num_kv_heads) * head_dim, *tail)
    return pack


def tensor_sources(expected: list[str], llm, file_names):
    """({runtime name: -hf names}, {runtime name: how its -hf tensors combine} (default: rows
    concatenated), -hf names the folder may hold that the runtime does not read: a tied head's
    weight, which transformers ties to the embedding whatever the file holds)."""
    spelling = spelling_of(file_names)
    unread = {SPELLINGS[spelling][3] + "weight"} if llm.tie_word_embeddings else set()
    pack = pack_wqkv(llm.num_attention_heads, llm.num_key_value_heads, llm.head_dim)
    combine = {name: pack for name in expected if ".attention.wqkv." in name}
    return {name: hf_names(name, spelling) for name in expected}, combine, unread
