"""The decoder layer's small operators on the kernels (kernels/layer_ops.cpp: rms_norm, rope_, silu_mul)
against independent references, where the model code takes them (models/decoder.on_layer_ops), and a
prompt's MLP in row chunks (models/decoder.in_row_chunks) against one call.

Tolerances: rms_norm sums the squares in float32 in its own order: within 2e-6 of the row's largest
output against float64. rope_ rounds each product and the sum as torch's operators do: bit-identical to
models/rope.apply_rope. silu_mul's exponential is a polynomial (Cephes' expf): within 1e-6 relative (plus
1e-30 absolute, for products that underflow) of float64's silu(g) * u.
"""

from __future__ import annotations

import pytest
import torch

from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.models import decoder
from litevlm_runtime.models.config import LLMConfig
from litevlm_runtime.models.internvl import DECODERS
from litevlm_runtime.models.rope import RotaryTable, apply_rope

needs_kernels = pytest.mark.skipif(not lowbit_kernels.load(), reason="the CPU kernels do not run here")


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1536), (7, 100), (5, 3, 64)])
def test_rms_norm_against_float64(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    if len(shape) == 3:
        x = x.transpose(0, 1).contiguous().transpose(0, 1)         # not contiguous: the op makes it so
    w = torch.randn(shape[-1], generator=g)
    got = lowbit_kernels.rms_norm(x, w, 1e-6)
    xd = x.double()
    want = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    assert got.shape == x.shape and got.dtype == torch.float32
    assert ((got.double() - want).abs() <= 2e-6 * want.abs().amax(-1, keepdim=True)).all()


@needs_kernels
def test_rms_norm_refuses_what_it_does_not_compute():
    with pytest.raises(RuntimeError, match="rms_norm: float32 x"):
        lowbit_kernels.rms_norm(torch.ones(2, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="rms_norm: float32 x"):
        lowbit_kernels.rms_norm(torch.ones(2, 8, dtype=torch.float64), torch.ones(8), 1e-6)


@needs_kernels
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 12, 2, 128), (37, 4, 2, 64), (3, 2, 1, 16)])
def test_rope_in_place_is_apply_rope_to_the_bit(t, hq, hkv, d):
    """q and k as a layer has them: views of one fused projection's output (strided rows)."""
    cfg = LLMConfig(architecture="qwen2", hidden_size=hq * d, num_attention_heads=hq, num_key_value_heads=hkv)
    cos, sin = RotaryTable(cfg, 4096)(torch.arange(1000, 1000 + t), torch.float32)
    fused = torch.randn(t, (hq + 2 * hkv) * d, generator=torch.Generator().manual_seed(t)) * 4
    q, k, v = fused.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
    want_q, want_k, want_v = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.clone()
    lowbit_kernels.rope_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)


@needs_kernels
def test_silu_mul_against_float64():
    edges = torch.tensor([0.0, -0.0, 88.5, -88.5, -87.0, 1e-8, -1e-8, 20.0, 3.0, -3.0])
    g = torch.cat([torch.linspace(-100, 100, 3995), edges])
    g = g[torch.randperm(g.numel(), generator=torch.Generator().manual_seed(0))].reshape(3, -1)  # 1,335 a row: a tail
    u = torch.randn(g.shape, generator=torch.Generator().manual_seed(1))
    got = lowbit_kernels.silu_mul(g, u)
    gd = g.double()
    want = gd / (1 + torch.exp(-gd)) * u.double()
    assert ((got.double() - want).abs() <= 1e-6 * want.abs() + 1e-30).all()
    gate_up = torch.cat([g, u], -1)                     # the stacked gate/up projection's halves, strided
    assert torch.equal(lowbit_kernels.silu_mul(*gate_up.split(g.shape[1], -1)), got)


def layer_outputs(arch: str, grad: bool = False):
    cfg = LLMConfig(architecture=arch, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, vocab_size=64)
    torch.manual_seed(0)
    lm = DECODERS[arch](cfg, max_len=64)
    for p in lm.parameters():
        p.data.normal_(0, 0.05)
    x = torch.randn(9, 256)
    with torch.set_grad_enabled(grad):
        mask = torch.ones(9, 9, dtype=torch.bool).tril()
        hidden, k, v = lm(x, torch.arange(9), mask)
    return hidden, k, v


@needs_kernels
@pytest.mark.parametrize("arch", ["internlm2", "qwen2", "qwen3"])
def test_layers_on_layer_ops_match_torchs_operators(arch, monkeypatch):
    """The decoder forward with the layer operators against the same forward on torch's (decoder.on_layer_ops
    switched off): the same rotations (bit-identical RoPE), norms and SwiGLU within float32 rounding."""
    calls = []
    real = lowbit_kernels.rms_norm
    monkeypatch.setattr(lowbit_kernels, "rms_norm", lambda *a: calls.append(1) or real(*a))
    on = layer_outputs(arch)
    assert calls, "the eager float32 forward took the kernels' RMSNorm"
    monkeypatch.setattr(decoder, "on_layer_ops", lambda _x: False)
    off = layer_outputs(arch)
    for a, b in zip(on, off, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


@needs_kernels
def test_training_keeps_torchs_operators(monkeypatch):
    """With gradients on (training) the layer keeps torch's operators (rope_ writes in place, the kernels
    have no backward: the norms' weights would get none), and the backward runs."""
    monkeypatch.setattr(lowbit_kernels, "rms_norm", lambda *a: pytest.fail("rms_norm kernel under autograd"))
    hidden, _, _ = layer_outputs("qwen2", grad=True)
    hidden.square().sum().backward()
    assert not decoder.on_layer_ops(torch.ones(2, 2))               # gradients on (pytest's default)
    with torch.inference_mode():
        assert decoder.on_layer_ops(torch.ones(2, 2)) and not decoder.on_layer_ops(torch.ones(2, 2).double())


@pytest.mark.parametrize("weights", ["int4-rtn", "int8", "float"])
def test_prompt_mlp_in_row_chunks_computes_what_one_call_does(weights, monkeypatch):
    """A prompt's MLP in equal row chunks (decoder.in_row_chunks): on the low-bit kernels' int8 GEMM the
    same numbers to the bit (every chunk above GEMV_MAX_ROWS, rows independent); float32 within 1e-6."""
    from helpers import options

    from litevlm_runtime.bench.random_model import random_pipeline

    pipe = random_pipeline("tiny-qwen3", options(pipeline="baseline", backend__threads=1, backend__weights=weights))
    rt, t = pipe.rt, 100
    embeds = torch.randn(t, rt.cfg.llm.hidden_size, generator=torch.Generator().manual_seed(5))
    calls = []
    real = rt.lm.layers[0].mlp_forward
    monkeypatch.setattr(rt.lm.layers[0], "mlp_forward", lambda h: calls.append(h.shape[0]) or real(h))
    with torch.inference_mode():
        monkeypatch.setattr(decoder, "MLP_CHUNK_ROWS", 40)
        chunked = rt.engines.decoder.prefill(embeds, rt.arena.positions[:t], rt.arena.causal_mask(t)).clone()
        monkeypatch.setattr(decoder, "MLP_CHUNK_ROWS", 10_000)
        whole = rt.engines.decoder.prefill(embeds, rt.arena.positions[:t], rt.arena.causal_mask(t)).clone()
    assert calls == [34, 34, 32, 100]
    if weights == "float":
        assert (chunked - whole).abs().max() <= 1e-6 * whole.abs().max()
    else:
        assert torch.equal(chunked, whole)
