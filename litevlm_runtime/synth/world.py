"""Scene sampling: the road, the ego vehicle's state and the objects around it, in the ego frame.

A scene is a road (straight behind the ego, straight or curving ahead), lanes in the ego's
direction and possibly oncoming lanes, a parking strip and a sidewalk on each side, sometimes a
zebra crossing and traffic lights ahead, and vehicles, pedestrians and barriers placed in lane
coordinates (s along the road, d across it, left positive, d = 0 is the ego lane's centre).

Everything a question asks about is decided by what the cameras show, so the sampler ties
hidden quantities to visible cues: a vehicle's moving status is its yaw relative to its lane
(turning), its lit brake lamps (stopped in lane) or its place on the parking strip (parked); a
pedestrian walks (legs apart, on the crossing or sidewalk) or stands (legs together); the ego's
speed follows from the light ahead, pedestrians on the crossing and the gap to the vehicle ahead;
its direction from the road's curvature. A scene in motion (motion.py) cuts those ties for what
objects do: there, only how they move from frame to frame shows it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .camera import bearing_deg, degrees_to_sector_edge

LANE_WIDTH = 3.5
PARKING_WIDTH = 2.6
SIDEWALK_WIDTH = 3.0
ROAD_BEHIND_M = 130.0
ROAD_AHEAD_M = 120.0

VEHICLE_KINDS = ("car", "truck", "bus")
KINDS = VEHICLE_KINDS + ("pedestrian", "barrier", "traffic light")
PLURAL = {"car": "cars", "truck": "trucks", "bus": "buses", "pedestrian": "pedestrians",
          "barrier": "barriers", "traffic light": "traffic lights"}

# Object colours, chosen far apart from each other and from asphalt, sidewalk, ground and sky.
COLOURS = {
    "red": (205, 32, 32),
    "blue": (30, 70, 210),
    "green": (30, 155, 60),
    "yellow": (240, 205, 20),
    "white": (240, 240, 240),
    "black": (22, 22, 26),
}
BARRIER_COLOUR = "orange"
BARRIER_RGB = (245, 125, 15)
LIGHT_STATES = ("red", "yellow", "green")
LIGHT_RGB = {"red": (255, 40, 40), "yellow": (255, 205, 0), "green": (40, 235, 95)}

# (length, width, height) in metres.
SIZES = {"car": (4.6, 1.9, 1.5), "truck": (8.5, 2.5, 3.4), "bus": (11.0, 2.6, 3.2),
         "pedestrian": (0.5, 0.5, 1.75), "barrier": (2.0, 0.6, 1.0), "traffic light": (0.3, 0.8, 2.0)}

# Moving status of a vehicle, as DriveLM's multiple-choice options phrase it.
VEHICLE_STATUS = ("going ahead", "turn left", "turn right", "stopped")
TURN_YAW_RAD = math.radians(32.0)

EGO_SPEEDS = ("not moving", "driving slowly", "driving with normal speed", "driving fast")
EGO_DIRECTIONS = ("going straight", "slightly steering to the left", "steering to the left",
                  "slightly steering to the right", "steering to the right")
CURVATURES = {"going straight": 0.0, "slightly steering to the left": 0.005, "steering to the left": 0.011,
              "slightly steering to the right": -0.005, "steering to the right": -0.011}


@dataclass
class Road:
    n_same: int                 # lanes in the ego's direction
    n_opposite: int             # oncoming lanes (left of a double yellow line)
    ego_lane: int               # 0 = rightmost lane of the ego's direction
    curvature: float            # 1/m ahead of the ego (positive: bends left); straight behind
    crosswalk_s: float | None   # near edge of a zebra crossing ahead, if any
    stop_line_s: float | None
    # Where the ego is along the road at the moment drawn (motion.py): 0 at the key frame, v * t
    # before it. The road behind the ego is straight, so the ego's frame at that moment is the key
    # frame's shifted by ego_s along x.
    ego_s: float = 0.0

    # Lateral positions (d, metres, left positive) of the road's features.
    def lane_centre(self, j: int) -> float:
        """j counts from the rightmost same-direction lane (0) leftwards over all lanes."""
        return (j - self.ego_lane) * LANE_WIDTH

    @property
    def right_edge(self) -> float:
        return -self.ego_lane * LANE_WIDTH - LANE_WIDTH / 2

    @property
    def divider(self) -> float:
        return self.right_edge + self.n_same * LANE_WIDTH

    @property
    def left_edge(self) -> float:
        return self.divider + self.n_opposite * LANE_WIDTH

    def heading(self, s: np.ndarray | float) -> np.ndarray | float:
        return self.curvature * np.maximum(s, 0.0)

    def point(self, s, d) -> np.ndarray:
        """Lane coordinates -> ego x, y (arrays broadcast); an exact circular arc for s > 0."""
        s = np.asarray(s, dtype=np.float64)
        d = np.asarray(d, dtype=np.float64)
        k = self.curvature
        ahead = np.maximum(s, 0.0)
        if abs(k) < 1e-9:
            cx, cy = s, np.zeros_like(s)
        else:
            cx = np.where(s > 0, np.sin(k * ahead) / k, s)
            cy = np.where(s > 0, (1.0 - np.cos(k * ahead)) / k, 0.0)
        theta = k * ahead
        x = cx - d * np.sin(theta)
        y = cy + d * np.cos(theta)
        if self.ego_s:
            x = x - self.ego_s
        return np.stack(np.broadcast_arrays(x, y), axis=-1)


@dataclass
class WorldObject:
    kind: str
    colour: str                 # colour name (body, shirt, barrier) or the light's state
    s: float
    d: float
    yaw: float                  # heading in the ego frame, radians
    status: str                 # vehicles: VEHICLE_STATUS; pedestrians: walking/standing; lights: state
    # ego lane / same lane / oncoming lane / parking / sidewalk / crossing / roadside / overhead
    place: str
    x: float = 0.0
    y: float = 0.0
    parked: bool = False
    mount_d: float = 0.0        # traffic lights: lateral position of the pole
    # What one frame shows, when not decided by the status (None: as the status says, lamps lit
    # when stopped in a lane, legs apart when walking). Scenes in motion set them apart from the
    # status, so that one frame does not give the motion away (motion.py).
    brake_lamps: bool | None = None
    legs_apart: bool | None = None
    motion: Any = None          # motion.Motion of a scene in motion: its intent and its poses over time

    @property
    def size(self) -> tuple[float, float, float]:
        return SIZES[self.kind]

    @property
    def moving(self) -> bool | None:
        if self.kind in VEHICLE_KINDS:
            return self.status != "stopped"
        if self.kind == "pedestrian":
            return self.status == "walking"
        return None

    @property
    def distance(self) -> float:
        return math.hypot(self.x, self.y)

    @property
    def bearing(self) -> float:
        return math.degrees(math.atan2(self.y, self.x))

    @property
    def observed_status(self) -> str | None:
        """DriveLM's key_object_infos Status."""
        if self.kind in VEHICLE_KINDS:
            return "Parked" if self.parked else ("Stopped" if self.status == "stopped" else "Moving")
        if self.kind == "pedestrian":
            return "Moving" if self.status == "walking" else "Standing"
        return None


