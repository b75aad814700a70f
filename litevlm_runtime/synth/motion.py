"""SynthDrive in motion: one scene at K time steps, `stride` seconds apart, the key frame last.

The scene is sampled as a single-frame scene is (world.py) and is the key frame; every object then
gets a motion from its own RNG stream (`assign`), and its poses at the earlier steps follow from
that motion backwards in time, in lane coordinates (s along the road, d across it). The ego drives
along its lane at the speed its behaviour names (EGO_SPEED_MPS), so at an earlier step it is
`speed * t` behind (t < 0) on the road's straight part behind the key frame's origin, and a frame of
that step is the key frame's scene seen from there (`snapshot`).

One frame does not give the motion away: what an object looks like at the key frame is drawn
alike whatever it does. Every vehicle's heading against its lane is drawn from the same narrow
range (YAW_JITTER_DEG; a single-frame scene instead yaws a turning vehicle by 32 degrees), no brake
lamp is lit, a vehicle moves or stands whatever its place (lane or parking strip) and whatever the
traffic light, and a pedestrian's legs are apart or together at random (a walker's alternate from
step to step). Its motion shows only in how its poses change from step to step.

The labels the questions ask about are recomputed from the poses at the K steps (`labels`), with
thresholds far from the drawn values, so a label is never a coin toss at a boundary:
  moving      mean speed over the window > MOVING_MPS (drawn: 0, or at least 1 m/s)
  status      vehicles: turn left/right when the heading against the lane turns faster than
              TURNING_DEG_S (drawn: 0, or 15..25 deg/s), else going ahead when moving, else stopped;
              pedestrians: walking when moving, else standing
  approaching the distance to the ego shrinks faster than APPROACH_MPS (True), grows faster than
              APPROACH_MPS or stays within STEADY_MPS (False); in between: None, not asked
  crosses_ego_lane  its path over the next HORIZON_S, at the speed, direction of travel and turn
              rate the poses show (the last step's chord, the window's turn: the motion it was
              drawn with), enters the ego lane from outside it (True; within GRAZE_M of its edge
              without entering: None), or, inside it, it moves across the road faster than
              CROSSING_MPS (True) or slower than STILL_LATERAL_MPS (False; in between: None)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .world import LANE_WIDTH, SIZES, VEHICLE_KINDS, World, WorldObject, decide_ego

EGO_SPEED_MPS = {"not moving": 0.0, "driving slowly": 3.0, "driving with normal speed": 8.0, "driving fast": 13.0}

# What a vehicle does: drawn for each, independent of its place, kind, colour and look.
VEHICLE_INTENTS = ("going ahead", "turn left", "turn right", "stopped")
VEHICLE_INTENT_P = (0.35, 0.15, 0.15, 0.35)
LANE_SPEED_MPS = (4.0, 12.0)
STRIP_SPEED_MPS = (2.0, 5.0)          # moving along a parking strip: pulling out, looking for a space
TURN_SPEED_MPS = (3.0, 6.0)
TURN_RATE_DEG_S = (15.0, 25.0)
YAW_JITTER_DEG = 6.0                  # heading against the lane at the key frame, every vehicle alike
WALKING_P = 0.5
WALK_SPEED_MPS = (1.0, 1.6)

MOVING_MPS = 0.5
TURNING_DEG_S = 8.0
APPROACH_MPS = 1.5
STEADY_MPS = 1.0
CROSSING_MPS = 0.5
STILL_LATERAL_MPS = 0.1
HORIZON_S = 3.0
GRAZE_M = 0.3

EGO_FOOTPRINT = (5.6, 2.9, -1.0)      # length, width (the ego's 4.6 x 1.9 plus 0.5 m), centre behind the rig
CLEARANCE_M = 0.3                     # objects' footprints, inflated by this, never overlap at any step


def times(frames: int, stride_us: int) -> list[float]:
    """Seconds relative to the key frame, oldest first: [-(K-1) stride, ..., -stride, 0]."""
    return [-(frames - 1 - k) * stride_us / 1e6 for k in range(frames)]


@dataclass
class Pose:
    t: float            # seconds relative to the key frame
    s: float
    d: float
    x: float            # in the key frame's ego coordinates (the world frame of the sequence)
    y: float
    yaw: float
    legs_apart: bool | None


@dataclass
class Labels:
    moving: bool
    status: str | None                 # VEHICLE_STATUS for vehicles, walking/standing for pedestrians
    closing_mps: float                 # d(distance to the ego)/dt over the window; negative: approaching
    approaching: bool | None
    lateral_mps: float                 # d(d)/dt at the key frame (left positive)
    crosses_ego_lane: bool | None


@dataclass
class Motion:
    """An object's motion over the window: what was drawn, and what follows from it."""
    speed: float = 0.0        # m/s along `course` (0: stands still)
    yaw_rate: float = 0.0     # rad/s; the course turns with it (vehicles turning)
    course: float = 0.0       # direction of travel against the lane at the key frame, rad
    look: float | None = None     # heading against the lane at the key frame (None: keep the object's yaw)
    legs0: bool | None = None     # pedestrians: legs apart at the key frame
    poses: list[Pose] = field(default_factory=list)
    labels: Labels | None = None


