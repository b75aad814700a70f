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
