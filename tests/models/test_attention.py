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

