"""Model surgery before training: a new tile size (the position embedding interpolated from the
checkpoint's grid) and a deeper decoder grown from a shallower one (new layers start as identities)."""

from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import InputError
from ..models.internvl import InternVL
from ..weights.random_init import init_weights


def with_tile_size(cfg, tile: int, keep_position_grid: bool):
    """The config with another tile size (`--tile-size`). Continuing from a checkpoint
    (keep_position_grid), the vision tower keeps its stored position-embedding grid and the model
    interpolates it to the new patch grid (bicubic, as InternViT does for any tile size it was not
    trained at): fine-tuning at a higher resolution starts from the lower-resolution weights."""
    patch = cfg.vision.patch_size
    side = tile // patch
    if tile % patch or side * cfg.downsample_ratio != int(side * cfg.downsample_ratio):
        raise InputError(f"--tile-size {tile}: must be a multiple of {int(patch / cfg.downsample_ratio)} "
                         f"(patch {patch}, pixel shuffle {cfg.downsample_ratio})")
    vision = cfg.vision if keep_position_grid else replace(cfg.vision, image_size=tile)
    return replace(cfg, vision=vision, force_image_size=tile)


def with_decoder_layers(cfg, layers: int):
    """The config with another decoder depth (`--decoder-layers`)."""
    if layers < 1:
        raise InputError(f"--decoder-layers {layers}: at least 1")
    return replace(cfg, llm=replace(cfg.llm, num_hidden_layers=layers))


def grown_layer_positions(old: int, new: int) -> list[int]:
    """Where the `old` trained layers go in a stack of `new`: spread out, the first one first, the
    new layers between and after them (3 -> 12: 0, 4, 8)."""
    return [i * new // old for i in range(old)]


def grow_decoder(model: InternVL, layers: int, seed: int) -> InternVL:
    """The same model with `layers` decoder layers: the trained layers keep their order, and new
    layers are interleaved after them that start as exact identities, so the grown model computes
    the same logits as the original before any training.

    Each new layer's residual branches end in zeroed output projections (attention `wo`,
    feed-forward `w2`; Qwen2's `o_proj`, `down_proj`), the rest is freshly initialised like a
    from-scratch layer. Why these choices:
    - zero out-projections (as LLaMA Pro's block expansion and zero-init residual branches do):
      the residual stream passes through unchanged, and the out-projections still get gradients
      (their inputs are non-zero), so the layer leaves the identity at the first step;
    - fresh inner weights rather than copies of a neighbour: several new layers follow each
      trained one, and copies of one layer would receive near-identical updates for a long time;
    - interleaved rather than appended: every depth of the residual stream gets new capacity
      (LLaMA Pro found interleaving better than stacking on top), and layer 0 stays layer 0, the
      layer the token selector is a copy of."""
    old = model.cfg.llm.num_hidden_layers
    if layers < old:
        raise InputError(f"--decoder-layers {layers}: the --init model has {old} decoder layers; "
                         "growing adds layers, it cannot remove trained ones")
    if layers == old:
        return model
    rope = getattr(model.language_model, "rope", None)      # the source's RoPE table size, if it has one
    grown = InternVL(with_decoder_layers(model.cfg, layers), max_len=None if rope is None else rope.cos.shape[0]) \
        .to(next(model.parameters()).dtype)
    init_weights(grown, seed)
    src, dst = model.language_model, grown.language_model
    keep = grown_layer_positions(old, layers)
    stack = next(name for name, m in model.named_modules() if m is src.layers) + "."
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if not name.startswith(stack):          # vision tower, projector, embeddings, norm, head
                grown.state_dict()[name].copy_(t)
        for i, j in enumerate(keep):
            dst.layers[j].load_state_dict(src.layers[i].state_dict())
        for j in set(range(layers)) - set(keep):
            dst.layers[j].out_proj.weight.zero_()
            dst.layers[j].mlp_gate_up_down()[2].weight.zero_()
    return grown.train(model.training)
