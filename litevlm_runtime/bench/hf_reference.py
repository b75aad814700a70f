"""Bridge from an InternVL2.5 checkpoint folder to transformers' own implementations.

The project's models (litevlm_runtime/models/) are proved against these references, and
`litevlm bench` uses `hf_generate` as its baseline. Everything here deliberately reads the raw
upstream `config.json` keys itself rather than the runtime's parsed config, so that a mistake in
our parser shows up as a mismatch instead of being copied into the reference.

Weight conversion follows transformers' own converter (models/internvl/
convert_internvl_weights_to_hf.py): InternViT's fused `qkv` splits into three equal row blocks,
`ls1/ls2` become `lambda_1/lambda_2`, `mlp1.{0,1,3}` become the projector's
`layer_norm/linear_1/linear_2`, and InternLM2 becomes a Llama model after un-packing `wqkv`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..errors import CheckpointError
from ..weights.checkpoint import weight_files

# transformers (and safetensors' reader) are imported where a reference model is built: transformers takes
# seconds to load, and the rest of the package never needs it.

# Upstream InternVL keeps the <IMG_CONTEXT> id in the tokenizer, not in config.json; these are the
# ids of the real tokenizers (as in transformers' converter), used only when the folder's own
# tokenizer files do not name the token.
DEFAULT_IMAGE_TOKEN_ID = {"InternLM2ForCausalLM": 92546, "Qwen2ForCausalLM": 151667}
# Qwen3 (InternVL3.5): no default id here; the folder's tokenizer must name <IMG_CONTEXT>.
REFERENCE_ARCHITECTURES = (*DEFAULT_IMAGE_TOKEN_ID, "Qwen3ForCausalLM")
IMAGE_CONTEXT_TOKEN = "<IMG_CONTEXT>"


# ----------------------------------------------------------------------------------------------
# Reading a checkpoint folder
# ----------------------------------------------------------------------------------------------

def load_upstream_state_dict(model_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Read `config.json` and the safetensors weights (single file or sharded) of an InternVL2.5
    folder. Returns (config dict, {upstream name: tensor}) with tensors as stored (dtype kept).

    The raw config dict is returned, not the runtime's parsed ModelConfig, so that the reference
    is configured independently of our parser. File discovery (index, shards, missing-shard
    errors) is the runtime's own `checkpoint.weight_files`.
    """
    from safetensors import safe_open


    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{config_path}: missing (not a Hugging Face model folder)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None
    by_file: dict[Path, list[str]] = {}
    for name, path in weight_files(model_dir).items():
        by_file.setdefault(path, []).append(name)
    state: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        with safe_open(str(path), "pt") as f:
            present = set(f.keys())
            for name in names:
                if name not in present:
                    raise CheckpointError(f"{path}: tensor {name!r} listed in the index but not in the file")
                state[name] = f.get_tensor(name)
    return config, state


def find_image_token_id(model_dir: str | Path, config: dict | None = None) -> int:
    """The id of `<IMG_CONTEXT>` from the folder's tokenizer files, else the real tokenizer's id."""
    model_dir = Path(model_dir)
    tok_json = model_dir / "tokenizer.json"
    if tok_json.is_file():
        for tok in json.loads(tok_json.read_text()).get("added_tokens", []):
            if tok.get("content") == IMAGE_CONTEXT_TOKEN:
                return int(tok["id"])
    added = model_dir / "added_tokens.json"
    if added.is_file():
        ids = json.loads(added.read_text())
        if IMAGE_CONTEXT_TOKEN in ids:
            return int(ids[IMAGE_CONTEXT_TOKEN])
    tok_cfg = model_dir / "tokenizer_config.json"
    if tok_cfg.is_file():
        for tid, tok in json.loads(tok_cfg.read_text()).get("added_tokens_decoder", {}).items():
            if tok.get("content") == IMAGE_CONTEXT_TOKEN:
                return int(tid)
    config = config if config is not None else json.loads((model_dir / "config.json").read_text())
    arch = _llm_architecture(config)
    if arch not in DEFAULT_IMAGE_TOKEN_ID:
        raise CheckpointError(f"{model_dir}: the tokenizer files do not name {IMAGE_CONTEXT_TOKEN}")
    return DEFAULT_IMAGE_TOKEN_ID[arch]


# ----------------------------------------------------------------------------------------------
# Configs: upstream InternVLChatModel config.json -> transformers configs
# ----------------------------------------------------------------------------------------------

def _llm_architecture(config: dict) -> str:
    llm = config.get("llm_config") or {}
    arch = (llm.get("architectures") or ["?"])[0]
    if arch not in REFERENCE_ARCHITECTURES:
        raise CheckpointError(f"config.json: llm_config architecture {arch!r} has no transformers reference")
    return arch


