"""In-flight batching on the bound backends: ONNX Runtime and OpenVINO running the bundle's
batched decode step (one graph, a dynamic batch dimension, bound per batch bucket) and every KV
region's own step bindings; the batched step's padding rows and bucket choice (the plain-Python part the CUDA-graph
and TensorRT backends share, run here with capture off); which backends batch and why not.

Greedy answers of queries decoded together on ONNX Runtime and on OpenVINO are token for token
those of torch and of the same queries served one at a time (the lively tiny checkpoint: its answers differ from
question to question, so equality means something). The batched step's numbers against torch's
(1e-4, the project's ONNX tolerance) are in test_export.py (verify_bundle).
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from helpers import options, random_frames
from helpers.batching import serve
from helpers.export import BUNDLE_BACKENDS, MAX_NEW_TOKENS, exported_bundle, lively_checkpoint, pipelines

from litevlm_runtime.bench.benchmark import DEFAULT_QUESTIONS
from litevlm_runtime.engines import batch_limit
from litevlm_runtime.engines.buckets import Buckets, batch_sizes, default_batch, pick
from litevlm_runtime.engines.cuda_graph import cuda_graph_engines
from litevlm_runtime.engines.tensorrt_engine import batch_profiles, profile_of, profile_shapes
from litevlm_runtime.errors import LiteVLMError
from litevlm_runtime.pipeline.batching import BatchDecoder
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest

QUESTIONS = DEFAULT_QUESTIONS[:3]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    return lively_checkpoint(root), exported_bundle(root)


@pytest.fixture(scope="module", params=BUNDLE_BACKENDS)
def pipes(request, exported):
    model, bundle = exported
    return pipelines(model, bundle, backend=request.param)   # torch and the bundle backend, serving.max_batch 4


def compiled_graph(runner):
    """What a bound graph runs on, shared by its bindings: ONNX Runtime's session, OpenVINO's
    compiled model."""
    return runner.session if hasattr(runner, "session") else runner.compiled


@pytest.fixture(scope="module")
def frames():
    return [random_frames(s) for s in (31, 32)]


@pytest.fixture(scope="module")
def one_at_a_time(pipes, frames):
    """Every (frame set, question) answered alone, on torch and on the bundle backend."""
    return [{(i, q): p.answer(frames[i], q, frame_keys={c: i for c in frames[i]}).token_ids
             for i in range(len(frames)) for q in QUESTIONS} for p in pipes]


def test_bundle_backend_binds_the_batched_step_and_every_region(pipes):
    _, bound = pipes
    a, backend = bound.rt.arena, bound.rt.options.backend.name.value
    assert a.limits.batch == 4 and bound.rt.engines.batch.backend == backend and bound.rt.engines.batch.sizes == (2, 4)
    steps = [bound.rt.region(r).decoder for r in range(a.limits.batch)]
    assert [d.k_cache.data_ptr() for d in steps] == [a.k_regions[r].data_ptr() for r in range(4)]
    assert all(d.backend == backend for d in steps)
    # One session (compiled model) per graph file: each region's step bindings and both batch buckets share them.
    sessions = {id(compiled_graph(run)) for d in steps for run in d.step_runners.values()}
    assert len(sessions) == len(bound.rt.engines.decoder.sizes)
    assert len({id(compiled_graph(run)) for run in bound.rt.engines.batch.runners.values()}) == 1
    BatchDecoder(bound)
    assert bound.rt.region(2).decoder is steps[2]           # bound once per region


@pytest.mark.parametrize("pattern", ["together", "three_then_three", "staggered"])
def test_bundle_backend_batched_answers_equal_torch_and_one_at_a_time(pipes, frames, one_at_a_time, pattern):
    _, bound = pipes
    alone_torch, alone_bound = one_at_a_time
    assert alone_bound == alone_torch
    assert len({tuple(t) for t in alone_torch.values()}) >= 4                  # the answers differ
    qs = list(alone_torch)
    if pattern == "together":
        arrivals = [(0, i, q) for i, q in qs[:4]]
    elif pattern == "three_then_three":              # 3 rows run padded in the 4-bucket, then 2 and 1
        arrivals = [(0, i, q) for i, q in qs[:3]] + [(6, i, q) for i, q in qs[3:]]
    else:
        arrivals = [(3 * k, i, q) for k, (i, q) in enumerate(qs)]
    answers, widest = serve(bound, frames, arrivals)
    assert set(answers) == {(i, q) for _, i, q in arrivals}
    for key, ans in answers.items():
        assert ans.token_ids == alone_torch[key], key
    assert widest >= 3 and any(a.batched_steps for a in answers.values())


def test_a_query_left_alone_in_another_region_decodes_there(pipes, frames, one_at_a_time):
    """The query in region 1 outlives region 0's: it carries on alone in the backend's step
    graph bound over region 1, and its answer is still the one-at-a-time one."""
    _, bound = pipes
    keys = {c: 0 for c in frames[0]}
    batch = BatchDecoder(bound)
    short = batch.admit(frames[0], QueryRequest(QUESTIONS[0], max_new_tokens=3), frame_keys=keys, tag="short")
    long = batch.admit(frames[0], QUESTIONS[1], frame_keys=keys, tag="long")
    assert (short.region, long.region) == (0, 1)
    got = {r.tag: a for r, a in batch.run()}
    alone = one_at_a_time[0]
    assert got["short"].token_ids == alone[(0, QUESTIONS[0])][:3]
    assert got["long"].token_ids == alone[(0, QUESTIONS[1])]
    assert 0 < got["long"].batched_steps < len(got["long"].token_ids) - 1     # batched, then alone


@torch.inference_mode()
def test_padding_rows_of_a_partial_bucket_see_only_themselves(exported):
    """The bound batched step (what CUDA graphs capture and TensorRT runs; capture off here) with
    3 rows in its 4-bucket: the padding row has position 0, no cache column and only its own new
    row; it stores nothing; the 3 real rows equal eager torch's batched step."""
    model, _ = exported
    pipe = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS))
    rt = pipe.rt
    static = cuda_graph_engines(rt, capture=False, buckets=Buckets(vision=(4,), prefill=(256,), step=(1,), head=(1, 4),
                                                                   batch=(4,)))
    engine, a = static.batch, rt.arena
    assert engine.backend == "torch-static" and engine.sizes == (4,)
    g = torch.Generator().manual_seed(5)
    regions = torch.randn(a.k_regions.shape, generator=g), torch.randn(a.v_regions.shape, generator=g)
    history = torch.tensor([9, 20, 14])
    mask = torch.arange(20)[None, :] < history[:, None]
    call = (
        torch.randn(3, rt.cfg.llm.hidden_size, generator=g),
        history + 2,
        history,
        mask,
        torch.eye(3, dtype=torch.bool),
    )
    out = []
    for eng in (rt.engines.batch, engine):
        a.k_regions.copy_(regions[0])
        a.v_regions.copy_(regions[1])
        out.append((eng.step(*call).clone(), a.k_regions.clone(), a.v_regions.clone()))
    rows = engine.rows
    assert rows.positions[4][3] == 0 and not rows.mask_cache[4][3].any()
    assert rows.mask_new[4][3].tolist() == [False, False, False, True] and not rows.mask_new[4][:3, 3].any()
    assert torch.isfinite(rows.hidden[4]).all()
    (want, k_want, v_want), (got, k_got, v_got) = out
    assert got.shape == (3, rt.cfg.llm.hidden_size)
    assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
    assert torch.equal(k_got[3], regions[0][3]) and torch.equal(v_got[3], regions[1][3])    # region 3 untouched
    for r, slot in enumerate(history.tolist()):
        assert torch.allclose(k_got[r, :, :, slot], k_want[r, :, :, slot], atol=1e-5)
        untouched = torch.ones(a.max_len, dtype=torch.bool)
        untouched[slot] = False
        assert torch.equal(k_got[r][:, :, untouched], regions[0][r][:, :, untouched])


