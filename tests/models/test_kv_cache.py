"""The quantized KV cache (arena.kv_dtype int8 | fp8, models/kv_cache.py): its rounding against
float64 bounds, its indexing against a float cache holding the same values, attention reading it
dequantized in every backend that keeps a cache (torch eager, the bound static stages torch-compile
and CUDA graphs run, the ONNX bundle's step graphs and batched step), and the arena's bytes.

Tolerances: int8 |x - value| <= scale / 2, fp8 <= 2^-4 |x| + scale * 2^-10 (float64 reference); a
step over a quantized cache against the float step over the cache's dequantized values: 1e-5 of the
largest hidden value (the same numbers, another summation order); ONNX Runtime against torch 1e-5."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import options, random_frames
from helpers.export import MAX_NEW_TOKENS, TEST_BUCKETS, lively_checkpoint

from litevlm_runtime.models.kv_cache import QuantizedKV, dequantize_codes, fp8_decode, quantize_rows
from litevlm_runtime.pipeline.request import QueryRequest


def rows(seed=0, shape=(3, 2, 50, 32)) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.rand(shape[:-1], generator=g)[..., None] * 4
    x[0, 0, 0] = 0.0                                             # an all-zero row
    x[0, 0, 1] = 1e-7                                            # a tiny one (scale at its float16 floor)
    return x


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_rounding_within_its_bound_against_float64(kind):
    x = rows()
    codes, scales = quantize_rows(x, kind)
    assert codes.dtype == (torch.int8 if kind == "int8" else torch.uint8) and scales.dtype == torch.float16
    value = dequantize_codes(codes, scales, torch.float64)
    err = (value - x.double()).abs()
    s = scales.double()[..., None]
    bound = s / 2 if kind == "int8" else x.double().abs() * 2.0 ** -4 + s * 2.0 ** -10
    assert bool((err <= bound * (1 + 1e-12)).all()), float((err / bound).max())
    # the largest element of every row fits (the scale is rounded up to float16)
    assert bool((x.abs().amax(-1).double() <= scales.double() * (127 if kind == "int8" else 448)).all())
    if kind == "fp8":             # the codes are E4M3 as ml_dtypes rounds it (nearest even)
        want = (x / scales.float()[..., None]).numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        assert np.array_equal(codes.numpy(), want)


def test_fp8_decode_is_e4m3():
    """The graphs' arithmetic decode of every finite E4M3 bit pattern equals ml_dtypes' value."""
    decoded = fp8_decode(torch.arange(256).to(torch.uint8)).numpy()
    bits = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = np.isfinite(bits)
    assert np.array_equal(decoded[finite], bits[finite]) and (~finite).sum() == 2


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_indexing_matches_a_float_cache(kind):
    """Every way the runtime touches a cache, on a QuantizedKV and on a float tensor holding its
    values: the same values come out (rows copied between quantized caches keep their codes)."""
    q = QuantizedKV.of(rows(1, (2, 3, 2, 40, 32)), kind)        # [regions, layers, heads, S, D]
    f = q.dequantize()
    new = rows(2, (3, 2, 5, 32))
    slots = torch.tensor([7, 3, 30, 31, 0])
    q[1].index_copy_(2, slots, new)
    f[1].index_copy_(2, slots, QuantizedKV.of(new, kind).dequantize())
    batch = rows(3, (2, 3, 2, 32))                               # one row per region at its own slot
    q[torch.tensor([0, 1]), :, :, torch.tensor([5, 9])] = batch
    f[torch.tensor([0, 1]), :, :, torch.tensor([5, 9])] = QuantizedKV.of(batch, kind).dequantize()
    src = torch.tensor([30, 31])
    q[0][:, :, 10:12] = q[1][:, :, src]                          # EAGLE-2's accepted rows, a turn restored
    f[0][:, :, 10:12] = f[1][:, :, src]
    turns = QuantizedKV.zeros((1, 3, 2, 40, 32), kind, "cpu")
    turns[0, :, :, :20] = q[0][:, :, :20]
    assert torch.equal(turns[0, :, :, :20].codes, q[0][:, :, :20].codes)
    assert torch.equal(q.dequantize(), f)
    assert torch.equal(q[:, :, :, :12].transpose(0, 1).dequantize(), f[:, :, :, :12].transpose(0, 1))
    assert all(torch.equal(a.dequantize(), b) for a, b in zip(q.unbind(1), f.unbind(1)))
    with pytest.raises(IndexError):
        q[0, 0, 0, 0, 0]                                          # never inside head_dim


def pipelines(kv: str, **settings):
    from litevlm_runtime.pipeline.pipeline import Pipeline

    model = lively_checkpoint(_root())
    make = lambda **kw: Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, **kw))  # noqa: E731
    return make(**settings), make(arena__kv_dtype=kv, **settings)


_ROOT = []


def _root():
    return _ROOT[0]


@pytest.fixture(autouse=True, scope="module")
def root(tmp_path_factory):
    _ROOT[:] = [tmp_path_factory.getbasetemp()]


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_attention_reads_the_dequantized_cache(kind):
    """A step over the quantized cache computes what a float step over its dequantized values
    does; the rows it stores are those rows quantized."""
    plain, quant = pipelines(kind, serving__max_batch=1)
    a, b = plain.rt.arena, quant.rt.arena
    g = torch.Generator().manual_seed(0)
    d = plain.rt.cfg.llm.hidden_size
    b.k_cache.copy_(torch.randn(b.k_cache.shape, generator=g))
    b.v_cache.copy_(torch.randn(b.v_cache.shape, generator=g))
    a.k_cache.copy_(b.k_cache.dequantize())
    a.v_cache.copy_(b.v_cache.dequantize())
    emb = torch.randn(3, d, generator=g)
    args = (emb, torch.tensor([60, 61, 62]), torch.tensor([60, 61, 62]), torch.ones(3, 60, dtype=torch.bool),
            torch.ones(3, 3, dtype=torch.bool).tril_())
    with torch.inference_mode():
        want = plain.rt.engines.decoder.step(*args).clone()
        got = quant.rt.engines.decoder.step(*args).clone()
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())
    stored = b.k_cache[:, :, 60:63]
    assert torch.equal(stored.codes, QuantizedKV.of(a.k_cache[:, :, 60:63], kind).codes)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_arena_kv_bytes(kind):
    plain, quant = pipelines(kind, serving__max_batch=2, serving__conversations=2)
    a, b = plain.rt.arena, quant.rt.arena
    head_dim = plain.rt.cfg.llm.head_dim
    float_kv = a.kv_nbytes() - a.nbytes(("draft_k", "draft_v"))       # the draft's cache stays float
    quant_kv = b.kv_nbytes() - b.nbytes(("draft_k", "draft_v"))
    assert quant_kv == pytest.approx(float_kv * (head_dim + 2) / (4 * head_dim), rel=1e-9)   # float32 -> 8 bits + scale
    assert b.nbytes() < a.nbytes()


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_static_stages_equal_eager(kind):
    """The bound static stages (what torch-compile compiles and CUDA graphs capture, run eagerly
    here) over the quantized cache: greedy answers token for token those of eager torch, one at a
    time and batched."""
    from helpers.batching import serve

    from litevlm_runtime.engines.cuda_graph import cuda_graph_engines

    _, eager = pipelines(kind, serving__max_batch=2)
    _, static = pipelines(kind, serving__max_batch=2)
    from dataclasses import replace

    static.rt.engines = cuda_graph_engines(static.rt, capture=False, buckets=replace(TEST_BUCKETS, batch=(2,)))
    frames = random_frames(11)
    questions = ["What is in front of the ego car?", "Is there a car behind?"]
    for q in questions:
        assert static.answer(frames, q).token_ids == eager.answer(frames, q).token_ids
    keys = {c: 0 for c in frames}
    alone = {(0, q): static.answer(frames, q, frame_keys=keys).token_ids for q in questions}
    batched, widest = serve(static, [frames], [(0, 0, q) for q in questions])
    assert widest == 2 and {k: a.token_ids for k, a in batched.items()} == alone


# (an export and its verification: ~25 s each on 2 cores; FP8's graph-side decode is proven against
# ml_dtypes above, so CI runs the INT8 bundle and the FP8 one runs with the slow tests)
@pytest.mark.parametrize("kind", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
def test_onnx_bundle_with_a_quantized_cache(kind, tmp_path):
    """`litevlm export --arena.kv_dtype KIND --verify`: the step graphs take codes and scales (fp8 as
    its bit pattern, decoded arithmetically in the graph), every stage equal to torch; the bundle refuses
    a pipeline with another kv_dtype; greedy answers equal torch's, one at a time and batched."""
    from helpers.batching import serve

    from litevlm_runtime.cli import main
    from litevlm_runtime.errors import LiteVLMError

    model = lively_checkpoint(_root())
    spec = ";".join(f"{k}={','.join(map(str, v))}" for k, v in TEST_BUCKETS.to_dict().items())
    out = tmp_path / "bundle"
    assert main(["export", "--model", str(model), "--out", str(out), "--max_new_tokens", str(MAX_NEW_TOKENS),
                 "--buckets", spec, "--arena.kv_dtype", kind, "--verify"]) == 0
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    step = next(g for g in manifest["graphs"] if g["stage"] == "decoder")
    inputs = {i["name"]: i["dtype"] for i in step["inputs"]}
    assert inputs["k_cache"] == ("int8" if kind == "int8" else "uint8") and inputs["k_cache_scale"] == "float16"
    from litevlm_runtime.pipeline.pipeline import Pipeline

    with pytest.raises(LiteVLMError, match="kv_dtype"):
        Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, backend__name="onnxruntime",
                                                backend__bundle=str(out)))
    ort = Pipeline.from_pretrained(model, options(max_new_tokens=MAX_NEW_TOKENS, backend__name="onnxruntime",
                                                  backend__bundle=str(out), arena__kv_dtype=kind, serving__max_batch=2))
    _, eager = pipelines(kind, serving__max_batch=2)
    frames = random_frames(12)
    questions = ["What should the ego car do?", "Are there pedestrians on the left?"]
    keys = {c: 0 for c in frames}
    alone = {(0, q): eager.answer(frames, q, frame_keys=keys).token_ids for q in questions}
    assert {(0, q): ort.answer(frames, q, frame_keys=keys).token_ids for q in questions} == alone
    batched, widest = serve(ort, [frames], [(0, 0, q) for q in questions])
    assert widest == 2 and {k: a.token_ids for k, a in batched.items()} == alone


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_follow_up_and_prefix_reuse_the_quantized_rows(kind):
    """The prompt prefix and the conversation turns are kept as codes: a follow-up reuses its
    turn's rows (the codes copied, not re-rounded) and answers; the prefix's codes are those the
    prefill stored."""
    _, pipe = pipelines(kind, serving__max_batch=1, decoding__mode="greedy")
    a, prefix = pipe.rt.arena, pipe.rt.prefix
    assert prefix is not None and isinstance(prefix.k, QuantizedKV)
    frames = random_frames(13)
    keys = {c: 0 for c in frames}
    first = pipe.answer(frames, QueryRequest("Is there a car behind?", query_id="t1", keep_turn=True), frame_keys=keys)
    assert first.reused_tokens == 0
    turn = pipe.rt.conversations.turns["t1"]
    n = len(turn.rows)
    assert torch.equal(a.k_turns[turn.slot, :, :, :n].codes, a.k_cache[:, :, :n].codes)
    p = len(prefix.ids)
    assert torch.equal(a.k_cache[:, :, :p].codes, prefix.k[:, :, :p].codes)       # the prefix, reused as codes
    follow = pipe.answer(frames, QueryRequest("Is it moving?", query_id="t2", follow_up_of="t1", keep_turn=True),
                         frame_keys=keys)
    assert follow.reused_tokens > 0 and follow.token_ids
    assert torch.equal(
        a.k_cache[:, :, : follow.reused_tokens].codes, a.k_turns[turn.slot, :, :, : follow.reused_tokens].codes
    )