def hf_text_config(config: dict):
    """LlamaConfig (InternLM2), Qwen2Config or Qwen3Config from `llm_config`, fp32 and eager attention."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    llm = config["llm_config"]
    arch = _llm_architecture(config)
    heads = llm["num_attention_heads"]
    rope_scaling = llm.get("rope_scaling")
    # InternLM2's "dynamic" NTK scaling only changes RoPE past max_position_embeddings (32768),
    # which the runtime never reaches; any other scaling would change every position.
    if rope_scaling and rope_scaling.get("type", rope_scaling.get("rope_type")) not in ("dynamic", "default"):
        raise CheckpointError(f"config.json: rope_scaling {rope_scaling} has no reference here")
    common = dict(
        vocab_size=llm["vocab_size"],
        hidden_size=llm["hidden_size"],
        intermediate_size=llm["intermediate_size"],
        num_hidden_layers=llm["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=llm.get("num_key_value_heads") or heads,
        hidden_act=llm.get("hidden_act", "silu"),
        max_position_embeddings=llm.get("max_position_embeddings", 32768),
        tie_word_embeddings=bool(llm.get("tie_word_embeddings", False)),
        bos_token_id=llm.get("bos_token_id"),
        eos_token_id=llm.get("eos_token_id"),
        pad_token_id=llm.get("pad_token_id"),
        attn_implementation="eager",
        dtype=torch.float32,
    )
    if arch == "InternLM2ForCausalLM":
        # Upstream InternLM2Config defaults: rms_norm_eps 1e-6, rope_theta 10000, bias True.
        return LlamaConfig(
            **common,
            head_dim=llm["hidden_size"] // heads,
            rms_norm_eps=llm.get("rms_norm_eps", 1e-6),
            rope_parameters={"rope_type": "default", "rope_theta": float(llm.get("rope_theta", 10000.0))},
            attention_bias=bool(llm.get("bias", True)),
            mlp_bias=False,
        )
    if arch == "Qwen3ForCausalLM":
        # Qwen3Config's own defaults for absent keys: head_dim 128, no attention bias.
        return Qwen3Config(
            **common,
            head_dim=llm.get("head_dim") or 128,
            attention_bias=bool(llm.get("attention_bias", False)),
            rms_norm_eps=llm.get("rms_norm_eps", 1e-6),
            rope_parameters={"rope_type": "default", "rope_theta": float(llm.get("rope_theta", 10000.0))},
            use_sliding_window=False,
        )
    # Qwen2: q/k/v always carry a bias in transformers' Qwen2 (as upstream), o_proj none.
    return Qwen2Config(
        **common,
        rms_norm_eps=llm.get("rms_norm_eps", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": float(llm.get("rope_theta", 10000.0))},
        use_sliding_window=False,
    )


def hf_vision_config(config: dict):
    from transformers import InternVLVisionConfig

    v = config["vision_config"]
    if v.get("norm_type", "layer_norm") != "layer_norm":
        raise CheckpointError(f"config.json: vision norm_type {v.get('norm_type')!r} has no reference here")
    return InternVLVisionConfig(
        hidden_size=v["hidden_size"],
        num_hidden_layers=v["num_hidden_layers"],
        num_attention_heads=v["num_attention_heads"],
        intermediate_size=v["intermediate_size"],
        hidden_act=v.get("hidden_act", "gelu"),
        layer_norm_eps=v.get("layer_norm_eps", 1e-6),
        image_size=v.get("image_size", 448),
        patch_size=v.get("patch_size", 14),
        attention_bias=bool(v.get("qkv_bias", True)),
        use_qk_norm=bool(v.get("qk_normalization", False)),
        norm_type="layer_norm",
        # use_mean_pooling=True makes transformers' final `layernorm` an Identity: InternViT has no
        # final norm, the projector takes the last block's output as is.
        use_mean_pooling=True,
        use_absolute_position_embeddings=True,
        hidden_dropout_prob=0.0,
        attention_dropout=0.0,
        projection_dropout=0.0,
        attn_implementation="eager",
    )


def hf_internvl_config(config: dict, image_token_id: int):
    from transformers import InternVLConfig

    if config.get("ps_version", "v2") != "v2":
        raise CheckpointError("config.json: transformers' InternVL implements pixel shuffle ps_version v2 only")
    ratio = config.get("downsample_ratio", 0.5)
    v = config["vision_config"]
    tile = config.get("force_image_size") or v.get("image_size", 448)
    tokens_per_tile = int(tile // v.get("patch_size", 14) * ratio) ** 2
    text = hf_text_config(config)
    select_layer = config.get("select_layer", -1)
    return InternVLConfig(
        text_config=text,
        vision_config=hf_vision_config(config),
        image_token_id=image_token_id,
        image_seq_length=tokens_per_tile,
        downsample_ratio=ratio,
        projector_hidden_act="gelu",          # mlp1's nn.GELU() (exact erf form)
        vision_feature_layer=select_layer,    # -1: last hidden state
        vision_feature_select_strategy="default",  # drops the CLS token, as upstream's [:, 1:]
        tie_word_embeddings=text.tie_word_embeddings,
        attn_implementation="eager",
    )


# ----------------------------------------------------------------------------------------------
# Weights: upstream names -> transformers names
# ----------------------------------------------------------------------------------------------

def unpack_internlm2_wqkv(wqkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """InternLM2's packed `wqkv` [(H + 2K) * D, ...] -> (q [H*D, ...], k [K*D, ...], v [K*D, ...]).

    Rows are grouped per KV head h as [q_(g*h), ..., q_(g*h+g-1), k_h, v_h] with g = H / K query
    heads sharing that KV head (16/8 heads: [q_2h, q_2h+1, k_h, v_h]), each block head_dim rows.
    Works for weights ([rows, in]) and biases ([rows]).
    """
    groups = num_heads // num_kv_heads
    if wqkv.shape[0] != (num_heads + 2 * num_kv_heads) * head_dim:
        raise CheckpointError(
            f"wqkv has {wqkv.shape[0]} rows, expected (heads {num_heads} + 2 * kv {num_kv_heads}) * {head_dim}"
        )
    tail = wqkv.shape[1:]
    blocks = wqkv.reshape(num_kv_heads, groups + 2, head_dim, *tail)
    q = blocks[:, :groups].reshape(num_heads * head_dim, *tail)
    k = blocks[:, groups].reshape(num_kv_heads * head_dim, *tail)
    v = blocks[:, groups + 1].reshape(num_kv_heads * head_dim, *tail)
    return q.contiguous(), k.contiguous(), v.contiguous()


def convert_language_weights(config: dict, state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """`language_model.*` -> {`{prefix}embed_tokens...`, ..., `lm_head.weight`} in Llama/Qwen2 names.

    `prefix` is where the bare decoder lives: "model." for LlamaForCausalLM, "model.language_model."
    for InternVLForConditionalGeneration. The LM head is always returned as "lm_head.weight".
    """
    llm = config["llm_config"]
    arch = _llm_architecture(config)
    heads = llm["num_attention_heads"]
    kv_heads = llm.get("num_key_value_heads") or heads
    head_dim = llm["hidden_size"] // heads
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not name.startswith("language_model."):
            continue
        name = name[len("language_model."):]
        if arch == "InternLM2ForCausalLM":
            if name == "output.weight":
                out["lm_head.weight"] = tensor
                continue
            name = name.removeprefix("model.")
            if ".attention.wqkv." in name:
                q, k, v = unpack_internlm2_wqkv(tensor, heads, kv_heads, head_dim)
                base, kind = name.split(".attention.wqkv.")
                out[f"{prefix}{base}.self_attn.q_proj.{kind}"] = q
                out[f"{prefix}{base}.self_attn.k_proj.{kind}"] = k
                out[f"{prefix}{base}.self_attn.v_proj.{kind}"] = v
                continue
            for old, new in (
                ("tok_embeddings", "embed_tokens"),
                ("attention.wo", "self_attn.o_proj"),
                ("feed_forward.w1", "mlp.gate_proj"),
                ("feed_forward.w2", "mlp.down_proj"),
                ("feed_forward.w3", "mlp.up_proj"),
                ("attention_norm", "input_layernorm"),
                ("ffn_norm", "post_attention_layernorm"),
            ):
                name = name.replace(old, new)
            out[prefix + name] = tensor
        else:  # Qwen2 / Qwen3: upstream names are already transformers' names
            if name == "lm_head.weight":
                out["lm_head.weight"] = tensor
            else:
                out[prefix + name.removeprefix("model.")] = tensor
    if "lm_head.weight" not in out and llm.get("tie_word_embeddings", False):
        out["lm_head.weight"] = out[f"{prefix}embed_tokens.weight"]
    return out


def convert_vision_weights(config: dict, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`vision_model.*` and `mlp1.*` -> InternVLModel's `vision_tower.*` / `multi_modal_projector.*`."""
    dim = config["vision_config"]["hidden_size"]
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.startswith("mlp1."):
            idx, kind = name[len("mlp1."):].split(".", 1)
            part = {"0": "layer_norm", "1": "linear_1", "3": "linear_2"}[idx]
            out[f"multi_modal_projector.{part}.{kind}"] = tensor
            continue
        if not name.startswith("vision_model."):
            continue
        new = "vision_tower." + name[len("vision_model."):]
        new = new.replace("encoder.layers.", "encoder.layer.")
        new = new.replace("embeddings.class_embedding", "embeddings.cls_token")
        new = new.replace("embeddings.position_embedding", "embeddings.position_embeddings")
        new = new.replace("embeddings.patch_embedding", "embeddings.patch_embeddings.projection")
        if ".attn.qkv." in new:
            # Upstream reshapes qkv output to (3, heads, head_dim): rows are [q | k | v] blocks.
            base, kind = new.split(".attn.qkv.")
            for i, part in enumerate(("q_proj", "k_proj", "v_proj")):
                out[f"{base}.attention.{part}.{kind}"] = tensor[i * dim:(i + 1) * dim]
            continue
        new = new.replace(".attn.proj.", ".attention.projection_layer.")
        new = new.replace(".norm1.", ".layernorm_before.").replace(".norm2.", ".layernorm_after.")
        if new.endswith(".ls1") or new.endswith(".ls2"):
            new = new[:-3] + "lambda_" + new[-1]
        out[new] = tensor
    return out


