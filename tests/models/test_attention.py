"""The eager attention `attend` runs (models/decoder.py) against a float64 recomputation: a causal
prompt of many rows, which the CPU path computes CAUSAL_CHUNK_ROWS rows at a time, with and without
an old cache; a mask that lets a row see a later one, which must not be chunked.

Tolerance: 1e-5 of the largest output (float32 softmax and sums over <= 400 columns, in a different
order from the float64 reference; measured 2e-7 to 4e-7).
"""

from __future__ import annotations

import pytest
import torch

from litevlm_runtime.models.decoder import CAUSAL_CHUNK_ROWS, attend, attend_grouped, in_chunks


def _inputs(t: int, old: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(t, h, 32, generator=g) for h in (8, 4, 4))
    k_cache, v_cache = torch.randn(4, old, 32, generator=g), torch.randn(4, old, 32, generator=g)
    return q, k, v, k_cache, v_cache


def _reference(q, k, v, mask_new, k_cache, v_cache, mask_cache):
    d = lambda x: None if x is None else x.double()
    return attend_grouped(d(q), d(k), d(v), mask_new, d(k_cache), d(v_cache), mask_cache)


@torch.inference_mode()
@pytest.mark.parametrize("t,old", [(CAUSAL_CHUNK_ROWS + 1, 0), (150, 48), (3 * CAUSAL_CHUNK_ROWS, 7)])
def test_causal_prompt_in_chunks_matches_float64(t, old):
    q, k, v, k_cache, v_cache = _inputs(t, old, seed=t + old)
    mask_new = torch.ones(t, t, dtype=torch.bool).tril()
    mask_cache = torch.ones(t, old, dtype=torch.bool)
    mask_cache[:, :3] = False                                   # dead cache columns stay dead in every chunk
    caches = (k_cache, v_cache, mask_cache) if old else (None, None, None)
    got = attend(q, k, v, mask_new, *caches)
    want = _reference(q, k, v, mask_new, *caches)
    assert got.shape == (t, 8 * 32)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@torch.inference_mode()
def test_a_mask_that_sees_later_rows_is_attended_whole():
    t, old = 2 * CAUSAL_CHUNK_ROWS, 16
    q, k, v, k_cache, v_cache = _inputs(t, old, seed=5)
    mask_new = torch.ones(t, t, dtype=torch.bool).tril()
    mask_new[0, t - 1] = True                   # row 0 sees the last row: chunking would drop that column
    mask_cache = torch.ones(t, old, dtype=torch.bool)
    got = attend(q, k, v, mask_new, k_cache, v_cache, mask_cache)
    want = _reference(q, k, v, mask_new, k_cache, v_cache, mask_cache)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())


@torch.inference_mode()
def test_which_masks_are_attended_in_chunks():
    c = CAUSAL_CHUNK_ROWS
    causal = torch.ones(3 * c, 3 * c, dtype=torch.bool).tril()
    assert in_chunks(causal)
    assert not in_chunks(causal[:c, :c])                        # one chunk's rows: one call anyway
    within = causal.clone()
    within[0, c - 1] = True                                     # a later row of the same chunk: still exact
    assert in_chunks(within)
    across = causal.clone()
    across[c - 1, c] = True                                     # the first row of the next chunk: not
    assert not in_chunks(across)


@torch.inference_mode()
def test_a_row_that_sees_a_later_row_of_its_own_chunk_is_exact():
    t, old = 2 * CAUSAL_CHUNK_ROWS + 5, 9
    q, k, v, k_cache, v_cache = _inputs(t, old, seed=11)
    mask_new = torch.ones(t, t, dtype=torch.bool).tril()
    mask_new[3, CAUSAL_CHUNK_ROWS - 1] = True
    mask_new[CAUSAL_CHUNK_ROWS + 1, 2 * CAUSAL_CHUNK_ROWS - 2] = True
    mask_cache = torch.ones(t, old, dtype=torch.bool)
    assert in_chunks(mask_new)
    got = attend(q, k, v, mask_new, k_cache, v_cache, mask_cache)
    want = _reference(q, k, v, mask_new, k_cache, v_cache, mask_cache)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())



@torch.inference_mode()
@pytest.mark.parametrize("t,old", [(1, 40), (5, 40), (CAUSAL_CHUNK_ROWS + 3, 9)])
def test_rows_written_into_the_cache_attend_as_concatenated_rows_do(t, old):
    """LayerCall.rows_in_cache: the call's k, v written into the cache's free tail and the cache read as
    it is (no concatenation) gives the float64 recomputation, and the tail holds exactly the rows."""
    from litevlm_runtime.models.decoder import LayerCall

    q, k, v, k_cache, v_cache = _inputs(t, old, seed=11 * t + old)
    mask_new = torch.ones(t, t, dtype=torch.bool).tril()
    mask_new[-1, 0] = False                                     # any mask among the new rows, not only causal
    mask_cache = torch.ones(t, old, dtype=torch.bool)
    mask_cache[:, 2] = False
    room_k = torch.cat([k_cache, torch.full((4, t, 32), float("nan"))], 1)
    room_v = torch.cat([v_cache, torch.full((4, t, 32), float("nan"))], 1)
    got = attend(q, k, v, mask_new, room_k, room_v, mask_cache, LayerCall(rows_in_cache=True))
    want = _reference(q, k, v, mask_new, k_cache, v_cache, mask_cache)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert torch.equal(room_k[:, old:], k.transpose(0, 1)) and torch.equal(room_v[:, old:], v.transpose(0, 1))
    assert torch.equal(room_k[:, :old], k_cache)


