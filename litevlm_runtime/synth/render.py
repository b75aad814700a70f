"""Rendering one camera view of a World with PIL, plus a mask of which object covers each pixel.

Painter's algorithm: sky and ground, then the road surface and its markings (flat on the ground,
so they never hide anything), then objects from the farthest to the nearest. Vehicles and
barriers are boxes (a car is a body box plus a cabin box, a truck a cab plus a cargo box) whose
camera-facing faces are filled with the object's colour, shaded per face, with windows, wheels
and lamps as quads on those faces. Pedestrians and traffic lights are camera-facing billboards
(they are thin; their look from any side is the same picture).

The mask (uint8, same size as the image) holds 2*i+1 where object i's "body" shows (car paint,
shirt, barrier plastic, the lit lamp of a traffic light), 2*i+2 where another part of it shows
(windows, wheels, legs, housing, pole) and 0 elsewhere. It is drawn with exactly the same
polygons as the image, so it says what a viewer of the JPEG sees.
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

from .camera import CAMERA_HEIGHT_M, NEAR_M, Camera, clip_near
from .world import (
    BARRIER_RGB,
    COLOURS,
    LANE_WIDTH,
    LIGHT_RGB,
    PARKING_WIDTH,
    ROAD_AHEAD_M,
    ROAD_BEHIND_M,
    SIDEWALK_WIDTH,
    VEHICLE_KINDS,
    World,
    WorldObject,
)

MAX_OBJECTS = 127                      # mask values 1..254
WHITE_PAINT = (225, 225, 220)
YELLOW_PAINT = (230, 190, 40)
WINDOW = (58, 70, 88)
TYRE = (20, 20, 20)
HEADLAMP = (250, 245, 205)
BRAKE_ON = (255, 25, 25)
BRAKE_OFF = (120, 30, 30)
TROUSERS = (48, 48, 66)
SKIN = (222, 180, 140)
HOUSING = (28, 28, 28)
LAMP_OFF = (62, 62, 58)
POLE = (80, 80, 84)
FACE_SHADE = {("z", 1): 1.0, ("x", 1): 0.94, ("x", -1): 0.94, ("y", 1): 0.87, ("y", -1): 0.87}
AXIS = {"x": 0, "y": 1, "z": 2}


def background(world: World, width: int, height: int) -> np.ndarray:
    """Sky gradient above the horizon (the cameras are level, so it is the middle row), ground below."""
    a = world.appearance
    horizon = height // 2
    img = np.empty((height, width, 3), dtype=np.uint8)
    t = np.linspace(0.0, 1.0, horizon)[:, None]
    sky = (1 - t) * np.array(a.sky_top) + t * np.array(a.sky_horizon)
    img[:horizon] = sky.astype(np.uint8)[:, None, :]
    img[horizon:] = np.array(a.ground, dtype=np.uint8)
    return img


class Canvas:
    """An RGB image and its object mask, drawn together."""

    def __init__(self, camera: Camera, base: np.ndarray):
        self.camera = camera
        self.image = Image.fromarray(base)
        self.mask = Image.new("L", (camera.width, camera.height), 0)
        self.draw = ImageDraw.Draw(self.image)
        self.draw_mask = ImageDraw.Draw(self.mask)

    def polygon(self, points, colour, mask_value: int | None = None) -> None:
        if points is None or len(points) < 3:
            return
        self.draw.polygon(points, fill=colour)
        if mask_value is not None:
            self.draw_mask.polygon(points, fill=mask_value)

    def world_polygon(self, ego_points: np.ndarray, colour, mask_value: int | None = None) -> None:
        self.polygon(self.camera.project_polygon(ego_points), colour, mask_value)

    def world_line(self, a, b, thickness_m: float, colour, mask_value: int | None) -> None:
        pa, pb = self.camera.to_camera(np.array([a, b], dtype=np.float64))
        if pa[2] < NEAR_M and pb[2] < NEAR_M:
            return
        if pa[2] < NEAR_M or pb[2] < NEAR_M:     # cut the segment at the near plane
            t = (NEAR_M - pa[2]) / (pb[2] - pa[2])
            cut = pa + t * (pb - pa)
            pa, pb = (cut, pb) if pa[2] < NEAR_M else (pa, cut)
        depth = max(NEAR_M, 0.5 * (pa[2] + pb[2]))
        px = self.camera.project(np.stack([pa, pb]))
        w = max(1, int(round(self.camera.focal * thickness_m / depth)))
        line = [tuple(px[0]), tuple(px[1])]
        self.draw.line(line, fill=colour, width=w)
        if mask_value is not None:
            self.draw_mask.line(line, fill=mask_value, width=w)

    def ellipse(self, box, colour, mask_value: int | None) -> None:
        x0, y0, x1, y1 = box
        if x1 - x0 < 1 or y1 - y0 < 1:
            box = (x0, y0, max(x1, x0 + 1), max(y1, y0 + 1))
        self.draw.ellipse(box, fill=colour)
        if mask_value is not None:
            self.draw_mask.ellipse(box, fill=mask_value)


# --- road surface -----------------------------------------------------------------------------

def _s_samples(world: World) -> np.ndarray:
    ahead = [0.0, ROAD_AHEAD_M] if abs(world.road.curvature) < 1e-9 else np.arange(0.0, ROAD_AHEAD_M + 1e-6, 3.0)
    return np.concatenate([[-ROAD_BEHIND_M], ahead])


def _strip(world: World, s: np.ndarray, d0: float, d1: float) -> np.ndarray:
    """A band d0..d1 along the road as (len(s) - 1, 4, 3) ground quads, one per s-segment."""
    left = world.road.point(s, d1)
    right = world.road.point(s, d0)
    quads = np.zeros((len(s) - 1, 4, 3))
    quads[:, 0, :2], quads[:, 1, :2] = left[:-1], left[1:]
    quads[:, 2, :2], quads[:, 3, :2] = right[1:], right[:-1]
    return quads


def _dashes(world: World, d: float, dash=3.0, gap=6.0, width=0.15) -> np.ndarray:
    s0 = np.arange(-ROAD_BEHIND_M + 1.0, ROAD_AHEAD_M, dash + gap)
    quads = np.zeros((len(s0), 4, 3))
    for k, (s, dd) in enumerate(((s0, d + width / 2), (s0 + dash, d + width / 2), (s0 + dash, d - width / 2),
                                 (s0, d - width / 2))):
        quads[:, k, :2] = world.road.point(s, dd)
    return quads


def road_quads(world: World) -> tuple[np.ndarray, list]:
    """Every flat piece of the road surface, in drawing order: (N, 4, 3) ego points + N colours.
    Built once per world; each camera then transforms them all in one matrix product."""
    if "road_quads" in world.extra:
        return world.extra["road_quads"]
    road, a = world.road, world.appearance
    s = _s_samples(world)
    right_park, left_park = road.right_edge - PARKING_WIDTH, road.left_edge + PARKING_WIDTH
    pieces = [
        (_strip(world, s, right_park - SIDEWALK_WIDTH, right_park), a.sidewalk),
        (_strip(world, s, left_park, left_park + SIDEWALK_WIDTH), a.sidewalk),
        (_strip(world, s, right_park, road.right_edge), a.parking),
        (_strip(world, s, road.left_edge, left_park), a.parking),
        (_strip(world, s, road.right_edge, road.left_edge), a.asphalt),
    ]
    # Markings: solid edge lines, dashed lane lines, a double yellow line before oncoming lanes.
    for d in (road.right_edge + 0.15, road.left_edge - 0.15):
        pieces.append((_strip(world, s, d - 0.08, d + 0.08), WHITE_PAINT))
    for j in range(1, road.n_same):
        pieces.append((_dashes(world, road.right_edge + j * LANE_WIDTH), WHITE_PAINT))
    for j in range(1, road.n_opposite):
        pieces.append((_dashes(world, road.divider + j * LANE_WIDTH), WHITE_PAINT))
    if road.n_opposite:
        for d in (road.divider - 0.13, road.divider + 0.13):
            pieces.append((_strip(world, s, d - 0.06, d + 0.06), YELLOW_PAINT))
    if road.stop_line_s is not None:
        pieces.append((_strip(world, np.array([road.stop_line_s, road.stop_line_s + 0.45]),
                              road.right_edge, road.divider), WHITE_PAINT))
    if road.crosswalk_s is not None:
        cs = road.crosswalk_s
        for d0 in np.arange(road.right_edge + 0.3, road.left_edge - 0.5, 1.2):
            pieces.append((_strip(world, np.array([cs, cs + 3.0]), d0, d0 + 0.6), WHITE_PAINT))
    quads = np.concatenate([q for q, _ in pieces])
    colours = [c for q, c in pieces for _ in range(len(q))]
    world.extra["road_quads"] = (quads, colours)
    return quads, colours


def draw_road(canvas: Canvas, world: World) -> None:
    quads, colours = road_quads(world)
    camera = canvas.camera
    cam = camera.to_camera(quads.reshape(-1, 3)).reshape(-1, 4, 3)
    depth = cam[..., 2]
    in_front = (depth >= NEAR_M).all(axis=1)
    behind = (depth < NEAR_M).all(axis=1)
    px = np.zeros(cam.shape[:2] + (2,))
    px[in_front] = camera.project(cam[in_front].reshape(-1, 3)).reshape(-1, 4, 2)
    lo, hi = px.min(axis=1), px.max(axis=1)
    off_image = (hi[:, 0] < 0) | (hi[:, 1] < 0) | (lo[:, 0] > camera.width) | (lo[:, 1] > camera.height)
    for i in np.nonzero(~behind & ~(in_front & off_image))[0]:
        if in_front[i]:
            canvas.polygon([tuple(p) for p in px[i].tolist()], colours[i])
        else:
            clipped = clip_near(cam[i])
            if clipped is not None:
                canvas.polygon([tuple(p) for p in camera.project(clipped).tolist()], colours[i])


# --- objects ----------------------------------------------------------------------------------

def _shade(rgb, factor: float):
    return tuple(int(min(255, c * factor)) for c in rgb)


class _Box:
    """An axis-aligned box in an object's own frame (x forward, y left, z up), with detail quads
    on its faces: (axis, sign, (u0, u1), (v0, v1), colour, is_body)."""

    def __init__(self, lo, hi, colour, body: bool = True):
        self.lo, self.hi = np.array(lo, float), np.array(hi, float)
        self.colour, self.body = colour, body
        self.details: list[tuple] = []

    def add(self, axis, sign, u, v, colour, body=False):
        self.details.append((axis, sign, u, v, colour, body))
        return self

    def face(self, axis: str, sign: int, u=None, v=None, lift: float = 0.0) -> np.ndarray:
        """Corners of the face (or of a rectangle u x v on it), in object coordinates."""
        k = AXIS[axis]
        others = [i for i in range(3) if i != k]
        u = u if u is not None else (self.lo[others[0]], self.hi[others[0]])
        v = v if v is not None else (self.lo[others[1]], self.hi[others[1]])
        plane = (self.hi[k] + lift) if sign > 0 else (self.lo[k] - lift)
        pts = np.zeros((4, 3))
        for n, (a, b) in enumerate([(u[0], v[0]), (u[1], v[0]), (u[1], v[1]), (u[0], v[1])]):
            pts[n, k], pts[n, others[0]], pts[n, others[1]] = plane, a, b
        return pts


def _vehicle_parts(obj: WorldObject) -> list[_Box]:
    L, W, H = obj.size
    body = COLOURS[obj.colour]
    lit = obj.brake_lamps if obj.brake_lamps is not None else (obj.status == "stopped" and not obj.parked)
    rear_lamp = BRAKE_ON if lit else BRAKE_OFF
    lamp_y = [(W / 2 - 0.5, W / 2 - 0.1), (-W / 2 + 0.1, -W / 2 + 0.5)]

    def wheels(box: _Box, xs, r):
        for sign in (1, -1):
            for x in xs:
                box.add("y", sign, (x - r, x + r), (0.0, 2 * r), TYRE)

    if obj.kind == "car":
        base = _Box((-L / 2, -W / 2, 0.28), (L / 2, W / 2, 0.95), body)
        cabin = _Box((-L / 2 + 1.0, -W / 2 + 0.12, 0.95), (L / 2 - 1.4, W / 2 - 0.12, H), body)
        for sign in (1, -1):
            cabin.add("y", sign, (-L / 2 + 1.15, L / 2 - 1.55), (1.0, H - 0.08), WINDOW)
            cabin.add("x", sign, (-W / 2 + 0.25, W / 2 - 0.25), (1.0, H - 0.07), WINDOW)
        wheels(base, (L / 2 - 0.9, -L / 2 + 0.9), 0.33)
        for y in lamp_y:
            base.add("x", -1, y, (0.62, 0.84), rear_lamp)
            base.add("x", 1, y, (0.6, 0.78), HEADLAMP)
        return [base, cabin]
    if obj.kind == "truck":
        cab = _Box((L / 2 - 2.3, -W / 2 + 0.05, 0.45), (L / 2, W / 2 - 0.05, 2.9), body)
        cargo = _Box((-L / 2, -W / 2, 0.9), (L / 2 - 2.5, W / 2, H), body)
        cab.add("x", 1, (-W / 2 + 0.25, W / 2 - 0.25), (1.7, 2.7), WINDOW)
        for sign in (1, -1):
            cab.add("y", sign, (L / 2 - 1.4, L / 2 - 0.2), (1.7, 2.6), WINDOW)
            cab.add("y", sign, (L / 2 - 1.8, L / 2 - 0.8), (0.0, 1.0), TYRE)
            for x in (-L / 2 + 1.2, -L / 2 + 2.4):
                cargo.add("y", sign, (x - 0.5, x + 0.5), (0.0, 1.0), TYRE)
        for y in lamp_y:
            cargo.add("x", -1, y, (1.0, 1.3), rear_lamp)
            cab.add("x", 1, y, (0.6, 0.85), HEADLAMP)
        return [cab, cargo]
    # bus
    bus = _Box((-L / 2, -W / 2, 0.3), (L / 2, W / 2, H), body)
    bus.add("x", 1, (-W / 2 + 0.2, W / 2 - 0.2), (1.2, 2.8), WINDOW)
    bus.add("x", -1, (-W / 2 + 0.3, W / 2 - 0.3), (1.9, 2.7), WINDOW)
    for sign in (1, -1):
        for x in np.arange(-L / 2 + 0.7, L / 2 - 1.6, 1.5):
            bus.add("y", sign, (x, x + 1.2), (1.55, 2.6), WINDOW)
    wheels(bus, (L / 2 - 2.0, -L / 2 + 2.4), 0.5)
    for y in lamp_y:
        bus.add("x", -1, y, (0.7, 1.0), rear_lamp)
        bus.add("x", 1, y, (0.6, 0.85), HEADLAMP)
    return [bus]


def _barrier_parts(obj: WorldObject) -> list[_Box]:
    L, W, H = obj.size
    box = _Box((-L / 2, -W / 2, 0.0), (L / 2, W / 2, H), BARRIER_RGB)
    for sign in (1, -1):
        box.add("y", sign, (-L / 2, L / 2), (0.55, 0.72), WHITE_PAINT)
        box.add("x", sign, (-W / 2, W / 2), (0.55, 0.72), WHITE_PAINT)
    return [box]


def _to_ego(obj: WorldObject, pts: np.ndarray) -> np.ndarray:
    c, s = math.cos(obj.yaw), math.sin(obj.yaw)
    out = np.empty_like(pts)
    out[:, 0] = obj.x + c * pts[:, 0] - s * pts[:, 1]
    out[:, 1] = obj.y + s * pts[:, 0] + c * pts[:, 1]
    out[:, 2] = pts[:, 2]
    return out


def _draw_boxes(canvas: Canvas, obj: WorldObject, parts: list[_Box], index: int, sort: bool) -> None:
    eye = np.array([0.0, 0.0, CAMERA_HEIGHT_M])
    c, s = math.cos(obj.yaw), math.sin(obj.yaw)
    # The eye in the object's frame: a face is visible when the eye is on its outer side.
    rel = eye - np.array([obj.x, obj.y, 0.0])
    eye_local = np.array([c * rel[0] + s * rel[1], -s * rel[0] + c * rel[1], rel[2]])
    if sort:   # parts side by side (cab and cargo): draw the farther one first
        parts = sorted(parts, key=lambda b: -np.linalg.norm((b.lo + b.hi) / 2 - eye_local))
    body_value, detail_value = 2 * index + 1, 2 * index + 2
    for box in parts:
        for (axis, sign), shade in FACE_SHADE.items():
            k = AXIS[axis]
            outside = eye_local[k] > box.hi[k] if sign > 0 else eye_local[k] < box.lo[k]
            if not outside:
                continue
            canvas.world_polygon(_to_ego(obj, box.face(axis, sign)), _shade(box.colour, shade),
                                 body_value if box.body else detail_value)
            for d_axis, d_sign, u, v, colour, is_body in box.details:
                if (d_axis, d_sign) == (axis, sign):
                    quad = _to_ego(obj, box.face(axis, sign, u, v, lift=0.01))
                    canvas.world_polygon(quad, colour, body_value if is_body else detail_value)


def _billboard_scale(canvas: Canvas, point) -> tuple[float, float, float] | None:
    """Pixel position and pixels-per-metre of a world point, or None when behind the camera."""
    p = canvas.camera.to_camera(np.array([point]))[0]
    if p[2] < NEAR_M:
        return None
    u, v = canvas.camera.project(p[None])[0]
    return float(u), float(v), canvas.camera.focal / float(p[2])


def _draw_pedestrian(canvas: Canvas, obj: WorldObject, index: int) -> None:
    base = _billboard_scale(canvas, (obj.x, obj.y, 0.0))
    if base is None:
        return
    u, v, ppm = base
    h = obj.size[2] * ppm
    w = 0.5 * ppm
    top = v - h
    body_value, detail_value = 2 * index + 1, 2 * index + 2
    hip = top + 0.53 * h
    if (obj.legs_apart if obj.legs_apart is not None else obj.status == "walking"):  # legs apart
        canvas.polygon(
            [(u - 0.22 * w, hip), (u + 0.02 * w, hip), (u - 0.38 * w, v), (u - 0.78 * w, v)], TROUSERS, detail_value
        )
        canvas.polygon(
            [(u - 0.02 * w, hip), (u + 0.22 * w, hip), (u + 0.78 * w, v), (u + 0.38 * w, v)], TROUSERS, detail_value
        )
    else:  # legs together
        canvas.polygon(
            [(u - 0.3 * w, hip), (u + 0.3 * w, hip), (u + 0.3 * w, v), (u - 0.3 * w, v)], TROUSERS, detail_value
        )
    shirt = COLOURS[obj.colour]
    canvas.polygon([(u - 0.5 * w, top + 0.17 * h), (u + 0.5 * w, top + 0.17 * h),
                    (u + 0.5 * w, hip), (u - 0.5 * w, hip)], shirt, body_value)
    canvas.ellipse((u - 0.24 * w, top, u + 0.24 * w, top + 0.17 * h), SKIN, detail_value)


LIGHT_HEAD_Z = {"roadside": 4.2, "overhead": 5.4}
MAST_Z = 6.3


def _draw_traffic_light(canvas: Canvas, obj: WorldObject, road, index: int) -> None:
    detail_value = 2 * index + 2
    pole = road.point(obj.s, obj.mount_d)
    head_xy = road.point(obj.s, obj.d)
    z = LIGHT_HEAD_Z[obj.place]
    if obj.place == "roadside":
        canvas.world_line((pole[0], pole[1], 0.0), (pole[0], pole[1], z), 0.2, POLE, detail_value)
    else:
        canvas.world_line((pole[0], pole[1], 0.0), (pole[0], pole[1], MAST_Z), 0.22, POLE, detail_value)
        canvas.world_line((pole[0], pole[1], MAST_Z), (head_xy[0], head_xy[1], MAST_Z), 0.16, POLE, detail_value)
        canvas.world_line((head_xy[0], head_xy[1], MAST_Z), (head_xy[0], head_xy[1], z), 0.1, POLE, detail_value)
    centre = _billboard_scale(canvas, (head_xy[0], head_xy[1], z))
    if centre is None:
        return
    u, v, ppm = centre
    _, hw, hh = obj.size   # housing 0.8 m wide, 2.0 m tall: larger than life, to stay legible small
    canvas.polygon([(u - hw / 2 * ppm, v - hh / 2 * ppm), (u + hw / 2 * ppm, v - hh / 2 * ppm),
                    (u + hw / 2 * ppm, v + hh / 2 * ppm), (u - hw / 2 * ppm, v + hh / 2 * ppm)], HOUSING, detail_value)
    r = 0.29 * ppm
    for state, dz in (("red", -0.62), ("yellow", 0.0), ("green", 0.62)):
        lit = state == obj.status
        cv = v + dz * ppm
        canvas.ellipse((u - r, cv - r, u + r, cv + r), LIGHT_RGB[state] if lit else LAMP_OFF,
                       2 * index + 1 if lit else detail_value)


def object_depth(camera: Camera, obj: WorldObject) -> float:
    return float(camera.to_camera(np.array([[obj.x, obj.y, obj.size[2] / 2]]))[0, 2])


def outside_view(camera: Camera, obj: WorldObject) -> bool:
    """True when the object's bounding sphere lies wholly behind the camera or left/right of
    its field of view (a cheap, conservative cull; most objects show in one or two of six views)."""
    L, W, H = obj.size
    z_top = LIGHT_HEAD_Z["overhead"] + 1.0 if obj.kind == "traffic light" else H
    radius = 0.5 * math.sqrt(L * L + W * W + z_top * z_top) + (
        abs(obj.d - obj.mount_d) if obj.kind == "traffic light" else 0.0
    )
    x, _, z = camera.to_camera(np.array([[obj.x, obj.y, z_top / 2]]))[0]
    if z + radius < NEAR_M:
        return True
    half_width = camera.width / 2 / camera.focal            # tan(hfov / 2)
    # Distance from the sphere's centre to the frustum's side plane |x| = z * tan: beyond radius -> outside.
    return (abs(x) - z * half_width) / math.sqrt(1 + half_width ** 2) > radius


def draw_object(canvas: Canvas, world: World, obj: WorldObject, index: int) -> None:
    if obj.kind in VEHICLE_KINDS:
        _draw_boxes(canvas, obj, _vehicle_parts(obj), index, sort=obj.kind == "truck")
    elif obj.kind == "barrier":
        _draw_boxes(canvas, obj, _barrier_parts(obj), index, sort=False)
    elif obj.kind == "pedestrian":
        _draw_pedestrian(canvas, obj, index)
    else:
        _draw_traffic_light(canvas, obj, world.road, index)


def render(world: World, camera: Camera, base: np.ndarray | None = None, objects: bool = True,
           road: bool = True) -> tuple[Image.Image, np.ndarray]:
    """One view: (RGB image, object mask). `objects=False` gives the empty scene (road only);
    `road=False` skips the surface, for callers that only need the mask."""
    if len(world.objects) > MAX_OBJECTS:
        raise ValueError(f"at most {MAX_OBJECTS} objects per scene")
    canvas = Canvas(camera, background(world, camera.width, camera.height) if base is None else base)
    if road:
        draw_road(canvas, world)
    if objects:
        far_to_near = sorted(range(len(world.objects)), key=lambda i: -object_depth(camera, world.objects[i]))
        for i in far_to_near:
            if not outside_view(camera, world.objects[i]):
                draw_object(canvas, world, world.objects[i], i)
    return canvas.image, np.asarray(canvas.mask)


def render_alone(world: World, camera: Camera, index: int) -> np.ndarray:
    """Mask of one object with nothing in front of it: its unoccluded footprint in this view."""
    canvas = Canvas(camera, np.zeros((camera.height, camera.width, 3), np.uint8))
    draw_object(canvas, world, world.objects[index], index)
    return np.asarray(canvas.mask)
