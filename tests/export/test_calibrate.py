"""Calibration: traffic recording, bucket fitting, ModelOpt INT8 quantization of a real export,
and the INT8 bundle running in the ONNX Runtime backend with its accuracy change reported."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from helpers import random_frames
from helpers.export import MAX_NEW_TOKENS, exported_bundle, lively_checkpoint

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError

pytest.importorskip("modelopt.onnx.quantization", reason="nvidia-modelopt (see requirements.txt)")

QUESTIONS = ["What is in front of the ego car?", "Is there a car behind?", "What should the ego car do?",
             "Are there pedestrians on the left?", "Is the road clear?", "What is to the front right?",
             "Is it safe to turn left?"]


def png(array: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="PNG")
    return buf.getvalue()


def write_qa(folder):
    """A DriveLM v1.1 file with two key frames of random images and short questions."""
    data = {"scene0": {"scene_description": "", "key_frames": {}}}
    for f in range(2):
        frames = random_frames(100 + f)
        paths = {}
        for cam in CAMERAS:
            p = folder / "samples" / cam / f"frame{f}.png"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(png(frames[cam]))
            paths[cam] = f"../nuscenes/samples/{cam}/frame{f}.png"
        qa = [{"Q": q, "A": "Yes." if i % 2 else "No."} for i, q in enumerate(QUESTIONS)]
        data["scene0"]["key_frames"][f"frame{f}"] = {"QA": {"perception": qa}, "image_paths": paths}
    path = folder / "qa.json"
    path.write_text(json.dumps(data))
    return path


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    from helpers import options

    from litevlm_runtime.export.calibration.calibrate import calibrate
    from litevlm_runtime.export.calibration.plan import CalibrationPlan

    root = tmp_path_factory.getbasetemp()
    model, bundle = lively_checkpoint(root), exported_bundle(root)
    work = tmp_path_factory.mktemp("calibration")
    qa = write_qa(work)
    plan = CalibrationPlan(model, options(max_new_tokens=MAX_NEW_TOKENS), qa, work / "out", bundle=bundle,
                           calib_questions=4, eval_questions=3, samples_per_graph=4)
    manifest, report = calibrate(plan, progress=lambda m: None)
    return model, bundle, work / "out" / "int8", manifest, report


def test_int8_bundle_has_qdq_graphs_and_keeps_its_interface(calibrated):
    import onnx

    _, bundle, out, manifest, _ = calibrated
    source = json.loads((bundle / "manifest.json").read_text())
    assert manifest["precision"] == "int8"
    assert [(g["stage"], g["bucket"]) for g in manifest["graphs"]] == [
        (g["stage"], g["bucket"]) for g in source["graphs"]
    ]
    for g, src in zip(manifest["graphs"], source["graphs"]):
        assert g["inputs"] == src["inputs"] and g["outputs"] == src["outputs"]
        ops = {n.op_type for n in onnx.load(str(out / g["file"]), load_external_data=False).graph.node}
        if g["stage"] == "head":
            assert "QuantizeLinear" not in ops      # LM head kept in full precision
        else:
            assert {"QuantizeLinear", "DequantizeLinear"} <= ops, g["file"]
            assert g["calibration_samples"] >= 1
    report = json.loads((out.parent / "calibration_report_int8.json").read_text())
    assert report["precision"] == "int8"


def test_int8_bundle_runs_in_onnxruntime_close_to_fp32(calibrated):
    from helpers import options

    from litevlm_runtime.pipeline.pipeline import Pipeline

    model, bundle, out, _, report = calibrated
    make = lambda b: Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS,  # noqa: E731
                                                             backend__name="onnxruntime", backend__bundle=str(b)))
    fp32, int8 = make(bundle), make(out)
    s = fp32.rt.cfg.force_image_size
    pixels = torch.randn(6, 3, s, s, generator=torch.Generator().manual_seed(0)).clamp(-2, 2)
    ref = fp32.rt.engines.vision.run(pixels).clone()
    got = int8.rt.engines.vision.run(pixels).clone()
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert 0 < rel < 0.25          # quantized (not bit-identical), and still the same function
    ans = int8.answer(random_frames(3), QUESTIONS[0])
    assert 1 <= len(ans.token_ids) <= MAX_NEW_TOKENS
    assert report.questions == 3
    assert 0.0 <= report.token_agreement <= 1.0 and report.reference_tokens > 0


def test_int8_bundle_batches_with_its_own_answers(calibrated):
    """The batched step is quantized from single decode steps side by side (calibration traffic
    has no batches), then given the single step's activation scales: the INT8 bundle batches,
    and its batched greedy answers are its own one at a time."""
    from helpers import options
    from helpers.batching import serve

    from litevlm_runtime.engines import batch_limit
    from litevlm_runtime.pipeline.pipeline import Pipeline

    model, _, out, manifest, _ = calibrated
    (g,) = [g for g in manifest["graphs"] if g["stage"] == "decoder_batch"]
    assert g["precision"] == "int8" and "per batched call" in g["calibration_source"]
    assert "activation scales of decoder_1.onnx (10 products)" in g["calibration_source"]     # 2 layers x 5
    opts = options(max_new_tokens=MAX_NEW_TOKENS, backend__name="onnxruntime", backend__bundle=str(out))
    assert batch_limit(opts) == (4, "")
    int8 = Pipeline.from_pretrained(model, opts)
    frames = [random_frames(40)]
    alone = {(0, q): int8.answer(frames[0], q, frame_keys={c: 0 for c in frames[0]}).token_ids for q in QUESTIONS[:4]}
    batched, widest = serve(int8, frames, [(0, 0, q) for q in QUESTIONS[:4]])
    assert widest == 4 and {k: a.token_ids for k, a in batched.items()} == alone


def test_batched_calibration_samples_are_single_steps_side_by_side():
    from litevlm_runtime.export.calibration.traffic import Recorder, batched_samples

    s, layers = 7, 2
    r = Recorder(per_graph=8)
    for i in range(5):
        r.record("decoder_1.onnx", {"embeds": torch.full((1, 3), float(i)), "positions": torch.tensor([10 + i]),
                                    "mask_cache": torch.arange(s)[None] < i + 1, "mask_new": torch.ones(1, 1).bool(),
                                    "k_cache": torch.full((layers, 1, s, 2), float(i)),
                                    "v_cache": torch.full((layers, 1, s, 2), -float(i))})
    manifest = {"graphs": [{"stage": "decoder", "bucket": 1, "file": "decoder_1.onnx"}]}
    samples, source = batched_samples({"buckets": [2, 4]}, manifest, r)
    assert len(samples) == 2 and "4 per batched call" in source
    first, last = samples
    assert first["embeds"].shape == (4, 3) and first["k_regions"].shape == (4, layers, 1, s, 2)
    assert first["positions"].tolist() == [10, 11, 12, 13] and first["mask_cache"].sum(1).tolist() == [1, 2, 3, 4]
    assert (first["k_regions"][2] == 2).all() and (first["v_regions"][3] == -3).all()
    assert first["mask_new"].tolist() == np.eye(4, dtype=bool).tolist()
    assert last["positions"].tolist() == [14, 10, 11, 12]          # cycled to fill the last batch


def test_recorder_reservoir_is_bounded_and_deterministic():
    from litevlm_runtime.export.calibration.traffic import Recorder

    def run():
        r = Recorder(per_graph=3, seed=0)
        for i in range(50):
            r.record("g.onnx", {"x": torch.full((2,), float(i))})
        return [int(s["x"][0]) for s in r.samples["g.onnx"]]

    kept = run()
    assert len(kept) == 3 and kept == run() and max(kept) > 2   # later calls can replace early ones


def test_fit_sample_prefix_and_padding():
    from litevlm_runtime.export.calibration.traffic import fit_sample

    t, s = 5, 9
    sample = {"embeds": np.arange(t * 2, dtype=np.float32).reshape(t, 2), "positions": np.arange(t),
              "mask_cache": np.ones((t, s), dtype=bool), "mask_new": np.tril(np.ones((t, t), dtype=bool)),
              "k_cache": np.zeros((1, 1, s, 2), np.float32), "v_cache": np.zeros((1, 1, s, 2), np.float32)}
    short = fit_sample("decoder", sample, 3)
    assert short["embeds"].shape == (3, 2) and short["mask_new"].shape == (3, 3) and short["mask_cache"].shape == (3, s)
    long = fit_sample("decoder", sample, 8)
    assert long["embeds"].shape == (8, 2) and not long["embeds"][t:].any()
    assert not long["mask_cache"][t:].any()
    assert long["mask_new"][t:, t:].diagonal().all() and long["mask_new"][t:, :t].sum() == 0
    tiles = fit_sample("vision", {"pixels": np.ones((2, 3, 4, 4), np.float32)}, 5)
    assert tiles["pixels"].shape == (5, 3, 4, 4)


def test_queries_from_a_rosbag(tmp_path):
    from litevlm_runtime.bag.io import BagContents, CameraFrame, write_bag
    from litevlm_runtime.export.calibration.traffic import load_queries
    from litevlm_runtime.pipeline.request import QueryRequest

    contents = BagContents()
    frames = random_frames(7)
    for cam in CAMERAS:
        contents.frames[cam].append(CameraFrame(1_000, png(frames[cam]), "png"))
    asked = QueryRequest("Is there a car behind?", stamp_ns=2_000, query_id="q1", choices=("Yes.", "No."), priority=3)
    contents.queries.append(asked)
    bag = write_bag(contents, tmp_path / "bag")
    queries = load_queries(bag)
    assert [q.request for q in queries] == [asked]      # every field the message carries, as the node reads it
    assert set(queries[0].images) == set(CAMERAS)


def test_bad_data_is_a_clear_error(tmp_path):
    from litevlm_runtime.export.calibration.traffic import load_queries

    with pytest.raises(InputError, match="expected a DriveLM QA"):
        load_queries(tmp_path / "data.txt")
    (tmp_path / "qa.json").write_text("[1, 2]")
    with pytest.raises(InputError):
        load_queries(tmp_path / "qa.json")


def test_fp8_qdq_graph_for_tensorrt(calibrated, tmp_path):
    """FP8 Q/DQ (ModelOpt) of a vision graph: float8 e4m3 scales' zero points, interface kept.
    It cannot run here (TensorRT-only operators); `build-engines --precision fp8` consumes it."""
    import onnx

    from litevlm_runtime.export.calibration.quantize import GraphQuantization, quantize_graph

    _, bundle, _, _, _ = calibrated
    g = next(g for g in json.loads((bundle / "manifest.json").read_text())["graphs"] if g["stage"] == "vision")
    rng = np.random.default_rng(0)
    samples = [{"pixels": rng.standard_normal(g["inputs"][0]["shape"]).astype(np.float32)} for _ in range(2)]
    quantize_graph(bundle / g["file"], tmp_path / g["file"], samples, GraphQuantization("fp8", "max"))
    model = onnx.load(str(tmp_path / g["file"]), load_external_data=False)
    zero_points = [t for t in model.graph.initializer if t.name.endswith("zero_point")]
    assert zero_points and all(t.data_type == onnx.TensorProto.FLOAT8E4M3FN for t in zero_points)
    assert [i.name for i in model.graph.input] == ["pixels"] and [o.name for o in model.graph.output] == ["visual"]


def decode_steps(bundle, calls: int = 4):
    """(the bundle's manifest, a Recorder holding `calls` one-row decode steps of decoder_1 with
    random embeddings and caches and growing histories)."""
    from litevlm_runtime.export.calibration.traffic import Recorder

    manifest = json.loads((bundle / "manifest.json").read_text())
    one = next(g for g in manifest["graphs"] if g["stage"] == "decoder" and g["bucket"] == 1)
    shapes = {i["name"]: i["shape"] for i in one["inputs"]}
    rng, recorder = np.random.default_rng(0), Recorder(per_graph=calls)
    for n in range(calls):
        mask = np.zeros(shapes["mask_cache"], dtype=bool)
        mask[0, :5 + n] = True
        recorder.record(
            one["file"],
            {
                "embeds": torch.from_numpy(rng.standard_normal(shapes["embeds"]).astype(np.float32)),
                "positions": torch.tensor([5 + n]),
                "mask_cache": torch.from_numpy(mask),
                "mask_new": torch.ones(1, 1, dtype=torch.bool),
                "k_cache": torch.randn(shapes["k_cache"]),
                "v_cache": torch.randn(shapes["v_cache"]),
            },
        )
    return manifest, recorder


def test_fp8_batched_step_rounds_as_the_single_step(calibrated, tmp_path):
    """FP8 (what TensorRT on the car runs): ModelOpt leaves the 1-row step's GEMV-shaped
    products unquantized, so the batched step stays as exported too; against a step that has
    FP8 products (the 8-row tree step), the batched step gets exactly those products, with
    that step's activation scales."""
    import onnx
    from onnx import numpy_helper

    from litevlm_runtime.export.calibration.quantize import (
        GraphQuantization,
        activation_scales,
        quantize_batched_step,
        quantize_graph,
    )
    from litevlm_runtime.export.calibration.traffic import fit_sample

    _, bundle, _, _, _ = calibrated
    manifest, recorder = decode_steps(bundle)
    graph = {(g["stage"], g["bucket"]): g for g in manifest["graphs"]}
    one, tree, batch = graph[("decoder", 1)], graph[("decoder", 8)], graph[("decoder_batch", 4)]
    steps = recorder.samples[one["file"]]
    fp8 = GraphQuantization("fp8", "max")
    quantize_graph(bundle / one["file"], tmp_path / one["file"], steps, fp8)
    assert activation_scales(onnx.load(str(tmp_path / one["file"]), load_external_data=False).graph) == {}
    assert quantize_batched_step(bundle, tmp_path, batch, one, manifest, recorder, fp8) is None

    quantize_graph(bundle / tree["file"], tmp_path / tree["file"], [fit_sample("decoder", s, 8) for s in steps], fp8)
    _, source = quantize_batched_step(bundle, tmp_path, batch, tree, manifest, recorder, fp8)
    assert "activation scales of decoder_8.onnx (10 products)" in source           # 2 layers x 5
    src, dst = (onnx.load(str(tmp_path / g["file"]), load_external_data=False).graph for g in (tree, batch))
    value = lambda graph, name: numpy_helper.to_array(next(t for t in graph.initializer if t.name == name))  # noqa: E731
    theirs, ours = activation_scales(src), activation_scales(dst)
    assert set(ours) == set(theirs)
    for weight, (scale, zero) in ours.items():
        assert value(dst, scale) == value(src, theirs[weight][0])
        assert next(t for t in dst.initializer if t.name == zero).data_type == onnx.TensorProto.FLOAT8E4M3FN