def test_batch_bucket_choice():
    assert default_batch(1) == () and default_batch(2) == (2,) and default_batch(4) == (2, 3, 4)
    assert default_batch(6) == (2, 3, 4, 6) and default_batch(16) == (2, 3, 4, 8, 16)
    assert batch_sizes((2, 4), 4, "x") == (2, 4) and batch_sizes((2, 4), 3, "x") == (2, 3)
    assert batch_sizes((2, 4), 1, "x") == () and batch_sizes((), 4, "x") == ()
    with pytest.raises(LiteVLMError, match="serving.max_batch 8: the bundle B decodes at most 4 queries"):
        batch_sizes((2, 4), 8, "the bundle B")
    assert pick((2, 4), 3, "decoder_batch") == 4
    with pytest.raises(LiteVLMError, match="--buckets 'batch=...'"):
        pick((2, 4), 5, "decoder_batch")
    with pytest.raises(LiteVLMError, match="batch sizes are 2 or more"):
        Buckets(vision=(1,), prefill=(8,), step=(1,), head=(1,), batch=(1, 4))
    # TensorRT: one profile per bucket, opt = max = the bucket, min just above the one below
    assert batch_profiles([2, 4, 8]) == [(2, 2, 2), (3, 4, 4), (5, 8, 8)]
    assert [profile_of([2, 4], n) for n in (2, 3, 4)] == [0, 1, 1]
    graph = {"buckets": [2, 4], "inputs": [{"name": "embeds", "shape": ["batch", 8]},
                                           {"name": "mask_new", "shape": ["batch", "batch"]}]}
    assert profile_shapes(graph)[1] == {"embeds": ([3, 8], [4, 8], [4, 8]),
                                        "mask_new": ([3, 3], [4, 4], [4, 4])}
    assert profile_shapes({"inputs": []}) == []