def _lane_base(obj: WorldObject) -> float:
    """0 for objects that travel along the road's direction, pi for oncoming lanes and the left strip."""
    if obj.place == "oncoming lane" or (obj.place == "parking" and obj.d > 0):
        return math.pi
    return 0.0


def assign(world: World, rng: np.random.Generator, steps: list[float]) -> None:
    """Draw every object's motion and its look at the key frame, and its poses at `steps`; set
    its status (and parked) from the labels those poses give. Each object draws the same numbers
    from `rng` whatever it turns out to do, so one object's draw never shifts another's."""
    road = world.road
    for obj in world.objects:
        m = Motion()
        if obj.kind in VEHICLE_KINDS:
            u_intent, u_jitter, u_speed, u_rate = rng.random(4)
            intent = VEHICLE_INTENTS[int(np.searchsorted(np.cumsum(VEHICLE_INTENT_P), u_intent, side="right"))]
            base = _lane_base(obj)
            m.look = base + math.radians(YAW_JITTER_DEG) * (2 * u_jitter - 1)
            if intent == "going ahead":
                lo, hi = STRIP_SPEED_MPS if obj.place == "parking" else LANE_SPEED_MPS
                m.speed, m.course = lo + (hi - lo) * u_speed, base
            elif intent in ("turn left", "turn right"):
                lo, hi = TURN_SPEED_MPS
                rate = math.radians(TURN_RATE_DEG_S[0] + (TURN_RATE_DEG_S[1] - TURN_RATE_DEG_S[0]) * u_rate)
                m.speed, m.course = lo + (hi - lo) * u_speed, m.look
                m.yaw_rate = rate if intent == "turn left" else -rate
            obj.brake_lamps = False
        elif obj.kind == "pedestrian":
            u_walk, u_speed, u_dir, u_legs = rng.random(4)
            across = obj.place == "crossing"
            m.course = (math.pi / 2 if across else 0.0) + (math.pi if u_dir < 0.5 else 0.0)
            m.look = m.course
            if u_walk < WALKING_P:
                m.speed = WALK_SPEED_MPS[0] + (WALK_SPEED_MPS[1] - WALK_SPEED_MPS[0]) * u_speed
            m.legs0 = bool(u_legs < 0.5)
            obj.legs_apart = m.legs0
        if m.look is not None:
            obj.yaw = float(road.heading(obj.s)) + m.look
        obj.motion = m
        m.poses = [_pose(world, obj, m, t, len(steps) - 1 - k) for k, t in enumerate(steps)]
        _set_status(world, obj)


def _pose(world: World, obj: WorldObject, m: Motion, t: float, steps_before_key: int) -> Pose:
    v, w = m.speed, m.yaw_rate
    heading = m.look
    if v == 0.0:
        s, d = obj.s, obj.d
    elif w == 0.0:
        s, d = obj.s + v * t * math.cos(m.course), obj.d + v * t * math.sin(m.course)
    else:
        c = m.course + w * t
        s = obj.s + v / w * (math.sin(c) - math.sin(m.course))
        d = obj.d - v / w * (math.cos(c) - math.cos(m.course))
        heading = c
    x, y = (float(a) for a in world.road.point(s, d))
    yaw = obj.yaw if heading is None else float(world.road.heading(s)) + heading
    legs = m.legs0
    if legs is not None and v > 0.0 and steps_before_key % 2:
        legs = not legs                 # a walker's stride changes from step to step
    return Pose(t, float(s), float(d), x, y, yaw, legs)


def _wrap(angle: float) -> float:
    return (angle + math.pi) % (2 * math.pi) - math.pi


def labels(kind: str, poses: list[Pose], ego_xs: list[float], curvature: float) -> Labels:
    """What the questions ask, from the poses alone (and the ego's x at each step): see the
    module's docstring for the definitions and thresholds."""
    first, last = poses[0], poses[-1]
    span = last.t - first.t
    moving = math.hypot(last.x - first.x, last.y - first.y) / span > MOVING_MPS
    status = None
    if kind in VEHICLE_KINDS:
        against_lane = [p.yaw - curvature * max(p.s, 0.0) for p in poses]
        turn = math.degrees(_wrap(against_lane[-1] - against_lane[0])) / span
        status = ("turn left" if turn > TURNING_DEG_S else "turn right" if turn < -TURNING_DEG_S
                  else "going ahead" if moving else "stopped")
    elif kind == "pedestrian":
        status = "walking" if moving else "standing"
    dist = [math.hypot(p.x - ex, p.y) for p, ex in zip((first, last), (ego_xs[0], ego_xs[-1]))]
    closing = (dist[1] - dist[0]) / span
    approaching = True if closing < -APPROACH_MPS else (
        False if closing > APPROACH_MPS or abs(closing) < STEADY_MPS else None)
    lateral, path = _path_ahead(kind, poses, curvature)
    half = LANE_WIDTH / 2
    if abs(last.d) < half:
        crosses = True if abs(lateral) >= CROSSING_MPS else (False if abs(lateral) < STILL_LATERAL_MPS else None)
    else:
        nearest = min(abs(d) for d in path)
        crosses = True if nearest < half - GRAZE_M else (False if nearest >= half + GRAZE_M else None)
    return Labels(moving, status, closing, approaching, lateral, crosses)


