"""The whole pipeline on an InternVL3.5-shaped tiny checkpoint (preset `tiny-qwen3`: a Qwen3 decoder
whose head_dim 64 is not hidden / heads, per-head q/k norms, a tied LM head).

What users run: `litevlm ask` and `bench` (its transformers reference included), `bag eval` on a
recorded bag, the ONNX bundle (every graph against the torch stage, whole answers against the
torch backend), and `litevlm train views|tokens|eagle` writing modules the pipeline then loads.
"""

from __future__ import annotations

import json

import pytest
import torch
from helpers import lively_checkpoint_of, options, random_frames
from helpers.export import TEST_BUCKETS

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS, paired_speedups
from litevlm_runtime.cli import main
from litevlm_runtime.export.exporter import verify_bundle
from litevlm_runtime.pipeline.answer import Answer
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.weights.checkpoint import load_model

MAX_NEW_TOKENS = 12


@pytest.fixture(scope="module")
def qwen3_model(tmp_path_factory):
    """tiny-qwen3 with std 0.1 weights, so that greedy answers depend on the input (helpers/export.py)."""
    lively = lively_checkpoint_of(tmp_path_factory.mktemp("qwen3"), "tiny-qwen3")
    lm = load_model(lively).language_model
    assert lm.cfg.architecture == "qwen3" and lm.cfg.head_dim == 64
    return lively


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from litevlm_runtime.synth.generate import SynthSpec, generate

    out = tmp_path_factory.mktemp("synth_qwen3")
    generate(out, SynthSpec(scenes=6, seed=3, width=160, height=90, val_fraction=0.0), workers=1, progress=False)
    return out


def test_ask_and_bench(qwen3_model, synth, capsys):
    assert main(["ask", "--model", str(qwen3_model), "--frames", str(synth), "--question", DEFAULT_QUESTIONS[0],
                 "--max_new_tokens", "4", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert 1 <= len(answer["token_ids"]) <= 4 and answer["visual_tokens"] == 6 * 16
    assert set(answer) == set(Answer().to_dict())          # the record's JSON shape (test_answer_fields.py)
    assert main(["bench", "--model", str(qwen3_model), "--frames", str(synth), "--repeat", "1",
                 "--max_new_tokens", "4", "--tokens.mode", "layer0", "--tokens.keep_ratio", "0.5"]) == 0
    out = capsys.readouterr().out
    for stage in ("vision", "token_select", "prefill", "decode", "transformers generate"):
        assert stage in out
    assert "identical answers: " in out
    assert "query by query (paired): median " in out and "whole run (total time): " in out


def test_paired_speedups_pair_each_query_with_its_own_reference():
    got = paired_speedups([10.0, 20.0, 40.0, 30.0], [5.0, 20.0, 10.0, 10.0])       # per query 2, 1, 4, 3
    assert got == {"speedup_paired_median": 2.5, "speedup_paired_min": 1.0, "speedup_paired_max": 4.0,
                   "speedup_total": 100.0 / 45.0}


def test_onnx_bundle_matches_torch(qwen3_model, tmp_path):
    spec = ";".join(f"{k}={','.join(map(str, v))}" for k, v in TEST_BUCKETS.to_dict().items())
    bundle = tmp_path / "bundle"
    assert main(["export", "--model", str(qwen3_model), "--out", str(bundle), "--max_new_tokens", str(MAX_NEW_TOKENS),
                 "--buckets", spec]) == 0
    torch_pipe = Pipeline.from_pretrained(qwen3_model, options(max_new_tokens=MAX_NEW_TOKENS))
    worst = max(verify_bundle(torch_pipe.rt, bundle), key=lambda r: r["rel_error"])
    assert worst["rel_error"] <= 1e-4, worst
    ort_pipe = Pipeline.from_pretrained(qwen3_model, options(max_new_tokens=MAX_NEW_TOKENS, backend__name="onnxruntime",
                                                             backend__bundle=str(bundle)))
    answers = []
    with torch.no_grad():
        for i, question in enumerate(DEFAULT_QUESTIONS[:4]):
            frames = random_frames(i)
            ref, got = torch_pipe.answer(frames, question), ort_pipe.answer(frames, question)
            assert got.token_ids == ref.token_ids, question
            answers.append(tuple(ref.token_ids))
    assert len(set(answers)) >= 2          # identical answers mean something only if they vary


def test_bag_eval(qwen3_model, tmp_path):
    from helpers.bag import jpeg_frames, mcap_ros2_bag, tiny_params

    from litevlm_runtime.bag.evaluate import evaluate

    bag = mcap_ros2_bag(tmp_path / "v.mcap", jpeg_frames(1))
    records = evaluate(bag, tiny_params(qwen3_model))
    assert [r.status for r in records] == ["ok", "ok"], [r.status_message for r in records]


def test_train_views_tokens_eagle_write_modules_the_pipeline_runs(qwen3_model, synth, tmp_path):
    import shutil

    model = tmp_path / "model"
    shutil.copytree(qwen3_model, model)
    data = str(synth / "train.json")
    assert main(["train", "views", "--data", data, "--model", str(model), "--frames-holdout", "0", "--epochs", "1",
                 "--width", "64", "--layers", "2", "--heads", "2", "--max-len", "64", "--batch-size", "16"]) == 0
    threads = torch.get_num_threads()
    try:
        assert main(["train", "tokens", "--model", str(model), "--data", data, "--frames", str(synth),
                     "--out", str(model / "token_selector"), "--steps", "4", "--batch", "2", "--max-samples", "8",
                     "--eval-samples", "4", "--eval-questions", "1", "--max-new-tokens", "2", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert main(["train", "eagle", "--model", str(model), "--data", data, "--frames", str(synth), "--samples", "4",
                 "--holdout", "1", "--epochs", "1", "--max-new-tokens", "4", "--out", str(model / "eagle"),
                 "--tree", "8,3,3"]) == 0
    selector = json.loads((model / "token_selector" / "config.json").read_text())
    assert selector["architecture"] == "litevlm_token_selector"
    pipe = Pipeline.from_pretrained(model, options(
        max_new_tokens=4, views__mode="selector", tokens__mode="selector", tokens__keep_ratio=0.5,
        tokens__selector_dir=str(model / "token_selector"), decoding__mode="eagle",
        decoding__draft_dir=str(model / "eagle")))
    answer = pipe.answer(random_frames(0), DEFAULT_QUESTIONS[1])
    assert 1 <= len(answer.token_ids) <= 4
    assert answer.kept_tokens < answer.visual_tokens