def test_fp8_decode_puts_qdq_into_the_one_row_step(tmp_path_factory, tmp_path):
    """`calibrate --precision fp8 --fp8-decode`: ModelOpt's GEMV detection off, so the one-row
    decode step (every generated token after the first) gets FP8 Q/DQ on all its weight products
    (2 layers x wqkv, wo, w1, w3, w2 = 10 here; by default none, the test above), each pair executed by
    ONNX Runtime exactly as its E4M3 rounding; the batched step then follows it, with its scales."""
    import onnx

    from litevlm_runtime.export.calibration.quantize import (
        GraphQuantization,
        activation_scales,
        quantize_batched_step,
        quantize_graph,
    )
    from litevlm_runtime.export.qdq import check_graph

    bundle = exported_bundle(tmp_path_factory.getbasetemp())
    manifest, recorder = decode_steps(bundle)
    graph = {(g["stage"], g["bucket"]): g for g in manifest["graphs"]}
    one, batch = graph[("decoder", 1)], graph[("decoder_batch", 4)]
    steps = recorder.samples[one["file"]]
    fp8_decode = GraphQuantization("fp8", "max", fp8_decode=True)
    quantize_graph(bundle / one["file"], tmp_path / one["file"], steps, fp8_decode)
    quantized = onnx.load(str(tmp_path / one["file"]), load_external_data=False)
    assert len(activation_scales(quantized.graph)) == 10
    zero_points = [t for t in quantized.graph.initializer if t.name.endswith("zero_point")]
    assert zero_points and all(t.data_type == onnx.TensorProto.FLOAT8E4M3FN for t in zero_points)
    assert [i.name for i in quantized.graph.input] == [i["name"] for i in one["inputs"]]

    r = check_graph(tmp_path / one["file"], steps[:2], bundle / one["file"])
    # a pair per weight; w1 and w3 read the same activation and share its pair (2 layers x 4)
    assert r.pairs.get("fp8 weight", 0) == 10 and r.pairs.get("fp8 activation", 0) == 8, r.pairs
    assert r.mismatches == 0 and r.worst_quanta == 0.0            # every pair: its E4M3 rounding, exactly
    assert 0 < r.vs_float < 0.5                                   # quantized, and still the same step

    _, source = quantize_batched_step(bundle, tmp_path, batch, one, manifest, recorder, fp8_decode)
    assert "activation scales of decoder_1.onnx (10 products)" in source


