"""`litevlm bench --peers` (bench/peers/): the same weights for every engine, the peers' processes
apart from this package, and the command as a user runs it at the small preset (the smallest whose
vision tower llama.cpp's converter maps: 4 layers) where a peer is installed (`bash scripts/setup.sh
--peers`); the rows of peers that are not installed skip."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from litevlm_runtime.bench.peers import env
from litevlm_runtime.bench.peers.models import BUNDLED, needs_rewrite, peer_form

ROOT = Path(__file__).resolve().parents[2]

llama_missing = env.llama_cpp_missing()
needs_llama = pytest.mark.skipif(llama_missing is not None, reason=f"llama.cpp peer: {llama_missing}")
openvino_missing = env.openvino_missing()
needs_openvino = pytest.mark.skipif(openvino_missing is not None, reason=f"OpenVINO peer: {openvino_missing}")


def frames(seed: int) -> dict:
    from litevlm_runtime.cameras import CAMERAS

    rng = np.random.default_rng(seed)
    return {c: rng.integers(0, 256, (90, 160, 3), dtype=np.uint8) for c in CAMERAS}


@pytest.fixture(scope="module")
def bundled_peer(tmp_path_factory) -> Path:
    return peer_form(BUNDLED, tmp_path_factory.mktemp("peer") / "bundled", progress=lambda m: None)


def test_peer_form_of_the_bundled_model_answers_as_the_bundled_model(bundled_peer):
    """The copy the peers' converters read (InternLM2 as Qwen2 with zero biases, the position
    embedding at the tile size, one-tile config, preprocessor_config.json) is the same function:
    this project's greedy answers from both folders are id for id the same."""
    from litevlm_runtime.options import options_from_flat
    from litevlm_runtime.pipeline.pipeline import Pipeline

    assert needs_rewrite(BUNDLED) and not needs_rewrite(bundled_peer)
    config = json.loads((bundled_peer / "config.json").read_text())
    assert config["llm_config"]["architectures"] == ["Qwen2ForCausalLM"]
    assert config["vision_config"]["image_size"] == config["force_image_size"] == 224
    assert config["max_dynamic_patch"] == 1
    opts = options_from_flat({"pipeline": "baseline", "backend.threads": 2, "serving.feature_cache": False})
    questions = ["What is in front of the ego car?", "Is there a pedestrian on the left?"]
    answers = {}
    for name, folder in (("bundled", BUNDLED), ("peer form", bundled_peer)):
        pipe = Pipeline.from_pretrained(folder, opts)
        answers[name] = [pipe.answer(frames(i), q).token_ids for i, q in enumerate(questions)]
    assert answers["bundled"] == answers["peer form"]
    assert all(answers["bundled"])


def test_prompt_text_tokenizes_to_the_project_prompt(bundled_peer):
    """What a peer tokenizes itself (the prompt as text, `<img>`..`</img>` around each camera's
    visual tokens) gives this project's prompt ids, for the bundled model's tokenizer."""
    from litevlm_runtime.bench.peers.whole import prompt_text
    from litevlm_runtime.cameras import CAMERAS
    from litevlm_runtime.stages.prompt import build_prompt, model_layout
    from litevlm_runtime.weights.checkpoint import read_config
    from litevlm_runtime.weights.tokenizer import Tokenizer

    tok = Tokenizer(bundled_peer)
    question = "What are the important objects in the current scene? <c1,CAM_FRONT,800.5,450.0>"
    n = 7
    text = prompt_text(bundled_peer, question, CAMERAS).replace("<image>", "<img>" + "<IMG_CONTEXT>" * n + "</img>")
    want = build_prompt(tok, read_config(bundled_peer).system_message, model_layout(bundled_peer)[0], CAMERAS,
                        question, n).input_ids
    assert tok._tok.encode(text, add_special_tokens=True).ids == list(want)


def test_peer_processes_start_without_this_package_or_its_thread_settings():
    """A peer's environment: none of the OMP_/KMP_/MKL_ variables this process carries (the package
    sets OMP_WAIT_POLICY at import), no venv library paths; the child imports nothing of ours."""
    assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE"         # what this package set at import
    clean = env.clean_env()
    assert not [k for k in clean if k.startswith(("OMP_", "KMP_", "MKL_", "GOMP_", "LITEVLM_"))]
    code = ("import json, os, sys; print(json.dumps([sorted(k for k in os.environ if k.startswith(('OMP_', 'MKL_'))),"
            " any(m.startswith('litevlm_runtime') for m in sys.modules)]))")
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [[], False]