def _load_exact(model: torch.nn.Module, weights: dict[str, torch.Tensor], what: str) -> None:
    expected = model.state_dict()
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        raise CheckpointError(
            f"{what}: converted weights do not fit transformers' model "
            f"(missing {missing[:3]}{'...' if len(missing) > 3 else ''}, "
            f"unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''})"
        )
    for name, tensor in weights.items():
        if tuple(expected[name].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{what}: tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"transformers expects {tuple(expected[name].shape)}")
    model.load_state_dict({k: v.to(torch.float32) for k, v in weights.items()}, strict=True)


# ----------------------------------------------------------------------------------------------
# Building the references
# ----------------------------------------------------------------------------------------------

def build_hf_internvl(config: dict, state: dict[str, torch.Tensor], image_token_id: int | None = None):
    """transformers.InternVLForConditionalGeneration with the checkpoint's weights: fp32, eager
    attention, eval mode. `image_token_id` is the `<IMG_CONTEXT>` id (see find_image_token_id)."""
    from transformers import InternVLForConditionalGeneration

    if image_token_id is None:
        image_token_id = DEFAULT_IMAGE_TOKEN_ID[_llm_architecture(config)]
    hf_config = hf_internvl_config(config, image_token_id)
    model = InternVLForConditionalGeneration(hf_config)
    weights = {f"model.{k}": v for k, v in convert_vision_weights(config, state).items()}
    weights.update(convert_language_weights(config, state, prefix="model.language_model."))
    _load_exact(model, weights, "InternVLForConditionalGeneration")
    _plain_greedy_defaults(model)
    return model.float().eval()