def _path_ahead(kind: str, poses: list[Pose], curvature: float) -> tuple[float, list[float]]:
    """(across-road speed now, d over the next HORIZON_S in 0.01 s steps) of an object going on as
    its poses show: the speed and direction of travel of the last step's chord (the tangent at the
    step's middle), turning at the rate its heading against the lane turned over the window."""
    before, last = poses[-2], poses[-1]
    step = last.t - before.t
    speed = math.hypot(last.s - before.s, last.d - before.d) / step
    rate = 0.0
    if kind in VEHICLE_KINDS:
        turned = [p.yaw - curvature * max(p.s, 0.0) for p in (poses[0], last)]
        rate = _wrap(turned[1] - turned[0]) / (last.t - poses[0].t)
    course = math.atan2(last.d - before.d, last.s - before.s) + rate * step / 2
    ahead = [0.01 * i for i in range(round(HORIZON_S / 0.01) + 1)]
    if rate:
        path = [last.d - speed / rate * (math.cos(course + rate * t) - math.cos(course)) for t in ahead]
    else:
        path = [last.d + speed * t * math.sin(course) for t in ahead]
    return speed * math.sin(course), path


def _set_status(world: World, obj: WorldObject) -> None:
    if obj.kind not in VEHICLE_KINDS + ("pedestrian",):
        return
    found = labels(obj.kind, obj.motion.poses, [0.0] * len(obj.motion.poses), world.road.curvature)
    obj.status = found.status
    if obj.kind in VEHICLE_KINDS:
        obj.parked = obj.place == "parking" and not found.moving


def ego_xs(world: World, steps: list[float]) -> list[float]:
    """The ego's x at each step, in the key frame's coordinates (it drives along its lane, d = 0)."""
    return [EGO_SPEED_MPS[world.ego_speed] * t for t in steps]


def _rectangle(x: float, y: float, yaw: float, length: float, width: float) -> np.ndarray:
    c, s = math.cos(yaw), math.sin(yaw)
    half = np.array([[1, 1], [1, -1], [-1, -1], [-1, 1]]) * [length / 2, width / 2]
    return np.array([x, y]) + half @ np.array([[c, s], [-s, c]])


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Two convex polygons intersect unless some edge normal separates them (separating axis)."""
    for poly in (a, b):
        for i in range(len(poly)):
            edge = poly[(i + 1) % len(poly)] - poly[i]
            normal = np.array([-edge[1], edge[0]])
            pa, pb = a @ normal, b @ normal
            if pa.max() < pb.min() or pb.max() < pa.min():
                return False
    return True


def _footprints(obj: WorldObject) -> list[np.ndarray]:
    length, width, _ = SIZES[obj.kind]
    return [_rectangle(p.x, p.y, p.yaw, length + 2 * CLEARANCE_M, width + 2 * CLEARANCE_M) for p in obj.motion.poses]


def settle(world: World, steps: list[float]) -> None:
    """Drop objects whose path runs into the ego or into an object kept before them, at any
    step (the key frame's placement only kept them apart then); the ego's speed, decided from what
    is left, decides where it was, so repeat until nothing is dropped. Then the labels that
    depend on the ego (approaching) are computed."""
    while True:
        egos = [_rectangle(x + EGO_FOOTPRINT[2], 0.0, 0.0, EGO_FOOTPRINT[0], EGO_FOOTPRINT[1])
                for x in ego_xs(world, steps)]
        kept, kept_prints = [], []
        for obj in world.objects:
            if obj.kind == "traffic light":       # on poles beside and over the road
                kept.append(obj)
                continue
            prints = _footprints(obj)
            if any(_overlap(p, e) for p, e in zip(prints, egos)) or \
                    any(_overlap(p, q) for other in kept_prints for p, q in zip(prints, other)):
                continue
            kept.append(obj)
            kept_prints.append(prints)
        if len(kept) == len(world.objects):
            break
        world.objects = kept
        decide_ego(world)
    xs = ego_xs(world, steps)
    for obj in world.objects:
        obj.motion.labels = labels(obj.kind, obj.motion.poses, xs, world.road.curvature)


def snapshot(world: World, step: int, steps: list[float]) -> World:
    """The scene at `step` (an index into `steps`) as the ego's cameras saw it then: every object at
    its pose, the road shifted by where the ego was."""
    ego_s = EGO_SPEED_MPS[world.ego_speed] * steps[step]
    road = replace(world.road, ego_s=ego_s)
    objects = []
    for obj in world.objects:
        p = obj.motion.poses[step]
        objects.append(replace(obj, s=p.s, d=p.d, x=p.x - ego_s, y=p.y, yaw=p.yaw, legs_apart=p.legs_apart,
                               motion=None))
    return World(road, objects, world.appearance, ego_speed=world.ego_speed, ego_direction=world.ego_direction,
                 light_state=world.light_state, light_s=world.light_s)
