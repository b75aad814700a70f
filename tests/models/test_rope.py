"""RoPE tables under llm_config.rope_scaling (issue 13 item 3): linear scaling past
max_position_embeddings against a float64 recomputation and against each upstream's own float32
recipe; dynamic NTK is exactly the unscaled table up to the limit and refused past it."""

import json
import math
import shutil

import pytest
import torch
from helpers import random_frames

from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.models.config import LLMConfig, RopeScaling
from litevlm_runtime.models.rope import RotaryTable, apply_rope
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
from litevlm_runtime.weights.integrity import write_manifest

EPS32 = torch.finfo(torch.float32).eps
LIMIT = 64          # max_position_embeddings of these configs; the tables go 8x past it


def llm(arch="internlm2", scaling=None, theta=1e6):
    return LLMConfig(architecture=arch, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                     rope_theta=theta, max_position_embeddings=LIMIT, rope_scaling=scaling)


def float64_angles(cfg: LLMConfig, n: int, position_scale: float = 1.0, base: float | None = None) -> torch.Tensor:
    d = cfg.head_dim
    i = torch.arange(0, d, 2, dtype=torch.float64)
    inv = (base or cfg.rope_theta) ** (-i / d)
    ang = torch.outer(torch.arange(n, dtype=torch.float64) * position_scale, inv)
    return torch.cat([ang, ang], dim=-1)


def assert_close_to_float64(table: RotaryTable, angles: torch.Tensor) -> None:
    """float32 tables: the angle carries the rounding of theta ** (2i/d) and of the product, so the
    error grows with the angle: |error| <= 4 eps32 (|angle| + 1) (measured: at most 1.1 eps32 (|angle| + 1))."""
    bound = 4 * EPS32 * (angles.abs() + 1)
    assert ((table.cos.double() - angles.cos()).abs() <= bound).all()
    assert ((table.sin.double() - angles.sin()).abs() <= bound).all()


@pytest.mark.parametrize("arch", ["internlm2", "qwen2"])
@pytest.mark.parametrize("factor", [2.0, 1.5])
def test_linear_scaling_past_the_limit_matches_float64(arch, factor):
    cfg = llm(arch, RopeScaling("linear", factor))
    table = RotaryTable(cfg, 8 * LIMIT)
    assert_close_to_float64(table, float64_angles(cfg, 8 * LIMIT, position_scale=1 / factor))
    # and it is not the unscaled table (the key acts)
    plain = RotaryTable(llm(arch), 8 * LIMIT)
    assert (table.cos[LIMIT:] - plain.cos[LIMIT:]).abs().max() > 0.5


def test_internlm2_linear_matches_upstream_recipe_bit_for_bit():
    """modeling_internlm2.InternLM2LinearScalingRotaryEmbedding: t = arange(L).float() / factor;
    freqs = einsum('i,j->ij', t, inv_freq), inv_freq = 1 / base ** (arange(0, d, 2).float() / d)."""
    cfg = llm("internlm2", RopeScaling("linear", 1.5))
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2).float() / d))
    t = torch.arange(8 * LIMIT).to(dtype=inv_freq.dtype) / 1.5
    emb = torch.cat([torch.einsum("i,j->ij", t, inv_freq)] * 2, dim=-1)
    table = RotaryTable(cfg, 8 * LIMIT)
    assert torch.equal(table.cos, emb.cos()) and torch.equal(table.sin, emb.sin())


