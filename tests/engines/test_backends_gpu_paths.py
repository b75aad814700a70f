"""The GPU-only backends on a machine without a GPU: everything but the CUDA capture and the
TensorRT calls runs here; where those are needed the error says so plainly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import options, random_frames
from helpers.export import MAX_NEW_TOKENS, lively_checkpoint

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.engines.buckets import Buckets
from litevlm_runtime.engines.cuda_graph import cuda_graph_engines
from litevlm_runtime.engines.tensorrt_engine import build_engines, check_engines, import_tensorrt
from litevlm_runtime.errors import LiteVLMError
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return lively_checkpoint(tmp_path_factory.getbasetemp())


def test_static_stages_give_the_torch_answers(model):
    """The modules and bound buffers the CUDA-graph backend captures, run without capture."""
    opts = PipelineOptions(max_new_tokens=MAX_NEW_TOKENS)
    ref = Pipeline.from_pretrained(model, opts)
    static = Pipeline.from_pretrained(model, opts)
    static.rt.engines = cuda_graph_engines(static.rt, capture=False,
                                           buckets=Buckets(vision=(4, 6), prefill=(256,), step=(1, 8), head=(1, 8)))
    assert static.rt.engines.decoder.backend == "torch-static"
    for i, q in enumerate(DEFAULT_QUESTIONS[:4]):
        frames = random_frames(10 + i)
        assert static.answer(frames, q).token_ids == ref.answer(frames, q).token_ids


def test_static_stages_run_the_deployed_litevlm_configuration():
    """The bundled model's LiteVLM configuration (views, tokens, EAGLE-2 with its draft head
    captured too) on the static bound stages: the tokens of the eager torch backend."""
    from litevlm_runtime.bundled import DEFAULT_MODEL

    ref = Pipeline.from_pretrained(DEFAULT_MODEL, PipelineOptions())
    static = Pipeline.from_pretrained(DEFAULT_MODEL, PipelineOptions())
    static.rt.engines = cuda_graph_engines(static.rt, capture=False)
    assert static.rt.engines.draft.backend == "torch-static"
    for i, q in enumerate(DEFAULT_QUESTIONS[:4]):
        frames = random_frames(20 + i, 270, 480)
        a, b = static.answer(frames, q), ref.answer(frames, q)
        assert a.pipeline == b.pipeline == "litevlm[views,tokens@0.8,eagle]"
        assert a.token_ids == b.token_ids


@pytest.mark.skipif(not NO_CUDA, reason="checks the message on machines without CUDA")
def test_cuda_graph_backend_without_cuda_is_a_clear_error(model):
    with pytest.raises(LiteVLMError, match="needs CUDA"):
        Pipeline.from_pretrained(model, options(backend__name="torch-cudagraph"))


@pytest.mark.skipif(not NO_CUDA, reason="checks the message on machines without CUDA")
def test_gpu_check_script_without_cuda_says_so():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True)
    assert r.returncode == 2 and "needs an NVIDIA GPU" in r.stderr


def test_gpu_check_script_logic_on_cpu():
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--allow-cpu", "--preset", "tiny",
                        "--dtype", "float32", "--tiles-per-camera", "1", "--questions", "2", "--max-new-tokens", "4"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "cuda graph == static eager (capture changes nothing): 2/2" in r.stdout
    assert "batched cuda graph == batched static eager (capture changes nothing): 2/2" in r.stdout
    assert "torch-cudagraph 2/2" in r.stdout and "vs rows x 1-row step" in r.stdout     # both ran batched steps
    assert "low-bit matmuls within 0.01 of their float64 references: yes" in r.stdout
    assert "PASS" in r.stdout


def tensorrt_installed() -> bool:
    try:
        import_tensorrt()       # not fooled by tensorrt-stubs' importable tensorrt/ folder
    except LiteVLMError:
        return False
    return True


@pytest.mark.skipif(tensorrt_installed(), reason="checks the message where TensorRT is absent")
def test_tensorrt_absent_is_a_clear_error(model, tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "dtype": "float16", "graphs": [], "engines": {}}))
    with pytest.raises(LiteVLMError, match="TensorRT is not installed"):
        build_engines(tmp_path, "fp16")
    with pytest.raises(LiteVLMError, match="tensorrt runs on a CUDA device"):
        Pipeline.from_pretrained(model, options(backend__name="tensorrt", backend__bundle=str(tmp_path)))


def test_fp16_engines_need_a_float16_export(tmp_path):
    """Strongly typed engines keep the graph's types: an fp32 export would give fp32 engines."""
    (tmp_path / "manifest.json").write_text(json.dumps({"format": 1, "dtype": "float32", "graphs": [], "engines": {}}))
    with pytest.raises(LiteVLMError, match="exported in float32; .* fp16 engines are built from a float16 export"):
        build_engines(tmp_path, "fp16")


GPU = {"name": "NVIDIA Jetson AGX Thor", "compute_capability": "11.0"}


def fabricated_bundle(tmp_path: Path) -> tuple[dict, Path]:
    from litevlm_runtime.weights.integrity import sha256_file

    engine = tmp_path / "decoder_1.fp16.engine"
    engine.write_bytes(b"serialized engine bytes")
    manifest = {"format": 1, "engines": {"fp16": {
        "tensorrt": "10.13.3", "gpu": dict(GPU), "precision": "fp16",
        "files": {"decoder_1.onnx": {"engine": engine.name, "sha256": sha256_file(engine)}}}}}
    return manifest, tmp_path


def test_engine_check_accepts_matching_engines(tmp_path):
    manifest, bundle = fabricated_bundle(tmp_path)
    record = check_engines(manifest, bundle, "fp16", "10.13.3", dict(GPU))
    assert record["files"]["decoder_1.onnx"]["engine"] == "decoder_1.fp16.engine"


@pytest.mark.parametrize("change, message", [
    ("version", "built with TensorRT 10.13.3, this machine has TensorRT 10.14.1"),
    ("gpu", "built for NVIDIA Jetson AGX Thor .* this GPU is NVIDIA H100"),
    ("hash", "does not match its sha256"),
    ("missing", "missing engine decoder_1.fp16.engine"),
    ("precision", "no fp8 TensorRT engines"),
])
def test_engine_check_refuses_mismatches(tmp_path, change, message):
    manifest, bundle = fabricated_bundle(tmp_path)
    version, gpu, precision = "10.13.3", dict(GPU), "fp16"
    if change == "version":
        version = "10.14.1"
    elif change == "gpu":
        gpu = {"name": "NVIDIA H100", "compute_capability": "9.0"}
    elif change == "hash":
        (bundle / "decoder_1.fp16.engine").write_bytes(b"tampered")
    elif change == "missing":
        (bundle / "decoder_1.fp16.engine").unlink()
    elif change == "precision":
        precision = "fp8"
    with pytest.raises(LiteVLMError, match=message):
        check_engines(manifest, bundle, precision, version, gpu)
