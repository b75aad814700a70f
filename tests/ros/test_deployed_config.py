"""The deployed configuration is the default, it is typed and validated, and it runs where the
car runs it: LiteVLM on the bundled model (views, tokens, EAGLE-2), every tensor on the
pipeline's device (a meta default device catches any factory call that forgets it), and the
same configuration in bfloat16 and float16."""

from pathlib import Path

import pytest
import torch
import yaml
from helpers import options, random_frames

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.errors import InputError
from litevlm_runtime.options import (
    BackendName,
    DecodingMode,
    PipelineOptions,
    TokenMode,
    ViewMode,
    add_option_flags,
    flat_from_options,
    options_from_args,
    options_from_flat,
    settings,
)
from litevlm_runtime.pipeline.pipeline import Pipeline

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["What is in front of the ego vehicle?", "Is there a pedestrian behind the ego car?",
             "What should the ego vehicle do next?"]


@pytest.fixture(scope="module")
def frames():
    return random_frames(1, 270, 480)


def test_defaults_resolve_to_litevlm_on_the_bundled_model():
    opts = PipelineOptions().resolved(DEFAULT_MODEL)
    assert opts.views.mode == ViewMode.SELECTOR and opts.tokens.mode == TokenMode.SELECTOR
    assert opts.decoding.mode == DecodingMode.EAGLE and opts.tokens.keep_ratio == 0.8
    assert opts.label() == "litevlm[views,tokens@0.8,eagle]"
    assert PipelineOptions(pipeline="baseline").resolved(DEFAULT_MODEL).label() == "baseline"
    # an explicit module under the baseline pipeline is the ablation row "+EAGLE"
    assert options(pipeline="baseline", decoding__mode="eagle").resolved(DEFAULT_MODEL).label() == "litevlm[eagle]"
    # the paper's r at FP8 on TensorRT
    trt = options(backend__name="tensorrt", backend__precision="fp8").resolved(DEFAULT_MODEL)
    assert trt.tokens.keep_ratio == 0.9


def test_a_module_asked_for_but_absent_names_its_folder(tiny_model):
    assert PipelineOptions().resolved(tiny_model).label() == "baseline"      # auto: nothing there, nothing on
    with pytest.raises(InputError, match=r"decoding.mode eagle: no model.safetensors in .*eagle"):
        options(decoding__mode="eagle").resolved(tiny_model)
    with pytest.raises(InputError, match="views.mode selector"):
        options(views__mode="selector").resolved(tiny_model)


@pytest.mark.parametrize("settings_, msg", [
    ({"tokens.keep_ratio": 1.5}, "tokens.keep_ratio: 1.5 is above its maximum 1.0"),
    ({"decoding.mode": "beam"}, "decoding.mode: 'beam' is not one of auto, greedy, eagle"),
    ({"backend.name": "tpu"}, "backend.name: 'tpu' is not one of"),
    ({"tiles_per_camera": 3}, "tiles_per_camera: 3 is not one of"),
    ({"max_new_tokens": "lots"}, "max_new_tokens: 'lots' is not a int"),
    ({"eagle_top_k": 7}, "unknown setting"),
    ({"fastv.ratio": 0.5, "backend.name": "onnxruntime"}, "FastV prunes inside the decoder"),
])
def test_settings_are_validated_where_built(settings_, msg):
    with pytest.raises(InputError, match=msg):
        options_from_flat(settings_)


def test_one_name_per_setting_everywhere():
    import argparse

    keys = [s.key for s in settings()]
    assert len(keys) == len(set(keys))
    assert "decoding.eagle.topk" in keys and "backend.bundle" in keys and "backend.precision" in keys
    assert not any(k in keys for k in ("eagle_top_k", "eagle_topk", "topk", "precision", "extra"))
    parser = argparse.ArgumentParser()
    add_option_flags(parser)
    args = parser.parse_args(["--model", "m", "--decoding.eagle.topk", "7", "--tokens.keep_ratio", "0.9",
                              "--set", "backend.threads=1"])
    opts = options_from_args(args)
    assert (opts.decoding.eagle.topk, opts.tokens.keep_ratio, opts.backend.threads) == (7, 0.9, 1)
    assert options_from_flat(flat_from_options(opts)) == opts


def test_shipped_drive_yaml_is_the_deployed_configuration():
    """config/drive.yaml names every pipeline setting (nested as ROS 2 reads dotted names) and
    resolves, on the bundled model, to the LiteVLM pipeline."""
    from litevlm_runtime.ros.parameters import flatten, node_section, pipeline_options_from
    from litevlm_runtime.ros.params_file import load_node_params

    doc = yaml.safe_load((ROOT / "config" / "drive.yaml").read_text())
    given = flatten(node_section(doc, "litevlm_drive"))
    assert {s.key for s in settings()} <= set(given)
    opts = pipeline_options_from(load_node_params(None))
    assert opts.resolved(DEFAULT_MODEL).label() == "litevlm[views,tokens@0.8,eagle]"
    assert opts.backend.name == BackendName.TORCH


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_every_tensor_lives_on_the_pipeline_device(frames, policy):
    """With the default device set to meta, any tensor a stage creates without device= is a meta
    tensor, and mixing it with the pipeline's CPU tensors fails: the answer must still be exact."""
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, options(decoding__eagle__policy=policy))
    assert pipe.rt.options.label() == "litevlm[views,tokens@0.8,eagle]"
    for question in QUESTIONS:
        want = pipe.answer(frames, question)
        with torch.device("meta"):
            got = pipe.answer(frames, question)
        assert got.token_ids == want.token_ids
    sampled = Pipeline.from_pretrained(DEFAULT_MODEL, options(decoding__temperature=0.7, decoding__seed=2,
                                                              decoding__eagle__policy=policy))
    want = sampled.answer(frames, QUESTIONS[0])
    with torch.device("meta"):                       # sampling: rejection sampling's draws too
        assert sampled.answer(frames, QUESTIONS[0]).token_ids == want.token_ids


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=pytest.mark.slow), "float16"])  # (no bf16 units here)
def test_litevlm_in_half_precision_on_the_cpu(frames, dtype):
    """The deployed configuration in bf16/fp16: every stage runs, and EAGLE-2 stays lossless
    against greedy decoding in the same dtype."""
    lite = Pipeline.from_pretrained(DEFAULT_MODEL, options(dtype=dtype, decoding__eagle__policy="fixed"))
    greedy = Pipeline.from_pretrained(DEFAULT_MODEL, options(dtype=dtype, decoding__mode="greedy"))
    assert lite.rt.arena.k_cache.dtype == getattr(torch, dtype)
    for question in QUESTIONS:
        a, b = lite.answer(frames, question), greedy.answer(frames, question)
        assert a.pipeline == "litevlm[views,tokens@0.8,eagle]" and a.token_ids and len(a.cameras) <= 6
        assert a.token_ids == b.token_ids