@torch.inference_mode()
@pytest.mark.parametrize("t", [1, 4])
def test_decode_step_writes_its_rows_in_place_as_the_copy_path_stored_them(tmp_path, t):
    """torch_engine.step_eager over slots right after the live columns (each layer writes its rows into
    the cache and reads it without a copy) gives the hidden rows and the cache that the model's forward
    over [cache | new rows] and a store at the slots give (within 1e-6 of the largest value)."""
    from helpers import lively_checkpoint_of, options

    from litevlm_runtime.engines.torch_engine import follows_live, step_eager
    from litevlm_runtime.pipeline.pipeline import Pipeline

    pipe = Pipeline.from_pretrained(lively_checkpoint_of(tmp_path, "tiny-qwen3"), options(pipeline="baseline"))
    rt, a = pipe.rt, pipe.rt.arena
    g = torch.Generator().manual_seed(t)
    a.k_cache.copy_(torch.randn(a.k_cache.shape, generator=g))
    a.v_cache.copy_(torch.randn(a.v_cache.shape, generator=g))
    live = 30
    x = torch.randn(t, rt.cfg.llm.hidden_size, generator=g)
    args = (x, a.positions[live:live + t], a.slots[live:live + t], a.all_visible(t, live), a.causal_mask(t))
    assert follows_live(a.k_cache, args[2], live, t, x.dtype)
    k_copy, v_copy = a.k_cache.clone(), a.v_cache.clone()
    want, k, v = rt.lm(x, args[1], args[4], k_copy[:, :, :live], v_copy[:, :, :live], args[3])
    k_copy.index_copy_(2, args[2], k)
    v_copy.index_copy_(2, args[2], v)
    got = step_eager(rt.lm, a.k_cache, a.v_cache, *args)
    tol = 1e-6 * float(want.abs().max())
    assert float((got - want).abs().max()) <= tol
    assert float((a.k_cache - k_copy).abs().max()) <= tol and float((a.v_cache - v_copy).abs().max()) <= tol
    assert not follows_live(a.k_cache, args[2] + 1, live, t, x.dtype)        # a gap: the copy path


def _float64_rows(q, k, v, allowed):
    t, hq, d = q.shape
    group = hq // k.shape[0]
    out = torch.empty(t, hq, d, dtype=torch.float64)
    for h in range(hq):
        scores = (q[:, h].double() @ k[h // group].double().T / d ** 0.5).masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.softmax(scores, -1) @ v[h // group].double()
    return out.reshape(t, hq * d)


@torch.inference_mode()
@pytest.mark.parametrize("t,s,hq,hkv,d", [(1, 256, 12, 2, 128), (1, 1500, 12, 2, 128), (7, 301, 8, 4, 64),
                                          (16, 40, 12, 2, 128), (1, 3, 2, 1, 16)])
def test_the_kernels_few_row_attention_matches_float64(t, s, hq, hkv, d):
    """lowbit_kernels.attention_rows (AVX2, float32, its own exp) against float64: within 1e-5 of the largest
    output (measured 2e-7 to 8e-7), over a cache slice with a stride over S (the arena's), any mask with
    each row's own column, one thread or two (the same numbers: a KV head is one chunk)."""
    from litevlm_runtime.kernels import lowbit_kernels

    if not lowbit_kernels.load():
        pytest.skip("low-bit CPU kernels not built here")
    g = torch.Generator().manual_seed(t * 1000 + s)
    q = 2 * torch.randn(t, hq, d, generator=g)
    k = torch.randn(hkv, s + 9, d, generator=g)[:, :s]
    v = torch.randn(hkv, s + 9, d, generator=g)[:, :s]
    allowed = torch.rand(t, s, generator=g) < 0.7
    allowed[:, -1] = True
    want = _float64_rows(q, k, v, allowed)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = lowbit_kernels.attention_rows(q, k, v, allowed)
        torch.set_num_threads(2)
        two = lowbit_kernels.attention_rows(q, k, v, allowed)
    finally:
        torch.set_num_threads(threads)
    assert float((one.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert torch.equal(one, two)


@torch.inference_mode()
def test_few_rows_without_the_kernels_attend_by_matmuls(monkeypatch):
    """attend_few_rows' own path (a CPU without the kernels, a head size they do not take) gives float64's."""
    from litevlm_runtime.kernels import lowbit_kernels
    from litevlm_runtime.models.decoder import attend_few_rows

    monkeypatch.setattr(lowbit_kernels, "takes_rows_attention", lambda q: False)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 8, 32, generator=g)
    k, v = torch.randn(4, 50, 32, generator=g), torch.randn(4, 50, 32, generator=g)
    allowed = torch.ones(3, 50, dtype=torch.bool).tril(47)
    want = _float64_rows(q, k, v, allowed)
    got = attend_few_rows(q, k, v, allowed)
    assert float((got.double() - want).abs().max()) <= 1e-5 * float(want.abs().max())