@dataclass
class Appearance:
    sky_top: tuple[int, int, int]
    sky_horizon: tuple[int, int, int]
    ground: tuple[int, int, int]
    asphalt: tuple[int, int, int]
    parking: tuple[int, int, int]
    sidewalk: tuple[int, int, int]


@dataclass
class World:
    road: Road
    objects: list[WorldObject]
    appearance: Appearance
    ego_speed: str = "driving fast"
    ego_direction: str = "going straight"
    light_state: str | None = None    # state of the traffic light(s) ahead, if any
    light_s: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def behaviour(self) -> str:
        return f"The ego vehicle is {self.ego_direction}. The ego vehicle is {self.ego_speed}."


def _jitter(rng: np.random.Generator, rgb, amount: int) -> tuple[int, int, int]:
    return tuple(int(np.clip(c + rng.integers(-amount, amount + 1), 0, 255)) for c in rgb)


def sample_appearance(rng: np.random.Generator) -> Appearance:
    sky = [((95, 150, 220), (170, 198, 232)), ((130, 150, 175), (165, 175, 190)), ((70, 120, 200), (160, 190, 228))]
    top, horizon = sky[rng.integers(len(sky))]
    ground = [(95, 130, 70), (130, 120, 85), (110, 115, 100)][rng.integers(3)]
    grey = int(rng.integers(88, 108))
    return Appearance(
        sky_top=_jitter(rng, top, 8), sky_horizon=_jitter(rng, horizon, 8), ground=_jitter(rng, ground, 8),
        asphalt=(grey, grey, grey + 3), parking=(grey - 18, grey - 18, grey - 16),
        sidewalk=_jitter(rng, (150, 146, 140), 6))


