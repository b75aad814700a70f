"""A memory plan for the car (`litevlm bench --memory`): what InternVL2.5-2B and InternVL3-2B take at
the paper's rig (6 cameras x 2 tiles = 12 tiles of 448 px) on DRIVE Thor, per weight and KV format,
against the paper's Thor figures and against what a 64 GB Thor leaves after the rest of the driving
stack.

Every figure is computed, nothing is measured on a GPU (none was available):
  weights    parameter counts of the model built on the meta device (the preset's exact shapes),
             times bytes per element of each format as TensorRT stores them (below)
  arena      the runtime's own Arena (pipeline/arena.py) built on the meta device for these
             options: every buffer a query touches, the KV regions first. A KV region holds
             `max_len` rows (12 x 256 visual tokens + the text of serving.max_turns turns + the
             answer + EAGLE-2's tree scratch); serving.max_batch regions decode a batch,
             serving.conversations more keep answered turns for follow-ups, one holds the prompt prefix
  workspace  TensorRT's activation memory, estimated as the largest live intermediates of the
             largest bucket of each stage (FP16: a stage's input and output, plus its biggest
             temporaries: the ViT's MLP at 12 x 1025 tokens, a prompt's gate/up at the longest
             prompt, the LM head's logits), one pool shared by every engine (contexts run one at a
             time on one stream, as the CUDA-graph backend shares one pool)

Formats: FP16 every weight 2 B. FP8: the decoder layers' linears 1 B (per-channel scales: 4 B per
output channel), embedding, LM head and norms FP16; the vision encoder FP16 (the anchors' choice,
"ViT FP16") or FP8 ("+ FP8 ViT"). INT4 AWQ (ModelOpt / TensorRT's weight-only INT4, block 128):
decoder linears 0.5 B + a float16 scale per 128 weights + a float32 AWQ input scale per input
channel; embedding, LM head, norms and the ViT FP16. KV: FP16 2 B per element; FP8 1 B per element
plus a float16 scale per head and row (models/kv_cache.py: (head_dim + 2) / head_dim bytes).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..bundled import DEFAULT_MODEL
from ..models.internvl import InternVL
from ..options import options_from_flat
from ..pipeline.arena import Arena
from ..pipeline.runtime import arena_limits
from ..stages.prompt import resolve_layout
from ..weights.presets import preset as preset_config
from ..weights.tokenizer import Tokenizer

MIB, GIB = 1 << 20, 1 << 30
THOR_GIB = 64
# Paper (LiteVLM on DRIVE Thor): FP16 ViT engine 589 MiB, 1.8B decoder 3.62 GiB, KV cache 864 MiB;
# the Thor table also lists 252 MiB. Both KV figures are a 9,216-row FP16 cache:
# 864 MiB = 9216 x 96 KiB/row (InternLM2-1.8B: 24 layers x 8 KV heads x 128 x K,V x 2 B) and
# 252 MiB = 9216 x 28 KiB/row (Qwen2.5-1.5B of InternVL3-2B: 28 x 2 x 128 x 2 x 2 B).
PAPER_KV_MIB = {"internvl2_5-2b": 864, "internvl3-2b": 252}
PAPER_ROWS = 9216
PRESETS = ("internvl2_5-2b", "internvl3-2b")


@dataclass
class Parts:
    vit_linear: int           # parameters of the ViT's + projector's linears
    vit_other: int            # the rest of the vision stage (embeddings, norms, layer scales)
    llm_linear: int           # decoder layers' linears
    embed: int
    head: int                 # 0 when tied to the embedding
    llm_other: int            # norms
    llm_in: list              # input channels of each decoder linear (the AWQ scales)
    llm_out: list             # output channels (FP8 per-channel scales)


def parts_of(model: nn.Module) -> Parts:
    lm = model.language_model
    count = lambda ms: sum(p.numel() for m in ms for p in m.parameters())  # noqa: E731
    vis_lin = [m for m in list(model.vision_model.modules()) + list(model.mlp1.modules()) if isinstance(m, nn.Linear)]
    llm_lin = [m for m in lm.layers.modules() if isinstance(m, nn.Linear)]
    vision_total = count([model.vision_model, model.mlp1])
    head = 0 if lm.cfg.tie_word_embeddings else lm.head.weight.numel()
    llm_total = count([lm])
    return Parts(count(vis_lin), vision_total - count(vis_lin), count(llm_lin), lm.embed.weight.numel(), head,
                 llm_total - count(llm_lin) - lm.embed.weight.numel() - head,
                 [m.in_features for m in llm_lin], [m.out_features for m in llm_lin])


def weight_bytes(p: Parts, fmt: str) -> dict[str, float]:
    """Bytes of the vision stage and of the decoder (embedding and head included) in `fmt`."""
    fp16 = 2
    vision = (p.vit_linear + p.vit_other) * fp16
    rest = (p.embed + p.head + p.llm_other) * fp16
    if fmt == "fp16":
        llm = p.llm_linear * fp16
    elif fmt.startswith("fp8"):
        llm = p.llm_linear + 4 * sum(p.llm_out)
        if fmt == "fp8+vit":
            vision = p.vit_linear + p.vit_other * fp16
    elif fmt == "int4":
        llm = p.llm_linear / 2 + p.llm_linear / 128 * 2 + 4 * sum(p.llm_in)
    else:
        raise ValueError(fmt)
    return {"vision": vision, "decoder": llm + rest}


def car_options(preset: str, tiles_per_camera: int = 2, max_batch: int = 4, conversations: int = 4):
    return options_from_flat({"tiles_per_camera": tiles_per_camera, "dtype": "float16", "decoding.mode": "eagle",
                              "serving.max_batch": max_batch, "serving.conversations": conversations})


def arena_on_meta(cfg, options, kv_dtype: str):
    """The runtime's Arena for `options` on the meta device (sizes only, no memory)."""
    tok = Tokenizer(DEFAULT_MODEL)
    layout = resolve_layout(None, DEFAULT_MODEL)[0]
    limits = replace(arena_limits(cfg, tok, options, layout), kv_dtype=kv_dtype)
    return Arena(cfg, limits, torch.float16, torch.device("meta"))


