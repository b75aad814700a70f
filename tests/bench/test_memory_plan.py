"""The car's memory plan (`litevlm bench --memory`, bench/memory.py) against sizes recomputed here
from the presets' shapes alone: an FP16 KV row is layers x KV heads x head_dim x (K, V) x 2 bytes,
an FP8 one (head_dim + 2) / (2 head_dim) of that (one float16 scale per head and row); 9,216 FP16
rows reproduce the paper's Thor KV figures (864 MiB InternLM2-1.8B, 252 MiB Qwen2.5-1.5B); FP16
weights are 2 bytes per parameter. Exact (integer byte counts), no tolerance."""

from __future__ import annotations

import pytest
import torch

from litevlm_runtime.bench.memory import GIB, MIB, PAPER_KV_MIB, PRESETS, memory_rows


@pytest.fixture(scope="module", params=PRESETS)
def plan(request):
    from litevlm_runtime.models.internvl import InternVL
    from litevlm_runtime.weights.presets import preset

    cfg = preset(request.param)
    with torch.device("meta"):
        params = sum(p.numel() for p in InternVL(cfg).parameters())
    return cfg, params, {(r["weights"], r["kv"]): r for r in memory_rows(request.param, reserved_gib=40.0)}


def test_kv_bytes_recomputed_from_the_shapes(plan):
    cfg, _, rows = plan
    llm = cfg.llm
    fp16_row = llm.num_hidden_layers * llm.num_key_value_heads * llm.head_dim * 2 * 2
    r16, r8 = rows[("fp16", "fp16")], rows[("fp16", "fp8")]
    assert r16["kv_region_mib"] * MIB == r16["max_len"] * fp16_row
    assert r8["kv_region_mib"] * MIB == r8["max_len"] * fp16_row * (llm.head_dim + 2) / (2 * llm.head_dim)
    assert r16["kv_turn_mib"] == r16["kv_region_mib"]                       # a turn keeps a whole region
    assert r16["batch"] == 4 and r16["conversations"] == 4 and r16["max_len"] >= 12 * 256
    assert round(r16["kv_paper_rows_mib"]) == r16["paper_kv_mib"] == PAPER_KV_MIB[r16["model"]]
    assert r8["arena_mib"] < r16["arena_mib"]


def test_weight_bytes(plan):
    _, params, rows = plan
    fp16 = rows[("fp16", "fp16")]
    assert (fp16["vision_mib"] * MIB + fp16["decoder_gib"] * GIB) == pytest.approx(2 * params, rel=1e-12)
    order = [rows[(w, "fp16")]["decoder_gib"] for w in ("fp16", "fp8", "int4")]
    assert order == sorted(order, reverse=True)
    assert rows[("fp8+vit", "fp16")]["vision_mib"] < rows[("fp8", "fp16")]["vision_mib"] == fp16["vision_mib"]
    for r in rows.values():
        assert r["left_gib"] == pytest.approx(64 - 40 - r["total_gib"])
