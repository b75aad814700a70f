"""Motion tokens: what moved between a camera's last two frame sets, below the token grid (issue 45).

The visual tokens are made frame by frame, and on a 8 x 8 or 16 x 16 grid an object's own motion
over half a second is a change of scale and a shift under a cell: probes on the frozen tokens read
whether an object moves little better than its appearance does, while dense optical flow at the
object's box reads it 0.906-0.958 of the time with the ego stopped
(docs/results/2026-12-08-motion-in-optical-flow.md). So a model with a `motion/` folder is given
the flow too: per camera, OpenCV's Farneback flow from the newest tile to the previous frame set's
(the same uint8 tiles the vision stage encodes, grey), pooled to the token grid's cells as
MOTION_FEATURES numbers each, and a small network (models/motion.py's `MotionTokens`, its last layer zero at the start
of training: a model learns from "no motion" up) maps them to the decoder's width, added to the
newest set's visual tokens of that camera. Older sets' tokens and temporal token selection are
untouched (it compares the tokens as the vision stage made them).

Per cell, in cells moved per frame-set step (the flow in pixels over the cell's width): the cell's
mean flow (x, y), the same less the camera's median flow (what moves against the scene), less the
flow of the cell below it (the ground at the cell's depth: what a still object there would do),
and the lengths of the three.
"""

from __future__ import annotations

from collections import OrderedDict

import cv2
import numpy as np
import torch

from ..models.motion import MOTION_FEATURES

# Farneback's settings (pyramid scale, levels, window, iterations, poly_n, poly_sigma): OpenCV's
# documented example's, with 4 levels for shifts of a tenth of the tile in half a second.
FARNEBACK = (0.5, 4, 15, 3, 5, 1.2, 0)


def grey_tile(tile_u8: torch.Tensor) -> np.ndarray:
    """One uint8 tile [3, S, S] (RGB, the vision stage's) as a grey [S, S] uint8 image."""
    return cv2.cvtColor(np.ascontiguousarray(tile_u8.permute(1, 2, 0).numpy()), cv2.COLOR_RGB2GRAY)


def cell_motion(newest: np.ndarray, previous: np.ndarray, grid: int) -> torch.Tensor:
    """Grey tiles [S, S] of the newest and the previous frame set -> [grid * grid, MOTION_FEATURES]
    float32, cells in the visual tokens' order (row by row)."""
    flow = cv2.calcOpticalFlowFarneback(newest, previous, None, *FARNEBACK)        # [S, S, 2] newest -> previous
    s = flow.shape[0]
    cell = s // grid
    cells = flow[:grid * cell, :grid * cell].reshape(grid, cell, grid, cell, 2).mean((1, 3)) / cell  # [g, g, 2]
    scene = np.median(cells.reshape(-1, 2), 0)
    below = np.concatenate([cells[1:], cells[-1:]], 0)           # the bottom row: its own
    against_scene, against_ground = cells - scene, cells - below
    lengths = [np.linalg.norm(x, axis=-1, keepdims=True) for x in (cells, against_scene, against_ground)]
    out = np.concatenate([cells, against_scene, against_ground, *lengths], -1)
    return torch.from_numpy(out.reshape(grid * grid, MOTION_FEATURES).astype(np.float32))


class MotionCache:
    """The grey tiles of the last `capacity` (camera, frame key) pairs the vision stage cut, so a
    K-frame question's previous set (its features reused) is not decoded again, and the cell flow of
    the last `capacity` (camera, newest key, previous key), so a question about a window already
    asked about runs no flow. Plain LRUs of small arrays (S x S bytes, tokens x 9 floats), not arena
    memory: only a model with motion/ fills them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.tiles: OrderedDict = OrderedDict()
        self.flows: OrderedDict = OrderedDict()

    def clear(self) -> None:
        self.tiles.clear()
        self.flows.clear()

    def _keep(self, store: OrderedDict, key, value):
        store[key] = value
        store.move_to_end(key)
        while len(store) > self.capacity:
            store.popitem(last=False)
        return value

    def get(self, camera: str, key) -> list[np.ndarray] | None:
        found = self.tiles.get((camera, key)) if key is not None else None
        if found is not None:
            self.tiles.move_to_end((camera, key))
        return found

    def put(self, camera: str, key, tiles_u8: torch.Tensor) -> list[np.ndarray]:
        """tiles_u8 [tiles_per_camera, 3, S, S] -> their grey tiles, kept under (camera, key) unless key is None."""
        grey = [grey_tile(t) for t in tiles_u8]
        return grey if key is None else self._keep(self.tiles, (camera, key), grey)

    def flow(self, camera: str, newest_key, previous_key, make) -> torch.Tensor:
        """The camera's cell flow between two frames, kept under their keys (`make()` where it is not,
        or where either frame has no key)."""
        key = (camera, newest_key, previous_key)
        if newest_key is None or previous_key is None:
            return make()
        if key in self.flows:
            self.flows.move_to_end(key)
            return self.flows[key]
        return self._keep(self.flows, key, make())


def tiles_motion(newest: list[np.ndarray], previous: list[np.ndarray], grid: int) -> torch.Tensor:
    """A camera's grey tiles, newest and previous set -> [tiles * grid * grid, MOTION_FEATURES] (tile order)."""
    return torch.cat([cell_motion(n, p, grid) for n, p in zip(newest, previous)])
