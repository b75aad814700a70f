"""The same weights for every engine: the model folder this project runs, and its "peer form",
the same weights in the one InternVL layout every peer's converter reads.

- `study_checkpoint(preset)`: random weights of a preset's shape (weights/random_init.py, the one
  initialisation) in OpenGVLab's layout, e.g. `internvl3-2b`: InternViT-300M (24 layers, 448 px),
  Qwen2.5-1.5B (28 layers) with upstream's vocabulary size (151,674 rows of embedding and tied head),
  tokenized by the bundled model's byte-level BPE (the ids a prompt uses are the same rows
  whatever the vocabulary's size; every row is scored by the head), one tile per camera, the
  bundled model's view selector (text-only, its own tokenizer: the question picks the cameras).
- `peer_form(folder)`: the folder as the peers' converters take it. A Qwen2 (InternVL3) folder
  whose tile is the position embedding's size is used as it is. Otherwise a copy, computing the
  same function, is written once: an InternLM2 decoder as Qwen2 (InternLM2 is Llama with a packed
  `wqkv`; Qwen2 is Llama with q/k/v biases, here zero), because llama.cpp's InternLM2 converter
  reads only a sentencepiece `tokenizer.model` and this project's models carry a byte-level BPE
  `tokenizer.json`; a position embedding stored for another tile size (the bundled model's, 140 px
  for 224 px tiles) interpolated once, as the project does at load (bicubic, float32), so that a
  peer that reads `vision_config.image_size` as the tile size sees the tile the project runs.
  `tests/bench/test_peers_whole.py` checks that this project answers identically from both forms.

Both carry `max_dynamic_patch: 1` (one tile per camera for every engine: llama.cpp's converter
writes it as the mmproj's max tiles; upstream's InternVL reads it) and the image processor's
`preprocessor_config.json` that upstream's folders ship and the converters read (this project's
preprocessing: ImageNet mean and std, bicubic resize to the tile; stages/preprocess.py).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import torch

from ...bundled import __file__ as _bundled_init
from ...models.config import LLMConfig
from ...models.internvl import InternVL
from ...stages.preprocess import IMAGENET_MEAN, IMAGENET_STD
from ...weights.checkpoint import load_model, read_config, write_checkpoint
from ...weights.integrity import write_manifest
from ...weights.presets import UPSTREAM_VOCAB, preset
from ...weights.random_init import init_weights
from ...weights.tokenizer import Tokenizer

BUNDLED = Path(_bundled_init).parent / "synthdrive-internvl2_5-v2"
PREPROCESSOR_FILE = "preprocessor_config.json"
# Shards of at most 2 GiB: safetensors copies a file's tensors to bytes while it writes, so a 7 GB
# float32 model written as one file needs twice its size in memory.
SHARD_BYTES = 2 << 30
ONE_TILE = {"dynamic_image_size": False, "use_thumbnail": False, "min_dynamic_patch": 1, "max_dynamic_patch": 1}


def one_tile(folder: Path) -> None:
    """config.json: one tile per camera, for every engine that reads the config's tiling; and the
    image processor's configuration as upstream InternVL folders write it (CLIP's processor keys:
    resample 3 = bicubic)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(ONE_TILE)
    path.write_text(json.dumps(config, indent=2) + "\n")
    tile = read_config(folder).force_image_size
    (folder / PREPROCESSOR_FILE).write_text(json.dumps({
        "crop_size": tile, "do_center_crop": True, "do_normalize": True, "do_resize": True,
        "feature_extractor_type": "CLIPFeatureExtractor", "image_mean": list(IMAGENET_MEAN),
        "image_std": list(IMAGENET_STD), "resample": 3, "size": tile}, indent=2) + "\n")


def study_checkpoint(out: Path, preset_name: str, seed: int = 0, progress=print) -> Path:
    """A random-weight checkpoint of `preset_name`'s shape in OpenGVLab's layout (see the module)."""
    out = Path(out)
    if (out / "litevlm_manifest.json").is_file():
        return out
    tok_file = BUNDLED / "tokenizer.json"

    vocab = UPSTREAM_VOCAB.get(preset_name, Tokenizer(BUNDLED).vocab_size)
    progress(f"writing {preset_name} (random weights, seed {seed}, vocabulary {vocab}) -> {out}")
    model = InternVL(preset(preset_name, vocab_size=vocab))
    init_weights(model, seed)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(tmp, model, tok_file, shard_bytes=SHARD_BYTES)
    del model
    one_tile(tmp)
    shutil.copytree(BUNDLED / "view_selector", tmp / "view_selector")
    (tmp / "litevlm.json").write_text((BUNDLED / "litevlm.json").read_text())
    write_manifest(tmp)
    tmp.rename(out)
    return out