def run_bench(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "litevlm_runtime.cli", "bench", "--peers", "--cache", str(tmp_path / "cache"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=ROOT)


@needs_llama
def test_whole_questions_small_llama_cpp(tmp_path, drivelm_dir):
    """The command as a user runs it, at the small preset: this project's reference row and llama.cpp's
    F16 row over files its own converter wrote; the rows of --json carry the issue's keys, llama.cpp
    tokenized the same prompt as this project (its image chunks where the <IMG_CONTEXT> runs are), ran
    with no thread variables and without this package, and decoded as many tokens as the reference.
    A second run reuses the files from the cache."""
    out = tmp_path / "rows.json"
    args = ["--whole", "--preset", "small", "--engines", "litevlm,llama.cpp", "--weights", "float", "--gguf", "f16",
            "--pipelines", "baseline", "--questions", "2", "--new-tokens", "6", "--json", str(out),
            "--drivelm", str(drivelm_dir)]
    proc = run_bench(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "writing text model F16" in proc.stderr and "writing mmproj F16" in proc.stderr
    rows = {(r["engine"], r["weights"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("litevlm", "float"), ("llama.cpp", "f16")}
    for r in rows.values():
        assert {"engine", "weights", "pipeline", "ttft_ms_p50", "total_ms_p50", "agree"} <= set(r)
        assert 0 < r["ttft_ms_p50"] <= r["total_ms_p50"]
        assert r["tiles_per_question"] == 6
    peer = rows[("llama.cpp", "f16")]
    assert peer["prompt_ids_equal"] == 1.0
    assert peer["environment"]["imports_litevlm"] is False and peer["environment"]["thread_env"] == {}
    assert peer["new_tokens"] == rows[("litevlm", "float")]["new_tokens"]
    assert rows[("litevlm", "float")]["agree"] == 1.0 and 0.0 <= peer["agree"] <= 1.0
    assert "llama.cpp" in proc.stdout and "x fastest peer" in proc.stdout
    again = run_bench(args, tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "writing text model" not in again.stderr           # the files came from the cache


@needs_llama
def test_decode_table_small_llama_cpp(tmp_path):
    """The decode-step table with the --hog column: a quiet and a loaded figure per row, the
    llama.cpp row teacher-forced on this project's float ids."""
    out = tmp_path / "decode.json"
    proc = run_bench(["--preset", "small", "--engines", "litevlm,llama.cpp", "--weights", "float,int8", "--gguf",
                      "q8_0", "--prompt", "16", "--tokens", "4", "--hog", "1", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["engine"], r["weights"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("litevlm", "float"), ("litevlm", "int8"), ("llama.cpp", "q8_0")}
    for r in rows.values():
        assert len(r["decode_ms"]) == 1 and len(r["loaded_ms"]) == 1
    assert rows[("llama.cpp", "q8_0")]["agree"].endswith("/5 steps")         # the prompt's id + 4 steps
    assert "--hog 1: ms/token" in proc.stdout


def test_peers_refuses_bad_flags(tmp_path):
    proc = run_bench(["--whole"], tmp_path)
    assert proc.returncode != 0 and "--model DIR or --preset NAME" in proc.stderr
    proc = run_bench(["--whole", "--preset", "tiny", "--gguf", "q5_k"], tmp_path)
    assert proc.returncode != 0 and "'q5_k' is not one of f16, q8_0, q4_0" in proc.stderr


@needs_openvino
@pytest.mark.slow
def test_openvino_export_of_a_project_folder_is_refused_and_recorded(tmp_path, bundled_peer):
    """optimum-intel's InternVL export needs upstream's remote code: on a folder this project wrote
    it fails, and the failure is recorded as the reason the OpenVINO rows are parts."""
    from litevlm_runtime.bench.peers import openvino_rows

    result = openvino_rows.prepare(bundled_peer, tmp_path / "cache", ["int8"], progress=lambda m: None)
    assert result["vlm_export"]["ok"] is False
    assert "internvl_chat" in result["vlm_export"]["error"]
    assert (result["llm"]["int8"] / "openvino_model.xml").is_file() and result["vision"].is_file()