class _Slots:
    """Occupied stretches of road per lane/strip, so that objects never overlap."""

    def __init__(self):
        self.taken: dict[str, list[tuple[float, float]]] = {}

    def free(self, slot: str, lo: float, hi: float) -> bool:
        return all(hi <= a or lo >= b for a, b in self.taken.get(slot, []))

    def take(self, slot: str, lo: float, hi: float) -> None:
        self.taken.setdefault(slot, []).append((lo, hi))


MIN_DISTANCE_M = 6.0
MIN_SECTOR_MARGIN_DEG = 4.0


def _placeable(road: Road, s: float, d: float) -> bool:
    x, y = road.point(s, d)
    if math.hypot(x, y) < MIN_DISTANCE_M:
        return False
    return degrees_to_sector_edge(bearing_deg(x, y)) >= MIN_SECTOR_MARGIN_DEG


def sample_world(rng: np.random.Generator) -> World:
    """One random scene. The caller decides the RNG (per-scene seeding keeps scenes independent).

    The parts below draw from `rng` in this order, which is what keeps a seed's SynthDrive set the
    same: the road, the look of sky and ground, then the objects (lights, vehicles, barriers,
    pedestrians), each placed only where the ones before left room."""
    world = _empty_scene(rng)
    place = _Placement(world, rng)
    _place_traffic_lights(place)
    _place_vehicles(place)
    _place_barriers(place)
    _place_pedestrians(place)
    for obj in world.objects:
        obj.x, obj.y = (float(v) for v in world.road.point(obj.s, obj.d))
    decide_ego(world)
    return world


def _empty_scene(rng: np.random.Generator) -> World:
    """The scene without objects: the lanes, the ego's lane and its direction (the road's
    curvature), a zebra crossing and a traffic light ahead or not, and the look of sky and ground."""
    n_same = int(rng.choice([1, 2, 2, 3]))
    n_opposite = int(rng.choice([0, 1, 1, 2]))
    ego_lane = int(rng.integers(n_same))
    direction = str(rng.choice(EGO_DIRECTIONS, p=[0.4, 0.15, 0.15, 0.15, 0.15]))
    has_light = rng.random() < 0.5
    has_crossing = rng.random() < 0.45
    crosswalk_s = float(rng.uniform(14.0, 26.0)) if has_crossing else None
    light_s = None
    if has_light:
        light_s = crosswalk_s + 5.0 if crosswalk_s is not None else float(rng.uniform(14.0, 30.0))
    stop_line_s = (crosswalk_s - 1.5) if crosswalk_s is not None else (light_s - 3.0 if light_s else None)
    light_state = str(rng.choice(LIGHT_STATES, p=[0.5, 0.15, 0.35])) if has_light else None
    road = Road(n_same, n_opposite, ego_lane, CURVATURES[direction], crosswalk_s, stop_line_s)
    return World(road, [], sample_appearance(rng), light_state=light_state, light_s=light_s)


class _Placement:
    """The scene being filled: its world, the RNG, and the stretches of road already taken."""

    def __init__(self, world: World, rng: np.random.Generator):
        self.world, self.road, self.rng = world, world.road, rng
        self.slots = _Slots()
        self.colour_names = list(COLOURS)

    def colour(self) -> str:
        return self.colour_names[self.rng.integers(len(self.colour_names))]

    def blocked_by_crossing(self, lo: float, hi: float) -> bool:
        crosswalk_s = self.road.crosswalk_s
        if crosswalk_s is None:
            return False
        return not (hi < crosswalk_s - 3.0 or lo > crosswalk_s + 5.0)


