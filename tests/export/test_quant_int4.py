"""One quantizer, two executors: the INT4 weights the project's quantizer stores (weights/quantize.py)
run by the PyTorch engines (`backend.weights int4`) and, written as TensorRT 10's INT4 AWQ ONNX
(export/int4_onnx.py: Mul(pre_quant_scale) -> MatMul(DequantizeLinear int4, block_size)), by ONNX
Runtime, on a small checkpoint's bundle.

Tolerances: the PyTorch reference path (dequantize, then the float product) against ONNX Runtime,
prompt, decode step, batched step and LM head: 1e-5 of the largest output (float32 summation
order); the same weights' difference from float is at least 100 times that. PyTorch's AVX2 kernels
(weights/lowbit.py): their many-row path (prompts) within the same 1e-5; their few-row path rounds
the activations to int8 per block of 32 (a CPU speed choice that TensorRT's weight-only INT4 does
not make), so decode steps there are held to the bound lowbit.py states, not to 1e-5."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import options, random_frames
from helpers.export import MAX_NEW_TOKENS, exported_bundle, lively_checkpoint

GROUP = 64                      # the AVX2 kernels take groups in multiples of their 64-weight block


def stored_weights(model_dir, folder, symmetric=True):
    """Every decoder linear (and the LM head) quantized by the project's quantizer, symmetric INT4 in
    groups of 64, with a random AWQ pre_quant_scale, stored as `litevlm quantize` stores them."""
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.weights.linear_forms import decoder_linears, module_names
    from litevlm_runtime.weights.quantize import quantize_int4, save_quantized

    rt = Pipeline.from_pretrained(model_dir, options(max_new_tokens=MAX_NEW_TOKENS)).rt
    names = module_names(rt.model)
    g = torch.Generator().manual_seed(3)
    weights = {}
    for _, _, m in decoder_linears(rt.lm):
        pqs = torch.rand(m.in_features, generator=g) * 1.5 + 0.5
        weights[names[id(m)]] = quantize_int4(m.weight, GROUP, symmetric=symmetric, pre_quant_scale=pqs)
    save_quantized(folder, weights, {"weights": "int4", "method": "test (random AWQ scales)", "group_size": GROUP,
                                     "symmetric": symmetric, "source": {"model": str(model_dir), "files": {}},
                                     "calibration": {}})
    return rt, folder


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    from litevlm_runtime.export.int4_onnx import write_int4_bundle

    root = tmp_path_factory.getbasetemp()
    model, bundle = lively_checkpoint(root), exported_bundle(root)
    work = tmp_path_factory.mktemp("int4")
    rt, folder = stored_weights(model, work / "weights")
    manifest = write_int4_bundle(rt, bundle, folder, work / "bundle", progress=lambda m: None)
    return model, bundle, folder, work / "bundle", manifest


def engines(model, int4_bundle, folder, kernel: bool, prefill: str = "float32"):
    from litevlm_runtime.pipeline.pipeline import Pipeline
    from litevlm_runtime.weights.lowbit import LowBitLinear

    ort = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, backend__name="onnxruntime",
                                                  backend__bundle=str(int4_bundle), serving__max_batch=2))
    pt = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, backend__weights="int4",
                                                 backend__quantized=str(folder), serving__max_batch=2,
                                                 backend__lowbit_prefill=prefill))
    for m in pt.rt.model.modules():
        if isinstance(m, LowBitLinear):
            m.kernel = m.kernel and kernel          # False: the reference path (dequantize, F.linear)
    return pt, ort


def stage_outputs(pipe, seed=0) -> dict[str, torch.Tensor]:
    """Prompt (40 rows), a one-row step and a 5-row step over a 60-row random cache, a batched step
    of 2 over random regions, and the LM head, on the same random inputs for every pipeline."""
    rt, a = pipe.rt, pipe.rt.arena
    g = torch.Generator().manual_seed(seed)
    d = rt.cfg.llm.hidden_size
    out = {}
    with torch.inference_mode():
        emb = torch.randn(40, d, generator=g)
        out["prefill"] = rt.engines.decoder.prefill(
            emb, torch.arange(40), torch.ones(40, 40, dtype=torch.bool).tril_()
        ).clone()
        for rows in (1, 5):
            a.k_cache.copy_(torch.randn(a.k_cache.shape, generator=g))
            a.v_cache.copy_(torch.randn(a.v_cache.shape, generator=g))
            step = torch.randn(rows, d, generator=g)
            out[f"step {rows}"] = rt.engines.decoder.step(step, 60 + torch.arange(rows), 60 + torch.arange(rows),
                                                          torch.ones(rows, 60, dtype=torch.bool),
                                                          torch.ones(rows, rows, dtype=torch.bool).tril_()).clone()
        a.k_regions.copy_(torch.randn(a.k_regions.shape, generator=g))
        a.v_regions.copy_(torch.randn(a.v_regions.shape, generator=g))
        rows = torch.randn(2, d, generator=g)
        mask = torch.arange(60)[None] < torch.tensor([[30], [60]])
        out["batched step"] = rt.engines.batch.step(rows, torch.tensor([30, 60]), torch.tensor([30, 60]), mask,
                                                    torch.eye(2, dtype=torch.bool)).clone()
        out["head"] = rt.engines.head.run(torch.randn(1, d, generator=g)).clone()
    return out


def rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


def test_int4_bundle_is_tensorrt_int4_awq(int4):
    import onnx

    from litevlm_runtime.engines.tensorrt_engine import tensorrt_qdq_problems
    from litevlm_runtime.export.qdq import count_pairs, qdq_pairs

    _, _, _, out, manifest = int4
    assert manifest["precision"] == "int4" and manifest["quantization"]["symmetric"]
    for g in manifest["graphs"]:
        model = onnx.load(str(out / g["file"]), load_external_data=False)
        pairs = count_pairs(qdq_pairs(model))
        if g["stage"] in ("prefill", "decoder", "decoder_batch"):
            assert pairs == {f"int4 weight (block {GROUP})": 10}, (g["file"], pairs)       # 2 layers x 5 products
            assert sum(n.op_type == "Mul" and n.name.endswith("_pre_quant_scale") for n in model.graph.node) == 10
        elif g["stage"] == "head":
            assert pairs == {f"int4 weight (block {GROUP})": 1}
        else:
            assert not pairs
        assert tensorrt_qdq_problems(out / g["file"]) == []


def test_onnxruntime_equals_the_torch_int4_path(int4):
    model, bundle, folder, out, _ = int4
    from litevlm_runtime.pipeline.pipeline import Pipeline

    float_pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, serving__max_batch=2))
    reference, ort = engines(model, out, folder, kernel=False)
    want, got, plain = stage_outputs(reference), stage_outputs(ort), stage_outputs(float_pipe)
    for stage in want:
        assert rel(got[stage], want[stage]) < 1e-5, stage
        assert rel(plain[stage], want[stage]) > 1e-3, stage          # the weights really are INT4
    kernels, _ = engines(model, out, folder, kernel=True)
    fast = stage_outputs(kernels)
    assert rel(fast["prefill"], want["prefill"]) < 1e-5              # many rows: exact float activations
    for stage in ("step 1", "step 5", "batched step", "head"):       # few rows: int8 activations (lowbit.py)
        assert rel(fast[stage], want[stage]) < 0.2 * rel(plain[stage], want[stage]), stage
    # the bfloat16 prompt GEMM (backend.lowbit_prefill bfloat16): its rounding is far below INT4's
    bf16, _ = engines(model, out, folder, kernel=True, prefill="bfloat16")
    assert rel(stage_outputs(bf16)["prefill"], want["prefill"]) < 0.1 * rel(plain["prefill"], want["prefill"])
    # the int8 prompt GEMM (backend.lowbit_prefill int8, AVX-512 VNNI or AVX2): int8 activations, as the steps above
    int8, _ = engines(model, out, folder, kernel=True, prefill="int8")
    assert rel(stage_outputs(int8)["prefill"], want["prefill"]) < 0.2 * rel(plain["prefill"], want["prefill"])


def test_greedy_answers_agree(int4):
    model, _, folder, out, _ = int4
    reference, ort = engines(model, out, folder, kernel=False)
    frames = random_frames(5)
    for q in ("What is in front of the ego car?", "Is there a car behind?", "What should the ego car do?"):
        assert ort.answer(frames, q).token_ids == reference.answer(frames, q).token_ids


def test_asymmetric_int4_runs_in_onnxruntime_but_not_tensorrt(int4, tmp_path):
    from litevlm_runtime.engines.tensorrt_engine import tensorrt_qdq_problems
    from litevlm_runtime.export.int4_onnx import write_int4_bundle

    model, bundle, _, _, _ = int4
    rt, folder = stored_weights(model, tmp_path / "weights", symmetric=False)
    manifest = write_int4_bundle(rt, bundle, folder, tmp_path / "bundle", progress=lambda m: None)
    assert not manifest["quantization"]["symmetric"]
    step = next(g for g in manifest["graphs"] if g["stage"] == "decoder")
    assert any("zero point" in p for p in tensorrt_qdq_problems(tmp_path / "bundle" / step["file"]))
    reference, ort = engines(model, tmp_path / "bundle", folder, kernel=False)
    want, got = stage_outputs(reference), stage_outputs(ort)
    assert all(rel(got[s], want[s]) < 1e-5 for s in want)


def test_keep_float_leaves_the_matched_products_float(int4, tmp_path):
    """`calibrate --precision int4 --keep-float REGEX` (a mixed configuration): the products whose
    weight name the expression matches keep their float weights, in every decoder graph."""
    import onnx

    from litevlm_runtime.export.int4_onnx import write_int4_bundle
    from litevlm_runtime.export.qdq import count_pairs, qdq_pairs
    from litevlm_runtime.pipeline.pipeline import Pipeline

    model, bundle, folder, _, _ = int4
    rt = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS)).rt
    manifest = write_int4_bundle(rt, bundle, folder, tmp_path / "bundle", progress=lambda m: None,
                                 keep_float=r"^lm\.model\.layers\.0\.")
    assert manifest["quantization"]["keep_float"] == r"^lm\.model\.layers\.0\."
    for g in manifest["graphs"]:
        if g["stage"] not in ("prefill", "decoder", "decoder_batch"):
            continue
        model_proto = onnx.load(str(tmp_path / "bundle" / g["file"]), load_external_data=False)
        assert count_pairs(qdq_pairs(model_proto)) == {f"int4 weight (block {GROUP})": 5}, g["file"]  # layer 1 only
        floats = {t.name for t in model_proto.graph.initializer}
        assert "lm.model.layers.0.attention.wqkv.weight" in floats, g["file"]


def test_pack_int4_is_onnx_packing():
    from onnx import TensorProto, helper, numpy_helper

    from litevlm_runtime.export.int4_onnx import int4_tensor

    values = np.array([[-8, 7, 0], [-1, 3, 5]], dtype=np.int16)
    ours = int4_tensor("w", values, signed=True)
    theirs = helper.make_tensor("w", TensorProto.INT4, [2, 3], values.flatten().tolist())
    assert numpy_helper.to_array(ours).tolist() == numpy_helper.to_array(theirs).tolist() == values.tolist()
