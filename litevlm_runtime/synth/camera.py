"""Pinhole cameras of the six-camera nuScenes rig, as SynthDrive renders them.

Ego frame: x forward, y left, z up (metres), origin on the ground under the rig. Every camera
sits at the same point, `CAMERA_HEIGHT_M` above the ground, level (no pitch or roll), rotated by
its nuScenes yaw (litevlm_runtime.cameras.CAMERA_YAW_DEG). Horizontal fields of view are about
nuScenes': 70 degrees for the five narrow cameras, 110 for CAM_BACK, which makes neighbouring
views overlap. Pixels are square, so the vertical field of view follows from the aspect ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..cameras import CAMERA_YAW_DEG, CAMERAS

CAMERA_HEIGHT_M = 1.5
NEAR_M = 0.3                         # near clipping plane: geometry closer than this is cut
HFOV_DEG = {cam: 70.0 for cam in CAMERAS} | {"CAM_BACK": 110.0}

# Which camera "owns" a bearing (degrees, counter-clockwise from ahead): the sector boundaries
# sit between neighbouring yaws, moved so that every sector lies inside its camera's field of
# view with a margin (CAM_BACK_LEFT covers 75..145, CAM_BACK 125..235, so they split at 140).
SECTORS = (                          # (camera, lower bound, upper bound), bounds in (-180, 180]
    ("CAM_FRONT", -27.5, 27.5),
    ("CAM_FRONT_LEFT", 27.5, 82.5),
    ("CAM_BACK_LEFT", 82.5, 140.0),
    ("CAM_FRONT_RIGHT", -82.5, -27.5),
    ("CAM_BACK_RIGHT", -140.0, -82.5),
)


def bearing_deg(x: float, y: float) -> float:
    return math.degrees(math.atan2(y, x))


def sector_camera(bearing: float) -> str:
    for cam, lo, hi in SECTORS:
        if lo <= bearing < hi:
            return cam
    return "CAM_BACK"


def degrees_to_sector_edge(bearing: float) -> float:
    """Angular distance to the nearest sector boundary (objects right on one are ambiguous)."""
    edges = {b for _, lo, hi in SECTORS for b in (lo, hi)}
    return min(abs((bearing - e + 180.0) % 360.0 - 180.0) for e in edges)


@dataclass(frozen=True)
class Camera:
    name: str
    width: int
    height: int
    yaw_deg: float
    hfov_deg: float

    @property
    def focal(self) -> float:
        return (self.width / 2.0) / math.tan(math.radians(self.hfov_deg) / 2.0)

    @property
    def axes(self) -> np.ndarray:
        """3x3 rows: camera right, down, forward, in ego coordinates."""
        yaw = math.radians(self.yaw_deg)
        c, s = math.cos(yaw), math.sin(yaw)
        return np.array([[s, -c, 0.0], [0.0, 0.0, -1.0], [c, s, 0.0]])

    def to_camera(self, points: np.ndarray) -> np.ndarray:
        """(N, 3) ego points -> (N, 3) camera coordinates (right, down, depth)."""
        shifted = np.asarray(points, dtype=np.float64) - np.array([0.0, 0.0, CAMERA_HEIGHT_M])
        return shifted @ self.axes.T

    def project(self, cam_points: np.ndarray) -> np.ndarray:
        """(N, 3) camera coordinates with depth > 0 -> (N, 2) pixel coordinates (origin top-left)."""
        f = self.focal
        z = cam_points[:, 2]
        u = self.width / 2.0 + f * cam_points[:, 0] / z
        v = self.height / 2.0 + f * cam_points[:, 1] / z
        return np.stack([u, v], axis=1)

    def project_polygon(self, ego_points: np.ndarray) -> list[tuple[float, float]] | None:
        """A planar polygon in ego coordinates -> its image polygon, clipped at the near plane.
        Returns None when nothing of it lies in front of the camera."""
        clipped = clip_near(self.to_camera(ego_points))
        if clipped is None:
            return None
        return [tuple(p) for p in self.project(clipped).tolist()]


def clip_near(poly: np.ndarray, near: float = NEAR_M) -> np.ndarray | None:
    """Sutherland-Hodgman against the single plane depth >= near (one plane is all a pinhole
    needs: the image border is handled by PIL's own clipping when filling)."""
    depth = poly[:, 2]
    if (depth >= near).all():
        return poly
    if (depth < near).all():
        return None
    out = []
    n = len(poly)
    for i in range(n):
        a, b = poly[i], poly[(i + 1) % n]
        a_in, b_in = a[2] >= near, b[2] >= near
        if a_in:
            out.append(a)
        if a_in != b_in:
            t = (near - a[2]) / (b[2] - a[2])
            out.append(a + t * (b - a))
    return np.array(out) if len(out) >= 3 else None


def rig(width: int, height: int) -> dict[str, Camera]:
    return {cam: Camera(cam, width, height, CAMERA_YAW_DEG[cam], HFOV_DEG[cam]) for cam in CAMERAS}
