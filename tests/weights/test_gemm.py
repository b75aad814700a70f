"""The float32 GEMM kernel of the CPU linears (backend.gemm, weights/gemm.py): oneDNN's matmul
against a float64 recomputation, the row threshold, the fallbacks inside graphs, which CPUs `auto`
picks it on, and a pipeline's answers with it against the same pipeline on torch's F.linear.

Tolerances: a oneDNN call equals float64 x @ w.T + b within 1e-5 of the largest |x @ w.T| (float32
accumulation over K <= 1024 terms in a different order from MKL's; measured 1e-7 to 1e-6 relative;
a bfloat16 or tf32 kernel would be off by 1e-3 to 1e-2 and fails it); a smaller call is F.linear's
own result, exactly. Whole stages are compared at 1e-4 of the largest value (12 layers of such
reassociation differences); greedy answers token for token.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import options, random_frames
from torch import nn

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.weights.gemm import ONEDNN_MIN_ROWS, OneDnnLinear, mkl_limits_this_cpu, resolve_gemm, use_onednn

onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _linear(k: int, n: int, seed: int) -> nn.Linear:
    g = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        linear.bias.copy_(torch.randn(n, generator=g))
    return linear


@onednn
@torch.inference_mode()
@pytest.mark.parametrize("rows", [1, ONEDNN_MIN_ROWS - 1, ONEDNN_MIN_ROWS, 121, 300])
@pytest.mark.parametrize("k,n", [(256, 768), (1024, 256)])
def test_onednn_matmul_matches_float64_recomputation(rows, k, n):
    plain = _linear(k, n, seed=rows)
    layer = _linear(k, n, seed=rows)
    assert use_onednn([layer]) == 1 and isinstance(layer, OneDnnLinear)
    x = torch.randn(2, rows, k, generator=torch.Generator().manual_seed(k + rows))[:, :, :]
    got = layer(x[0])
    if rows < ONEDNN_MIN_ROWS:
        assert torch.equal(got, plain(x[0]))                     # small calls: F.linear, unchanged
        return
    products = x[0].double() @ plain.weight.double().T
    ref = products + plain.bias.double()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    assert float((got.double() - ref).abs().max()) <= 1e-5 * float(products.abs().max())
    strided = x.transpose(0, 1)[:, 0]                            # a non-contiguous view of the same rows
    assert float((layer(strided).double() - ref).abs().max()) <= 1e-5 * float(products.abs().max())


@onednn
def test_onednn_linear_keeps_its_parameters_and_falls_back_in_graphs():
    layer = _linear(64, 32, seed=1)
    weight, state = layer.weight, {k: v.clone() for k, v in layer.state_dict().items()}
    use_onednn([nn.Sequential(layer, nn.ReLU())])
    assert layer.weight is weight and set(layer.state_dict()) == set(state)
    x = torch.randn(16, 64)
    # torch.compile traces the plain linear (inductor lowers oneDNN's op only for frozen weights)
    compiled = torch.compile(layer, fullgraph=True, dynamic=False)
    with torch.inference_mode():
        assert float((compiled(x) - F.linear(x, layer.weight, layer.bias)).abs().max()) <= 1e-5
    # a call that records gradients takes F.linear, which autograd knows
    x.requires_grad_(True)
    layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


def test_auto_picks_onednn_only_where_mkl_limits_itself(tmp_path):
    zen5 = tmp_path / "zen5"
    zen5.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma avx512f avx512bw avx512_bf16\n")
    zen3 = tmp_path / "zen3"
    zen3.write_text("vendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma\n")
    xeon = tmp_path / "xeon"
    xeon.write_text("vendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f amx_bf16\n")
    assert mkl_limits_this_cpu(str(zen5)) and not mkl_limits_this_cpu(str(zen3))
    assert not mkl_limits_this_cpu(str(xeon)) and not mkl_limits_this_cpu(str(tmp_path / "absent"))
    f32 = torch.float32
    if torch.backends.mkldnn.is_available():
        assert resolve_gemm("auto", "cpu", f32, str(zen5)) == "onednn"
        assert resolve_gemm("onednn", "cpu", f32, str(xeon)) == "onednn"
    assert resolve_gemm("auto", "cpu", f32, str(xeon)) == "torch"
    assert resolve_gemm("auto", "cpu", f32, str(zen3)) == "torch"
    assert resolve_gemm("onednn", "cpu", torch.bfloat16, str(zen5)) == "torch"     # a float32 kernel only
    assert resolve_gemm("onednn", "cuda", f32, str(zen5)) == "torch"
    with pytest.raises(ValueError, match="backend.gemm"):
        resolve_gemm("mkl", "cpu", f32)
    with pytest.raises(Exception, match="gemm"):
        options(backend__gemm="mkl")


@onednn
@torch.inference_mode()
def test_pipeline_on_onednn_matches_torch_gemm():
    """The bundled model, deployed pipeline, greedy: every linear below the model, token selector
    and draft is oneDNN's; vision features and a prefill within 1e-4 of the F.linear pipeline's, and
    answers identical to it token for token."""
    on = Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=12, backend__gemm="onednn"))
    off = Pipeline.from_pretrained(DEFAULT_MODEL, options(max_new_tokens=12, backend__gemm="torch"))
    assert on.rt.gemm == "onednn" and off.rt.gemm == "torch"
    linears = [m for part in (on.rt.model, on.rt.token_selector, on.rt.draft) for m in part.modules()
               if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is OneDnnLinear for m in linears)
    assert not any(isinstance(m, OneDnnLinear) for m in off.rt.model.modules())

    size = off.rt.cfg.force_image_size
    tiles = torch.randn(3, 3, size, size, generator=torch.Generator().manual_seed(0))
    feats_on, feats_off = on.rt.engines.vision.run(tiles).clone(), off.rt.engines.vision.run(tiles).clone()
    assert float((feats_on - feats_off).abs().max()) <= 1e-4 * float(feats_off.abs().max())
    assert not torch.equal(feats_on, feats_off)                  # the other kernel really ran

    def prefill(pipe):
        rt, a = pipe.rt, pipe.rt.arena
        emb = torch.randn(120, rt.cfg.llm.hidden_size, generator=torch.Generator().manual_seed(3)) * 0.5
        return rt.engines.decoder.prefill(emb, a.positions[:120].copy_(torch.arange(120)), a.causal_mask(120)).clone()
    h_on, h_off = prefill(on), prefill(off)
    assert float((h_on - h_off).abs().max()) <= 1e-4 * float(h_off.abs().max())

    for seed, question in enumerate(["What is in front of the ego car?", "Is there a pedestrian behind the ego car?",
                                     "What should the ego vehicle do next?"]):
        frames = random_frames(seed)
        assert on.answer(frames, question).token_ids == off.answer(frames, question).token_ids, question