def _place_traffic_lights(place: _Placement) -> None:
    """One by the right roadside, sometimes a second over the ego lane."""
    world, road = place.world, place.road
    if world.light_s is None:
        return
    pole_d = road.right_edge - PARKING_WIDTH - 0.6
    world.objects.append(WorldObject("traffic light", world.light_state, world.light_s, pole_d, 0.0,
                                     world.light_state, "roadside", mount_d=pole_d))
    if place.rng.random() < 0.5:
        world.objects.append(WorldObject("traffic light", world.light_state, world.light_s, 0.0, 0.0,
                                         world.light_state, "overhead", mount_d=pole_d))


def _place_vehicles(place: _Placement) -> None:
    """Vehicles in lanes and on the parking strips: up to 4 tries per vehicle wanted."""
    world, road, rng = place.world, place.road, place.rng
    n_vehicles = int(rng.integers(2, 9))
    lanes = [("same", j) for j in range(road.n_same)] + \
        [("oncoming", road.n_same + j) for j in range(road.n_opposite)]
    for _ in range(n_vehicles * 4):
        if sum(o.kind in VEHICLE_KINDS for o in world.objects) >= n_vehicles:
            break
        kind = str(rng.choice(VEHICLE_KINDS, p=[0.62, 0.2, 0.18]))
        length = SIZES[kind][0]
        s = float(rng.uniform(-45.0, 60.0))
        lo, hi = s - length / 2 - 2.5, s + length / 2 + 2.5
        if rng.random() < 0.22:                                   # parked on a parking strip
            side = "right" if rng.random() < 0.6 or road.n_opposite == 0 else "left"
            d = road.right_edge - PARKING_WIDTH / 2 if side == "right" else road.left_edge + PARKING_WIDTH / 2
            slot, place_name, yaw_base, status, parked = f"parking_{side}", "parking", 0.0, "stopped", True
            if side == "left":
                yaw_base = math.pi
        else:
            lane = _vehicle_in_lane(world, rng, lanes, s)
            if lane is None:
                continue
            d, slot, place_name, yaw_base, status = lane
            parked = False
        if not place.slots.free(slot, lo, hi) or place.blocked_by_crossing(lo, hi) or not _placeable(road, s, d):
            continue
        if place_name == "ego lane" and s > 0 and world.light_s is not None and s > world.light_s - 4.0:
            continue                                              # keep the light in view
        turn = {"turn left": TURN_YAW_RAD, "turn right": -TURN_YAW_RAD}.get(status, 0.0)
        yaw = float(road.heading(s)) + yaw_base + turn
        place.slots.take(slot, lo, hi)
        world.objects.append(WorldObject(kind, place.colour(), s, d, yaw, status, place_name, parked=parked))


def _vehicle_in_lane(world: World, rng: np.random.Generator, lanes: list[tuple[str, int]], s: float
                     ) -> tuple[float, str, str, float, str] | None:
    """(d, slot, place, yaw_base, status) of a vehicle at s in a lane drawn from `lanes`; None
    where the ego itself is (its own lane, |s| < 8 m)."""
    road = world.road
    direction_of_lane, j = lanes[rng.integers(len(lanes))]
    d = road.lane_centre(j)
    slot = f"lane_{j}"
    if direction_of_lane != "same":
        return d, slot, "oncoming lane", math.pi, str(rng.choice(VEHICLE_STATUS[:3], p=[0.5, 0.25, 0.25]))
    place = "ego lane" if j == road.ego_lane else "same lane"
    if j == road.ego_lane and abs(s) < 8.0:
        return None
    ahead_of_light = world.light_s is not None and 0.0 < s < world.light_s
    if ahead_of_light and world.light_state == "red":
        status = "stopped"
    else:
        status = str(rng.choice(VEHICLE_STATUS, p=[0.4, 0.2, 0.2, 0.2]))
        if status == "stopped" and s < 0:               # brake lamps only show from behind
            status = "going ahead"
    return d, slot, place, 0.0, status