def needs_rewrite(folder: Path) -> list[str]:
    """Why `folder` is not what the peers' converters read as it is (empty: it is)."""
    cfg = read_config(folder)
    why = []
    if cfg.llm.architecture == "internlm2":
        why.append("InternLM2 decoder (llama.cpp's InternLM2 converter needs a sentencepiece tokenizer.model)")
    if cfg.vision.image_size != cfg.force_image_size:
        why.append(f"position embedding stored for {cfg.vision.image_size} px, tiles are {cfg.force_image_size} px")
    config = json.loads((folder / "config.json").read_text())
    if any(config.get(k) != v for k, v in ONE_TILE.items()) or not (folder / PREPROCESSOR_FILE).is_file():
        why.append(f"no {PREPROCESSOR_FILE} / tiling keys (max_dynamic_patch) not set to one tile")
    return why


def peer_form(folder: Path, out: Path, progress=print) -> Path:
    """`folder` itself when its peers read it as it is, else the copy in `out` (written once)."""
    folder, out = Path(folder), Path(out)
    why = needs_rewrite(folder)
    if not why:
        return folder
    if (out / "litevlm_manifest.json").is_file():
        return out
    progress(f"writing the peer form of {folder} -> {out}: " + "; ".join(why))
    model = load_model(folder)
    cfg = model.cfg
    tile = cfg.force_image_size
    grid = tile // cfg.vision.patch_size
    pos = model.vision_model.embeddings.position_embedding_for(grid, grid).detach().float()
    llm = cfg.llm
    if llm.architecture == "internlm2":
        llm = LLMConfig(architecture="qwen2", hidden_size=llm.hidden_size, intermediate_size=llm.intermediate_size,
                        num_attention_heads=llm.num_attention_heads, num_key_value_heads=llm.num_key_value_heads,
                        num_hidden_layers=llm.num_hidden_layers, rms_norm_eps=llm.rms_norm_eps,
                        rope_theta=llm.rope_theta, vocab_size=llm.vocab_size,
                        max_position_embeddings=llm.max_position_embeddings, tie_word_embeddings=False,
                        rope_scaling=llm.rope_scaling)

    new_cfg = replace(cfg, vision=replace(cfg.vision, image_size=tile), llm=llm)
    with torch.device("meta"):
        target = InternVL(new_cfg)
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("language_model.")}
    state["vision_model.embeddings.position_embedding"] = pos
    state.update(qwen2_state(model.language_model) if cfg.llm.architecture == "internlm2"
                 else {f"language_model.{k}": v for k, v in model.language_model.state_dict().items()})
    target.load_state_dict(state, strict=True, assign=True)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_checkpoint(tmp, target, folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None,
                     shard_bytes=SHARD_BYTES)
    for name in ("tokenizer_config.json", "generation_config.json", "litevlm.json"):
        if (folder / name).is_file():
            shutil.copy(folder / name, tmp / name)
    one_tile(tmp)
    write_manifest(tmp)
    tmp.rename(out)
    return out


def qwen2_state(lm) -> dict[str, torch.Tensor]:
    """An InternLM2 decoder's weights under Qwen2's names: `wqkv` (rows grouped per KV head as
    [q x group, k, v], internlm2.py) split into q/k/v with zero biases, w1/w3/w2 -> gate/up/down."""
    cfg = lm.cfg
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = hq // hkv
    out = {"language_model.model.embed_tokens.weight": lm.model.tok_embeddings.weight,
           "language_model.model.norm.weight": lm.model.norm.weight,
           "language_model.lm_head.weight": lm.output.weight}
    for i, layer in enumerate(lm.model.layers):
        p = f"language_model.model.layers.{i}."
        packed = layer.attention.wqkv.weight.view(hkv, group + 2, d, -1)
        q, k, v = packed[:, :group].reshape(hq * d, -1), packed[:, group].reshape(hkv * d, -1), packed[:, group + 1]
        out.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.q_proj.bias": torch.zeros(hq * d),
            p + "self_attn.k_proj.weight": k, p + "self_attn.k_proj.bias": torch.zeros(hkv * d),
            p + "self_attn.v_proj.weight": v.reshape(hkv * d, -1), p + "self_attn.v_proj.bias": torch.zeros(hkv * d),
            p + "self_attn.o_proj.weight": layer.attention.wo.weight,
            p + "mlp.gate_proj.weight": layer.feed_forward.w1.weight,
            p + "mlp.up_proj.weight": layer.feed_forward.w3.weight,
            p + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
            p + "input_layernorm.weight": layer.attention_norm.weight,
            p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
        })
    return out
