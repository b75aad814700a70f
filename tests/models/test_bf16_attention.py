"""The kernels' bfloat16 attention (kernels/lowbit_kernels.cpp attention_bf16): a vision tile's tokens over
each other and a causal prompt over the cache it sees whole, against a float64 recomputation; where the
model code takes it (models/intern_vit.py tile_attention, models/decoder.py attend / causal_prompt) and
where it does not.

Tolerance: the kernel computes softmax(q_b k_b^T / sqrt(D)) v_b with q, k, v rounded to bfloat16 (as torch
rounds), the scores, the softmax and the sums in float32, the probabilities rounded to bfloat16 for p.v.
Against float64 over the same bfloat16 inputs every output is within (2^-9 + 1e-4) max|v| of its row
(2^-9: the probabilities' rounding, relative, weighting values of at most max|v|; 1e-4: float32 sums and
the exponential's ~1 ulp). What rounding q, k, v to bfloat16 costs against float32 is stated per stage
below (a prefill's hidden states, a vision tower's tokens), not a kernel tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.models.decoder import causal_prompt
from litevlm_runtime.models.intern_vit import tile_attention

needs_bf16 = pytest.mark.skipif(not lowbit_kernels.has_bf16_attention(),
                                reason="no AVX-512 BF16 here: the model code takes torch's SDPA (tested below)")


def reference(q, k, v, offset):
    """float64 attention over the bfloat16-rounded inputs; GQA by repeating KV heads; query i sees keys
    j <= i + offset (offset >= 0)."""
    qb, kb, vb = (t.bfloat16().double() for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    kb, vb = kb.repeat_interleave(group, 1), vb.repeat_interleave(group, 1)
    s = qb @ kb.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if offset >= 0:
        n, keys = q.shape[2], k.shape[2]
        s = s.masked_fill(torch.arange(keys)[None, :] > torch.arange(n)[:, None] + offset, float("-inf"))
    return torch.softmax(s, -1) @ vb, vb


@needs_bf16
@pytest.mark.parametrize("b,hq,hkv,n,keys,d,offset", [
    (2, 4, 4, 65, 65, 64, -1),          # vision-like, N not a multiple of the 4-row tiles or 128-key blocks
    (1, 16, 16, 257, 257, 64, -1),
    (1, 12, 2, 150, 150, 128, 0),       # a causal prompt, GQA 6:1 (InternVL3-2B's heads)
    (1, 6, 2, 70, 200, 128, 130),       # a prompt after 130 cached columns
    (1, 4, 2, 5, 300, 64, 295),         # few rows, many keys
])
def test_kernel_matches_float64_over_bfloat16_inputs(b, hq, hkv, n, keys, d, offset):
    g = torch.Generator().manual_seed(n + keys)
    q = torch.randn(b, n, hq, d, generator=g).transpose(1, 2) * 3          # strided, as the models pass it
    k = torch.randn(b, hkv, keys, d, generator=g) * 3
    v = torch.randn(b, keys, hkv, d, generator=g).transpose(1, 2)
    got = lowbit_kernels.attention_bf16(q, k, v, offset)
    want, vb = reference(q, k, v, offset)
    assert got.shape == (b, hq, n, d) and got.dtype == torch.float32
    bound = (2 ** -9 + 1e-4) * vb.abs().amax(dim=(-2, -1), keepdim=True)
    assert bool(((got.double() - want).abs() <= bound).all())
    if offset < 0:                                                       # not merely SDPA's float32 result
        assert not torch.equal(got, F.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1),
                                                                   v.repeat_interleave(hq // hkv, 1)))


@needs_bf16
def test_rows_that_see_no_key_of_a_block_skip_it():
    """Causal rows whose keys end inside the first block: later blocks are masked out or never computed,
    and a short last tile (its rows repeated internally) writes only its own rows."""
    q, k, v = torch.randn(1, 2, 7, 64), torch.randn(1, 2, 260, 64), torch.randn(1, 2, 260, 64)
    got = lowbit_kernels.attention_bf16(q, k, v, 3)
    want, vb = reference(q, k, v, 3)
    assert bool(((got.double() - want).abs() <= (2 ** -9 + 1e-4) * vb.abs().max()).all())


def test_model_code_takes_sdpa_where_the_kernel_does_not_apply():
    q = torch.randn(1, 2, 20, 64)
    assert torch.equal(tile_attention(q, q, q, bf16=False), F.scaled_dot_product_attention(q, q, q))
    assert torch.equal(tile_attention(q.double(), q.double(), q.double(), bf16=True),
                       F.scaled_dot_product_attention(q.double(), q.double(), q.double()))
    with torch.enable_grad():
        r = q.clone().requires_grad_()
        assert torch.equal(tile_attention(r, r, r, bf16=True).detach(), F.scaled_dot_product_attention(q, q, q))


def test_causal_prompt_is_exactly_a_causal_prompt_over_a_whole_cache():
    t = 80
    tril = torch.ones(t, t, dtype=torch.bool).tril()
    assert causal_prompt(tril, None)
    assert causal_prompt(tril, torch.ones(t, 30, dtype=torch.bool))
    assert not causal_prompt(tril[:40, :40], None)                           # too few rows: SDPA
    part = torch.ones(t, 30, dtype=torch.bool)
    part[5, 3] = False                                                       # a hidden cache column
    assert not causal_prompt(tril, part)
    tree = tril.clone()
    tree[70, 65] = False                                                     # not the lower triangle
    assert not causal_prompt(tree, None)
    assert not causal_prompt(tril, [None, None])                              # FastV's per-layer masks


@needs_bf16
@torch.inference_mode()
def test_vision_tile_and_prefill_take_the_kernel_when_flagged():
    """tile_attention(bf16=True) is the kernel's result; a decoder whose layers have bf16_attention gives a
    causal prompt the kernel's attention (the first layer's K/V rows unchanged; the hidden states within 2e-2
    of the largest of the SDPA prefill over two layers: bfloat16 q, k, v) and a decode step SDPA's, exactly.
    A head size the kernel does not take (not a multiple of 64) stays on SDPA."""
    from litevlm_runtime.models.config import LLMConfig
    from litevlm_runtime.models.qwen2 import Qwen2ForCausalLM

    q = torch.randn(1, 4, 100, 64)
    assert torch.equal(tile_attention(q, q, q, bf16=True), lowbit_kernels.attention_bf16(q, q, q))
    q32 = torch.randn(1, 4, 100, 32)
    assert torch.equal(tile_attention(q32, q32, q32, bf16=True), F.scaled_dot_product_attention(q32, q32, q32))
    torch.manual_seed(0)
    cfg = LLMConfig(architecture="qwen2", hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, vocab_size=300)
    lm = Qwen2ForCausalLM(cfg, max_len=256).eval()
    t = 90
    x, pos, mask = torch.randn(t, 256), torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril()
    ref, k_ref, v_ref = lm(x, pos, mask)
    step_args = (x[:1], torch.tensor([t]), torch.ones(1, 1, dtype=torch.bool), k_ref, v_ref,
                 torch.ones(1, t, dtype=torch.bool))
    step_ref = lm(*step_args)[0]
    for layer in lm.layers:
        layer.bf16_attention = True
    got, k_got, _ = lm(x, pos, mask)
    assert not torch.equal(got, ref) and torch.equal(k_got[0], k_ref[0])   # attention, not 1st projections
    assert float((got - ref).abs().max() / ref.abs().max()) <= 2e-2
    assert torch.equal(lm(*step_args)[0], step_ref)                        # one row: SDPA
