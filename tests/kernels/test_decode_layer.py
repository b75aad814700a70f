"""A decoder layer's decode step as one kernel call (kernels/decode_layer.cpp, taken by
models/decoder.DecoderLayer.forward) against the layer's own Python forward over the same kernels: the same
hidden states and the same K/V rows in the cache, to the bit (the same operators in the same order), for each
decoder family's q/k/v layout (InternLM2's grouped wqkv, Qwen2's stacked q|k|v with bias, Qwen3's per-head
norms), each low-bit form that stacks its projections, AWQ's pre_quant_scale, one row and a 4-row tree.
Where a part is not on the kernels (fp16's projections do not stack) the layer keeps its Python forward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from litevlm_runtime.kernels import lowbit_kernels
from litevlm_runtime.models import decoder
from litevlm_runtime.models.config import LLMConfig
from litevlm_runtime.models.internvl import DECODERS
from litevlm_runtime.weights.linear_forms import LinearForms
from litevlm_runtime.weights.lowbit import Int4Linear

needs_kernels = pytest.mark.skipif(not lowbit_kernels.load(), reason="the CPU kernels do not run here")
PROMPT, MAX_LEN = 9, 32


def decoder_in_form(arch: str, kind: str, awq: bool = False):
    cfg = LLMConfig(architecture=arch, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                    num_key_value_heads=2, num_hidden_layers=2, vocab_size=64)
    torch.manual_seed(0)
    lm = DECODERS[arch](cfg, max_len=MAX_LEN)
    for p in lm.parameters():
        p.data.normal_(0, 0.05)
    holder = nn.Module()                     # LinearForms converts a model's language_model
    holder.language_model = lm
    LinearForms(holder, [kind], keep_float=False).use(kind)
    if awq:                                  # every int4 form (stacked ones too) scales its input first
        g = torch.Generator().manual_seed(1)
        for m in lm.modules():
            if isinstance(m, Int4Linear):
                m.pre_quant_scale = torch.rand(m.in_features, generator=g) + 0.5
    return lm, cfg


def steps(lm, cfg):
    """A prompt, then one row and a 4-row tree written into the cache's rows after it: hidden states of
    both and the caches."""
    hkv, d = cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    g = torch.Generator().manual_seed(2)
    k_cache = torch.zeros(cfg.num_hidden_layers, hkv, MAX_LEN, d)
    v_cache = torch.zeros_like(k_cache)
    with torch.inference_mode():
        _, k, v = lm(torch.randn(PROMPT, cfg.hidden_size, generator=g), torch.arange(PROMPT),
                     torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril())
        k_cache[:, :, :PROMPT], v_cache[:, :, :PROMPT] = k, v
        live, out = PROMPT, []
        for t in (1, 4):
            hidden, _, _ = lm(torch.randn(t, cfg.hidden_size, generator=g), torch.arange(live, live + t),
                              torch.ones(t, t, dtype=torch.bool).tril(), k_cache[:, :, :live + t],
                              v_cache[:, :, :live + t], torch.ones(t, live, dtype=torch.bool), rows_in_cache=True)
            out.append(hidden)
            live += t
    return [*out, k_cache, v_cache]


@needs_kernels
@pytest.mark.parametrize("arch,kind,awq", [("internlm2", "int4-rtn", False), ("internlm2", "int8", False),
                                           ("qwen2", "int4-rtn", False), ("qwen2", "int4-rtn", True),
                                           ("qwen2", "int8", False), ("qwen3", "int4-rtn", False)])
def test_one_call_a_layer_is_the_python_forward_to_the_bit(arch, kind, awq, monkeypatch):
    lm, cfg = decoder_in_form(arch, kind, awq)
    calls = []
    real = lowbit_kernels.decode_layer
    monkeypatch.setattr(lowbit_kernels, "decode_layer", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    one_call = steps(lm, cfg)
    assert calls == [1, 1, 4, 4], "each layer of both steps ran as one call (the prompt did not)"
    monkeypatch.setattr(decoder.DecoderLayer, "step_args", lambda self: None)
    python = steps(lm, cfg)
    assert len(calls) == 4
    for a, b in zip(one_call, python, strict=True):
        assert torch.equal(a, b)
    assert one_call[-1][:, :, PROMPT:PROMPT + 5].abs().sum() > 0            # the steps' rows were written


@needs_kernels
def test_forms_that_do_not_stack_keep_the_python_forward(monkeypatch):
    lm, cfg = decoder_in_form("qwen2", "fp16")
    assert all(layer.step_args() is None for layer in lm.layers)
    monkeypatch.setattr(lowbit_kernels, "decode_layer", lambda *a: pytest.fail("decode_layer without its parts"))
    hidden = steps(lm, cfg)[0]
    assert torch.isfinite(hidden).all()


@needs_kernels
def test_decode_layer_names_what_is_wrong():
    lm, cfg = decoder_in_form("qwen2", "int8")
    tensors, ints, eps = lm.layers[0].step_args()
    cache = torch.zeros(2, 4, 64)
    args = (torch.ones(1, 256), tensors, ints, eps, cache, cache.clone(), torch.ones(1, 4, dtype=torch.bool),
            torch.ones(1, 1, 64), torch.zeros(1, 1, 64))
    with pytest.raises(RuntimeError, match="decode_layer: 24 tensors and 24 integers"):
        lowbit_kernels.decode_layer(args[0], tensors[:-1], *args[2:])
    with pytest.raises(RuntimeError, match="more than projection 0's small calls take"):
        lowbit_kernels.decode_layer(torch.ones(17, 256), *args[1:])