@pytest.mark.parametrize("scaling", [RopeScaling("linear", 1.5), RopeScaling("dynamic", 2.0), None])
def test_qwen2_matches_transformers_bit_for_bit(scaling):
    from transformers import Qwen2Config
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RotaryEmbedding

    cfg = llm("qwen2", scaling)
    params = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if scaling:
        params |= {"rope_type": scaling.type, "factor": scaling.factor}
    ref = Qwen2RotaryEmbedding(Qwen2Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                           max_position_embeddings=LIMIT, rope_parameters=params))
    n = LIMIT if scaling and scaling.type == "dynamic" else 8 * LIMIT
    cos, sin = ref(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    table = RotaryTable(cfg, n)
    assert torch.equal(table.cos, cos[0]) and torch.equal(table.sin, sin[0])


@pytest.mark.parametrize("arch", ["internlm2", "qwen2"])
def test_dynamic_ntk_is_unscaled_up_to_the_limit_and_refused_past_it(arch):
    cfg = llm(arch, RopeScaling("dynamic", 2.0))
    # Upstream's base at sequence length L is base * (factor * L / max_pos - (factor - 1)) ** (d / (d - 2))
    # once L > max_pos; at L = max_pos the bracket is exactly 1.
    d, f = cfg.head_dim, 2.0
    assert cfg.rope_theta * (f * LIMIT / LIMIT - (f - 1)) ** (d / (d - 2)) == cfg.rope_theta
    table = RotaryTable(cfg, LIMIT)
    plain = RotaryTable(llm(arch), LIMIT)
    assert torch.equal(table.cos, plain.cos) and torch.equal(table.sin, plain.sin)
    assert_close_to_float64(table, float64_angles(cfg, LIMIT))
    # Past the limit the base would be this (it differs), which a static table cannot follow per length.
    grown = cfg.rope_theta * (f * (LIMIT + 1) / LIMIT - (f - 1)) ** (d / (d - 2))
    assert not math.isclose(grown, cfg.rope_theta, rel_tol=1e-3)
    with pytest.raises(CheckpointError, match=r"llm_config.rope_scaling \{'type': 'dynamic', 'factor': 2.0\}: "
                                              r"a RoPE table of 65 positions exceeds "
                                              r"llm_config.max_position_embeddings 64"):
        RotaryTable(cfg, LIMIT + 1)


def with_rope(src, dst, max_pos=None, scaling=None):
    folder = shutil.copytree(src, dst)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["llm_config"]["rope_scaling"] = scaling
    if max_pos:
        cfg["llm_config"]["max_position_embeddings"] = max_pos
    (folder / "config.json").write_text(json.dumps(cfg))
    write_manifest(folder)
    return folder


def test_pipeline_refuses_an_arena_past_the_dynamic_limit_and_is_unchanged_within(tmp_path, tiny_model):
    opts = PipelineOptions(max_new_tokens=6)
    short = with_rope(tiny_model, tmp_path / "short", max_pos=64, scaling={"type": "dynamic", "factor": 2.0})
    with pytest.raises(CheckpointError, match=r"rope_scaling .*exceeds llm_config.max_position_embeddings 64"):
        Pipeline.from_pretrained(short, opts)
    dynamic = with_rope(tiny_model, tmp_path / "dynamic", scaling={"type": "dynamic", "factor": 2.0})
    frames = random_frames(1)
    q = "Is there a car behind the ego vehicle?"
    plain_pipe, dyn_pipe = Pipeline.from_pretrained(tiny_model, opts), Pipeline.from_pretrained(dynamic, opts)
    assert dyn_pipe.rt.arena.max_len <= 32768
    assert dyn_pipe.answer(frames, q).token_ids == plain_pipe.answer(frames, q).token_ids
    linear_pipe = Pipeline.from_pretrained(with_rope(tiny_model, tmp_path / "linear",
                                                     scaling={"type": "linear", "factor": 4.0}), opts)
    assert not torch.equal(linear_pipe.rt.lm.rope.cos, plain_pipe.rt.lm.rope.cos)
    assert linear_pipe.rt.lm.rope.cos.shape[0] == linear_pipe.rt.arena.max_len


def test_rope_equals_rotate_half_in_float64():
    """apply_rope (halves swapped by a concatenation, signed sin) against the textbook
    x*cos + rotate_half(x)*sin, rotate_half(x) = [-x2, x1], in float64: bit-equal in float64."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(70, 8, 32, generator=g, dtype=torch.float64)
    angle = torch.randn(70, 1, 16, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([angle.cos()] * 2, -1), torch.cat([angle.sin()] * 2, -1)
    signed = torch.cat([-sin[..., :16], sin[..., 16:]], -1)
    rotate_half = torch.cat([-x[..., 16:], x[..., :16]], -1)
    assert torch.equal(apply_rope(x, cos, signed), x * cos + rotate_half * sin)