def _place_barriers(place: _Placement) -> None:
    """On a parking strip, or closing a lane next to the ego's ahead."""
    world, road, rng = place.world, place.road, place.rng
    for _ in range(int(rng.choice([0, 0, 1, 2, 3]))):
        s = float(rng.uniform(-35.0, 45.0))
        if rng.random() < 0.25 and road.n_same > 1:
            j = road.ego_lane + (1 if road.ego_lane + 1 < road.n_same else -1)
            d, slot = road.lane_centre(j) + float(rng.uniform(-0.6, 0.6)), f"lane_{j}"
        else:
            side = "right" if rng.random() < 0.6 else "left"
            d = road.right_edge - 0.8 if side == "right" else road.left_edge + 0.8
            slot = f"parking_{side}"
        if not place.slots.free(slot, s - 2.5, s + 2.5) or place.blocked_by_crossing(s - 1, s + 1) \
                or not _placeable(road, s, d):
            continue
        place.slots.take(slot, s - 2.5, s + 2.5)
        world.objects.append(WorldObject("barrier", BARRIER_COLOUR, s, d, float(road.heading(s)), "static", "roadside"))


def _place_pedestrians(place: _Placement) -> None:
    """Crossing ahead on the zebra (only when traffic must stop for them), and walking or
    standing on the sidewalks."""
    world, road, rng = place.world, place.road, place.rng
    crosswalk_s = road.crosswalk_s
    if crosswalk_s is not None and world.light_state in (None, "red") and rng.random() < 0.9:
        for _ in range(int(rng.integers(1, 4))):
            d = float(rng.uniform(road.right_edge + 0.5, road.left_edge - 0.5))
            s = crosswalk_s + float(rng.uniform(0.8, 2.2))
            if not place.slots.free(f"crossing_{round(d)}", d - 1.0, d + 1.0) or not _placeable(road, s, d):
                continue
            place.slots.take(f"crossing_{round(d)}", d - 1.0, d + 1.0)
            yaw = float(road.heading(s)) + (math.pi / 2 if rng.random() < 0.5 else -math.pi / 2)
            world.objects.append(WorldObject("pedestrian", place.colour(), s, d, yaw, "walking", "crossing"))
    for _ in range(int(rng.integers(0, 4))):
        side = "right" if rng.random() < 0.5 else "left"
        edge = road.right_edge - PARKING_WIDTH if side == "right" else road.left_edge + PARKING_WIDTH
        offset = float(rng.uniform(0.6, SIDEWALK_WIDTH - 0.6))
        d = edge - offset if side == "right" else edge + offset
        s = float(rng.uniform(-30.0, 40.0))
        if not place.slots.free(f"sidewalk_{side}", s - 1.0, s + 1.0) or not _placeable(road, s, d):
            continue
        place.slots.take(f"sidewalk_{side}", s - 1.0, s + 1.0)
        walking = rng.random() < 0.5
        yaw = float(road.heading(s)) + (0.0 if rng.random() < 0.5 else math.pi)
        world.objects.append(WorldObject("pedestrian", place.colour(), s, d, yaw,
                                         "walking" if walking else "standing", "sidewalk"))


def decide_ego(world: World) -> None:
    """The ego's speed and direction, from what its cameras show (recomputed after culling)."""
    crossing = [o for o in world.objects if o.kind == "pedestrian" and o.place == "crossing"]
    ahead = sorted((o for o in world.objects if o.kind in VEHICLE_KINDS and o.place == "ego lane" and o.s > 0),
                   key=lambda o: o.s)
    lights = [o for o in world.objects if o.kind == "traffic light"]
    state = lights[0].status if lights else None
    world.light_state = state
    if state == "red" or crossing or (ahead and ahead[0].status == "stopped" and ahead[0].s < 16.0):
        speed = "not moving"
    elif state == "yellow" or (ahead and ahead[0].s < 20.0):
        speed = "driving slowly"
    elif ahead and ahead[0].s < 38.0:
        speed = "driving with normal speed"
    else:
        speed = "driving fast"
    world.ego_speed = speed
    world.ego_direction = "going straight" if speed == "not moving" else \
        {v: k for k, v in CURVATURES.items()}[world.road.curvature]