def build_hf_text_model(config: dict, state: dict[str, torch.Tensor]):
    """Bare LlamaForCausalLM (InternLM2, `wqkv` un-packed), Qwen2ForCausalLM or Qwen3ForCausalLM: fp32, eager, eval."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    text_config = hf_text_config(config)
    cls = {"InternLM2ForCausalLM": LlamaForCausalLM, "Qwen2ForCausalLM": Qwen2ForCausalLM,
           "Qwen3ForCausalLM": Qwen3ForCausalLM}[_llm_architecture(config)]
    model = cls(text_config)
    _load_exact(model, convert_language_weights(config, state, prefix="model."), cls.__name__)
    _plain_greedy_defaults(model)
    return model.float().eval()


def load_hf_reference(model_dir: str | Path):
    """Folder -> InternVLForConditionalGeneration with the folder's own `<IMG_CONTEXT>` id."""
    config, state = load_upstream_state_dict(model_dir)
    return build_hf_internvl(config, state, find_image_token_id(model_dir, config))


def _plain_greedy_defaults(model) -> None:
    # LlamaConfig's class defaults (bos 1, eos 2) would otherwise leak into generate(); the
    # caller of hf_generate states the stop token explicitly.
    gc = model.generation_config
    gc.do_sample, gc.num_beams = False, 1
    gc.temperature = gc.top_p = gc.top_k = None
    gc.eos_token_id = None
    gc.bos_token_id = None


@torch.inference_mode()
def hf_generate(
    hf_model,
    input_ids: torch.Tensor,
    pixel_values: torch.Tensor | None,
    max_new_tokens: int,
    eos_token_id: int | list[int] | None = None,
) -> list[int]:
    """Plain greedy `generate` (no sampling, one beam, transformers' own KV cache). input_ids
    [1, T] (with one `<IMG_CONTEXT>` per visual token where pixel_values is given), pixel_values
    [tiles, 3, S, S] or None. Returns the new token ids (stopping after eos_token_id if given)."""
    from transformers import GenerationConfig

    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    gen = GenerationConfig(
        do_sample=False,
        num_beams=1,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id if isinstance(eos_token_id, int) else 0,
    )
    kwargs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "generation_config": gen}
    if pixel_values is not None:
        kwargs["pixel_values"] = pixel_values.to(hf_model.dtype)
    out = hf_model.generate(**kwargs)
    return out[0, input_ids.shape[1]:].tolist()