def meta_nbytes(arena, names) -> int:
    """Bytes of the arena's buffers named (prefixes), on the meta device (no storage to dedupe:
    views are skipped by name: k_cache/v_cache are region 0)."""
    total = 0
    for name, t in arena.buffers().items():
        if name.startswith(("k_cache", "v_cache")):
            continue
        if names is None or name.startswith(tuple(names)):
            total += t.numel() * t.element_size()
    return total


def workspace_bytes(cfg, arena) -> int:
    """TensorRT activation memory, estimated (module docstring): the largest stage's live FP16 tensors."""
    v, llm = cfg.vision, cfg.llm
    tiles = arena.limits.max_tiles()
    tokens = tiles * (1 + (cfg.force_image_size // v.patch_size) ** 2)
    vit = tokens * (2 * v.hidden_size + v.intermediate_size + 3 * v.hidden_size) * 2
    rows = arena.max_prompt
    prefill = rows * (2 * llm.hidden_size + 2 * llm.intermediate_size
                      + (llm.num_attention_heads + 2 * llm.num_key_value_heads) * llm.head_dim) * 2
    head = arena.limits.tree_tokens * llm.vocab_size * 2
    return max(vit, prefill, head)


def memory_rows(preset: str, reserved_gib: float, **car) -> list[dict]:
    """One row per (weights format, KV format) for a preset at the car's options."""
    cfg = preset_config(preset)
    with torch.device("meta"):
        model = InternVL(cfg)
    parts = parts_of(model)
    options = car_options(preset, **car)
    rows = []
    for kv in ("float", "fp8"):
        arena = arena_on_meta(cfg, options, kv)
        a = arena.limits
        region = meta_nbytes(arena, ("k_regions", "v_regions")) / max(1, a.batch)
        turns = meta_nbytes(arena, ("k_turns", "v_turns"))
        kv_all = meta_nbytes(arena, arena.KV_BUFFERS)
        whole = meta_nbytes(arena, None)
        llm = cfg.llm
        per_row = 2 * llm.num_hidden_layers * llm.num_key_value_heads * llm.head_dim * (
            2 if kv == "float" else (llm.head_dim + 2) / llm.head_dim)
        work = workspace_bytes(cfg, arena)
        for fmt in ("fp16", "fp8", "fp8+vit", "int4"):
            w = weight_bytes(parts, fmt)
            total = w["vision"] + w["decoder"] + work + whole
            rows.append({"model": preset, "weights": fmt, "kv": "fp16" if kv == "float" else "fp8",
                         "vision_mib": w["vision"] / MIB, "decoder_gib": w["decoder"] / GIB,
                         "workspace_mib": work / MIB, "max_len": arena.max_len,
                         "kv_region_mib": region / MIB, "kv_turn_mib": turns / max(1, a.conversations) / MIB,
                         "kv_paper_rows_mib": PAPER_ROWS * per_row / MIB, "paper_kv_mib": PAPER_KV_MIB.get(preset),
                         "batch": a.batch, "conversations": a.conversations, "kv_all_mib": kv_all / MIB,
                         "arena_mib": whole / MIB, "total_gib": total / GIB,
                         "left_gib": THOR_GIB - reserved_gib - total / GIB})
    return rows


MEMORY_HEADER = ["model", "weights", "KV", "ViT MiB", "decoder GiB", "workspace MiB (est.)", "KV / batch region MiB",
                 "KV / conversation MiB", "KV at 9,216 rows MiB (paper)", "arena MiB (all KV + buffers)", "total GiB",
                 "left of the VLM's share GiB"]


def memory_table_rows(rows: list[dict]) -> list[list]:
    label = {"fp16": "FP16", "fp8": "FP8 (ViT FP16)", "fp8+vit": "FP8 + FP8 ViT", "int4": "INT4 AWQ (ViT FP16)"}
    out = []
    for r in rows:
        paper = f"{r['kv_paper_rows_mib']:.0f}" + (f" ({r['paper_kv_mib']})" if r["paper_kv_mib"] else "")
        out.append([r["model"], label[r["weights"]], r["kv"].upper(), f"{r['vision_mib']:.0f}",
                    f"{r['decoder_gib']:.2f}", f"{r['workspace_mib']:.0f}", f"{r['kv_region_mib']:.0f}",
                    f"{r['kv_turn_mib']:.0f}", paper, f"{r['arena_mib']:.0f}", f"{r['total_gib']:.2f}",
                    f"{r['left_gib']:.1f}"])
    return out
