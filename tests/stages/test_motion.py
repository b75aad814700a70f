"""Motion tokens' features (stages/motion.py): the optical flow between two grey tiles pooled to the
token grid, checked against shifts made by hand; the grey tiles' store; the network's zero start."""

from __future__ import annotations

import cv2
import numpy as np
import torch

from litevlm_runtime.models.motion import MOTION_FEATURES, MotionTokens
from litevlm_runtime.stages.motion import MotionCache, cell_motion, grey_tile, tiles_motion

S, GRID = 224, 8
CELL = S // GRID


def texture(seed: int = 0, size: int = S + 64) -> np.ndarray:
    """A smooth random texture (blurred noise): flow needs structure at every place."""
    rng = np.random.default_rng(seed)
    noise = rng.uniform(0, 255, (size, size)).astype(np.float32)
    return cv2.normalize(cv2.GaussianBlur(noise, (0, 0), 3), None, 0, 255, cv2.NORM_MINMAX).astype(np.uint8)


def test_a_whole_tile_shifted_reads_as_that_shift_in_cells_everywhere_and_nothing_against_the_scene():
    big = texture(1)
    previous = big[32:32 + S, 32:32 + S]
    newest = big[32:32 + S, 36:36 + S]          # the scene moved 4 px to the left: newest[x] = previous[x + 4]
    f = cell_motion(newest, previous, GRID).numpy()
    assert f.shape == (GRID * GRID, MOTION_FEATURES) and f.dtype == np.float32
    inner = f.reshape(GRID, GRID, -1)[1:-1, 1:-1].reshape(-1, MOTION_FEATURES)
    # the flow newest -> previous is +4 px in x, 0 in y: 4 / 28 cells, within 0.5 px
    np.testing.assert_allclose(inner[:, 0], 4 / CELL, atol=0.5 / CELL)
    np.testing.assert_allclose(inner[:, 1], 0.0, atol=0.5 / CELL)
    np.testing.assert_allclose(inner[:, 2:4], 0.0, atol=0.5 / CELL)       # against the scene's median: nothing
    np.testing.assert_allclose(inner[:, 6], np.hypot(inner[:, 0], inner[:, 1]), rtol=1e-5)


def test_an_object_that_moves_against_a_still_scene_stands_out_in_its_cells_only():
    big = texture(2)
    previous = big[:S, :S].copy()
    newest = previous.copy()
    patch = texture(3, 64)[:56, :56]
    previous[84:140, 84:140] = patch            # a patch of 2 x 2 cells (cells 3-4), moved 6 px right
    newest[84:140, 90:146] = patch
    f = cell_motion(newest, previous, GRID).numpy().reshape(GRID, GRID, -1)
    against_scene = f[..., 7]
    assert against_scene[3:5, 3:5].min() > 3 / CELL          # most of its 6 px
    far = np.ones((GRID, GRID), bool)
    far[2:6, 2:6] = False
    assert against_scene[far].max() < 0.5 / CELL


def test_tiles_motion_stacks_tiles_and_grey_tile_is_opencvs_grey():
    rgb = torch.randint(0, 256, (2, 3, S, S), dtype=torch.uint8)
    g = grey_tile(rgb[0])
    np.testing.assert_array_equal(g, cv2.cvtColor(rgb[0].permute(1, 2, 0).numpy().copy(), cv2.COLOR_RGB2GRAY))
    a, b = [grey_tile(t) for t in rgb], [grey_tile(t) for t in rgb.flip(0)]
    out = tiles_motion(a, b, GRID)
    assert out.shape == (2 * GRID * GRID, MOTION_FEATURES)
    torch.testing.assert_close(out[:GRID * GRID], cell_motion(a[0], b[0], GRID))


def test_the_cache_keeps_the_last_grey_tiles_and_flows_and_never_a_frame_without_a_key():
    store = MotionCache(2)
    tiles = torch.randint(0, 256, (1, 3, 16, 16), dtype=torch.uint8)
    for k in range(3):
        store.put("CAM_FRONT", k, tiles)
    assert store.get("CAM_FRONT", 0) is None and store.get("CAM_FRONT", 2) is not None
    store.put("CAM_BACK", None, tiles)
    assert store.get("CAM_BACK", None) is None and len(store.tiles) == 2
    made = []

    def make():
        made.append(1)
        return torch.zeros(1)

    for keys in ((1, 0), (1, 0), (2, 1), (None, 1), (3, 2), (1, 0)):
        store.flow("CAM_FRONT", *keys, make)
    assert len(made) == 5 and len(store.flows) == 2      # (1, 0) once until evicted by (2, 1) and (3, 2)


def test_the_network_starts_at_zero_and_learns_from_there():
    net = MotionTokens(16, 32)
    x = torch.randn(5, 64, MOTION_FEATURES)
    assert torch.equal(net(x), torch.zeros(5, 64, 32))
    loss = (net(x) - 1).pow(2).sum()
    loss.backward()
    assert net.net[2].weight.grad.abs().sum() > 0