def test_int4_without_stored_weights_quantizes_them_with_the_projects_awq(tmp_path_factory, tmp_path):
    """`calibrate --precision int4` without --quantized: the project's own AWQ (symmetric) from the
    calibration questions, stored beside the bundle, then written into the graphs (no ModelOpt INT4
    and no cppimport on this path)."""
    from helpers import options

    from litevlm_runtime.export.awq import with_int4_weights
    from litevlm_runtime.export.calibration.calibrate import calibrate
    from litevlm_runtime.export.calibration.plan import CalibrationPlan
    from litevlm_runtime.weights.quantize import load_quantized

    root = tmp_path_factory.getbasetemp()
    model, bundle = lively_checkpoint(root), exported_bundle(root)
    qa = write_qa(tmp_path)
    plan = CalibrationPlan(model, options(max_new_tokens=MAX_NEW_TOKENS), qa, tmp_path / "out", bundle=bundle,
                           precision="int4", calib_questions=2, eval_questions=2)
    planned = with_int4_weights(plan, progress=lambda m: None)
    assert planned.quantized == tmp_path / "out" / "int4-weights"
    stored, _ = load_quantized(planned.quantized)
    assert stored["weights"] == "int4" and stored["method"] == "awq" and stored["symmetric"]
    assert stored["calibration"]["questions"] == 2
    manifest, report = calibrate(planned, progress=lambda m: None)
    assert manifest["precision"] == "int4" and manifest["quantization"]["symmetric"]
    assert report.questions == 2