def test_which_bundles_batch(exported, tmp_path, caplog):
    """A bundle's batched step decides: none (an older export), one of another precision than
    its decode steps (calibrated), a TensorRT record without its engine -> one query at a
    time, said in the log; more queries than it was exported for -> an error naming both."""
    model, bundle = exported
    ort = dict(serving__max_batch=4, backend__name="onnxruntime", backend__bundle=str(bundle))
    assert batch_limit(options(**ort)) == (4, "")
    assert batch_limit(options(**{**ort, "serving__max_batch": 3}))[0] == 3
    with pytest.raises(LiteVLMError, match="serving.max_batch 8: .* at most 4 queries"):
        batch_limit(options(**{**ort, "serving__max_batch": 8}))
    three = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, **{**ort, "serving__max_batch": 3}))
    assert three.rt.engines.batch.sizes == (2, 3)           # the dynamic graph at this runtime's own size

    old = tmp_path / "old"
    shutil.copytree(bundle, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["graphs"] = [g for g in manifest["graphs"] if g["stage"] != "decoder_batch"]
    (old / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING, logger="litevlm.runtime"):
        pipe = Pipeline.from_pretrained(
            model, options(max_new_tokens=MAX_NEW_TOKENS, **{**ort, "backend__bundle": str(old)})
        )
    assert pipe.rt.arena.limits.batch == 1 and pipe.rt.engines.batch is None
    assert "serving.max_batch 4 -> 1" in caplog.text and "no batched decode step graph" in caplog.text

    manifest = json.loads((bundle / "manifest.json").read_text())
    for g in manifest["graphs"]:
        if g["stage"] == "decoder":
            g["precision"] = "int8"
    (old / "manifest.json").write_text(json.dumps(manifest))
    n, why = batch_limit(options(**{**ort, "backend__bundle": str(old)}))
    assert n == 1 and "calibration quantizes only" in why

    manifest["graphs"] = [dict(g, precision="float32") for g in manifest["graphs"]]
    manifest["engines"] = {
        "fp16": {"files": {g["file"]: {} for g in manifest["graphs"] if g["stage"] != "decoder_batch"}}
    }
    (old / "manifest.json").write_text(json.dumps(manifest))
    n, why = batch_limit(options(**{**ort, "backend__name": "tensorrt", "backend__bundle": str(old)}))
    assert n == 1 and "build-engines" in why
