"""FP8 Q/DQ graphs as ONNX Runtime executes them (export/qdq.py), and the PyTorch fake quantization
with the same scales (export/fake_quant.py), on ModelOpt's FP8 graphs of a small checkpoint.

Tolerances: every Q/DQ pair exactly (ONNX Runtime's rounding against ml_dtypes', element by
element); whole graphs against other executors within a fraction of the quantization's own effect
(an FP8 graph amplifies 1e-7 float differences into whole FP8 steps where an activation sits on
a rounding boundary, so no executor agrees with another to float precision): 10% (max norm) for
onnx's reference evaluator, 25% (RMS) for PyTorch, whose attention kernel differs more."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers.export import exported_bundle, lively_checkpoint

pytest.importorskip("modelopt.onnx.quantization", reason="nvidia-modelopt (see requirements.txt)")


def test_fake_quantize_matches_ml_dtypes_and_saturates():
    from litevlm_runtime.export.fake_quant import fp8_round
    from litevlm_runtime.export.qdq import fake_quantize

    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * 3).astype(np.float32)
    x[:4] = [1e4, -1e4, 447.9 * 0.01, 0.0]  # beyond +-448 after scaling: saturated
    want = np.clip(x / np.float32(0.01), -448, 448).astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * np.float32(
        0.01
    )
    np.testing.assert_array_equal(fake_quantize(x, np.float32(0.01), None, "fp8"), want)
    np.testing.assert_array_equal(fp8_round(torch.from_numpy(x), 0.01).numpy(), want)     # torch's own float8 cast
    assert want[0] == np.float32(448 * np.float32(0.01)) and want[1] == -want[0]
    # int8: round half to even, clamp
    got = fake_quantize(np.array([0.5, 1.5, 2.5, -0.5, 300.0], np.float32), np.float32(1.0), np.int8(0), "int8")
    assert got.tolist() == [0.0, 2.0, 2.0, -0.0, 127.0]


def test_blocked_int4_dequantize_linear_runs_in_onnxruntime_and_is_exact():
    """ONNX Runtime 1.3x's CPU DequantizeLinear takes blocked int4 weights (opset 21, block_size);
    fused with its MatMul into MatMulNBits it computes the float64 product at accuracy level 1 (the
    engine's setting), where its default level 4 rounds the activations to int8."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    from litevlm_runtime.engines.onnxruntime_engine import session_options

    rng = np.random.default_rng(1)
    k, n, block = 256, 64, 32
    codes = rng.integers(-8, 8, size=(k, n))
    scales = (rng.random((k // block, n)) + 0.1).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("DequantizeLinear", ["w", "s"], ["wd"], axis=0, block_size=block),
         helper.make_node("MatMul", ["x", "wd"], ["y"])], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [3, k])], [helper.make_tensor_value_info("y", T.FLOAT, [3, n])],
        [helper.make_tensor("w", T.INT4, [k, n], codes.flatten().tolist()), numpy_helper.from_array(scales, "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()
    x = rng.standard_normal((3, k)).astype(np.float32)
    want = x.astype(np.float64) @ (codes * np.repeat(scales, block, 0)).astype(np.float64)
    rel = lambda y: float(np.abs(y - want).max() / np.abs(want).max())  # noqa: E731
    engine = ort.InferenceSession(model, session_options(1), providers=["CPUExecutionProvider"])
    assert rel(engine.run(None, {"x": x})[0]) < 1e-6
    default = ort.SessionOptions()
    default.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "4")
    assert rel(ort.InferenceSession(model, default, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]) > 1e-4
    assert onnx.load_from_string(model).opset_import[0].version == 21


@pytest.fixture(scope="module")
def fp8_vision(tmp_path_factory):
    """ModelOpt FP8 of the small checkpoint's 4-tile vision graph, from real-looking tiles."""
    from litevlm_runtime.export.calibration.quantize import GraphQuantization, quantize_graph

    root = tmp_path_factory.getbasetemp()
    model, bundle = lively_checkpoint(root), exported_bundle(root)
    g = next(g for g in json.loads((bundle / "manifest.json").read_text())["graphs"]
             if g["stage"] == "vision" and g["bucket"] == 4)
    rng = np.random.default_rng(0)
    samples = [
        {"pixels": rng.standard_normal(g["inputs"][0]["shape"]).clip(-2, 2).astype(np.float32)} for _ in range(3)
    ]
    out = tmp_path_factory.mktemp("fp8") / g["file"]
    quantize_graph(bundle / g["file"], out, samples, GraphQuantization("fp8", "max"))
    feeds = [{"pixels": rng.standard_normal(g["inputs"][0]["shape"]).clip(-2, 2).astype(np.float32)} for _ in range(2)]
    return model, bundle / g["file"], out, feeds


def test_every_fp8_pair_is_executed_as_written(fp8_vision):
    from litevlm_runtime.export.qdq import check_graph

    _, plain, quantized, feeds = fp8_vision
    r = check_graph(quantized, feeds, plain)
    assert r.pairs.get("fp8 weight", 0) >= 4 and r.pairs.get("fp8 activation", 0) >= 4, r.pairs
    assert r.checked == sum(r.pairs.values()) and r.elements > 100_000
    assert r.mismatches == 0 and r.worst_quanta == 0.0          # exact, element by element
    assert r.vs_checked == 0.0                                  # the engine runs what was checked
    assert r.float_vs_reference < 1e-5                          # ORT and the reference agree on float graphs
    assert r.vs_reference < 0.1 * r.vs_float                    # and on the quantized one, up to FP8 flips
    assert r.code_flips <= 0.01 * r.codes
    assert r.remaining.get("fp8 activation", 0) >= r.pairs["fp8 activation"]   # ORT's optimizer kept the pairs


def test_torch_fake_quantization_computes_the_fp8_graph(fp8_vision):
    """The vision stage in PyTorch with FakeQuantLinear at the graph's own scales against ONNX
    Runtime on the FP8 graph. The first quantized product's activation: the same FP8 codes in both
    (at most 0.1% flipped: its inputs agree to float32 rounding, 1e-6): the same placement and
    rounding. The stage's output: an RMS difference under a quarter of what FP8 changes (the few
    flips propagate and grow through the layers: 17% on this random checkpoint, whose std-0.1
    weights amplify them, 4.6% on the bundled model's real tiles); every quantized product of the
    graph found in the module."""
    import onnx
    import onnxruntime as ort

    from litevlm_runtime.engines.onnxruntime_engine import session_options
    from litevlm_runtime.engines.stages import VisionStage
    from litevlm_runtime.export.fake_quant import fp8_linears, fp8_scales, swapped
    from litevlm_runtime.export.qdq import fake_quantize
    from litevlm_runtime.pipeline.pipeline import Pipeline

    model_dir, plain, quantized, feeds = fp8_vision
    rt = Pipeline.from_pretrained(model_dir).rt
    scales = fp8_scales(quantized)
    stage = VisionStage(rt.model, rt.pos_embed).eval()
    swaps = fp8_linears(stage, scales, "")
    assert len(swaps) == len(scales) >= 4
    first_name = next(n for n in swaps if n.endswith("layers.0.attn.qkv"))
    first = swaps[first_name]
    # ORT's input of the first product's activation QuantizeLinear (layer 0's norm1 output, the
    # exporter's `layer_norm`), exposed as an output
    graph = onnx.load(str(quantized))
    act_q = next(n for n in graph.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == "layer_norm")
    graph.graph.output.append(onnx.ValueInfoProto(name=act_q.input[0]))
    probe = ort.InferenceSession(graph.SerializeToString(), session_options(1), providers=["CPUExecutionProvider"])
    run = lambda path, f: ort.InferenceSession(str(path), session_options(1),  # noqa: E731
                                               providers=["CPUExecutionProvider"]).run(None, f)[0]
    rms = lambda a: float(np.sqrt(np.mean(np.square(a.astype(np.float64)))))  # noqa: E731
    seen = {}
    hook = first.register_forward_pre_hook(lambda _, args: seen.__setitem__("x", args[0].detach().numpy()))
    try:
        for f in feeds:
            pixels = torch.from_numpy(f["pixels"])
            with torch.no_grad(), swapped(stage, swaps):
                fake = stage(pixels).numpy()
            with torch.no_grad():
                exact = stage(pixels).numpy()
            want, plain_out = run(quantized, f), run(plain, f)
            x_ort = probe.run([act_q.input[0]], f)[0].reshape(seen["x"].shape)
            codes = [fake_quantize(x, np.float32(first.act_scale), None, "fp8") for x in (seen["x"], x_ort)]
            assert np.abs(seen["x"] - x_ort).max() <= 1e-5 * np.abs(x_ort).max()
            assert (codes[0] != codes[1]).mean() <= 1e-3
            assert rms(exact - plain_out) < 1e-5 * rms(plain_out)      # float: the same stage
            assert rms(want - plain_out) > 1e-3 * rms(plain_out)       # FP8 changes the output ...
            assert rms(fake - want) < 0.25 * rms(want - plain_out)     # ... and torch changes it the same way
    finally:
        hook.remove()
