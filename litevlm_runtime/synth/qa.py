"""DriveLM v1.1 questions and answers for one SynthDrive frame.

Every answer is decided by what the six images show (the objects that survived culling, drawn
where the tags say), with DriveLM's own phrasings where DriveLM has the question, and a short
answer vocabulary. Many questions name a direction ("to the back left of the ego car") or a
tagged camera, which is what a view selector keys on. Choice questions carry four shuffled
options like the DriveLM challenge's ("Please select the correct answer from the following
options: A. ... D. ...") and are answered by the letter; yes/no answers are "Yes." / "No.", and
within a frame a yes/no question template about several objects keeps as many "Yes." as "No."
answers, so that a model that does not look at the images cannot score by guessing the common
answer.

A scene in motion (motion.py, `litevlm synth --frames K`) is asked the same questions, their
answers decided by what the objects do over the K steps, plus motion questions of its own
(`_motion`: approaching, crossing the ego lane, what the ego should do next). Every question whose
answer depends on how objects move carries `"frames": K`, the one addition to DriveLM's item
layout: the answer is defined over the key frame and the K - 1 frame sets before it, and
evaluation counts it in the category `motion` (docs/motion.md).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from .motion import APPROACH_MPS, STEADY_MPS
from .world import EGO_DIRECTIONS, EGO_SPEEDS, LANE_WIDTH, PLURAL, VEHICLE_KINDS, World, WorldObject

DIRECTION = {"CAM_FRONT": "front", "CAM_FRONT_LEFT": "front left", "CAM_FRONT_RIGHT": "front right",
             "CAM_BACK": "back", "CAM_BACK_LEFT": "back left", "CAM_BACK_RIGHT": "back right"}
NUMBER = {1: "one", 2: "two", 3: "three"}
# The DriveLM challenge draws distractors from "Going ahead.", "Turn right.", "Turn left.",
# "Stopped.", "Back up.", "Reverse parking.", "Drive backward."; SynthDrive vehicles only ever do
# the first four, and offering the others would let a model that never looks at the images rule
# them out, so the options are those four, shuffled.
MOVING_OPTIONS = ["Going ahead.", "Turn right.", "Turn left.", "Stopped."]
STATUS_TEXT = {"going ahead": "Going ahead.", "turn left": "Turn left.", "turn right": "Turn right.",
               "stopped": "Stopped."}
COLOUR_OPTIONS = ["Red.", "Blue.", "Green.", "Yellow.", "White.", "Black."]
COUNT_OPTIONS = ["None.", "One.", "Two.", "Three.", "More than three."]
LIGHT_OPTIONS = ["Red light.", "Yellow light.", "Green light.", "There is no traffic light."]
DO_NEXT_OPTIONS = ["Stop.", "Slow down.", "Keep going at the same speed.", "Speed up."]
DO_NEXT_Q = "What should the ego vehicle do next?"
LEAD_RANGE_M = 40.0                  # a vehicle ahead in the ego lane within this is the one the ego follows
BEHAVIOURS = [f"The ego vehicle is {d}. The ego vehicle is {s}." for d in EGO_DIRECTIONS for s in EGO_SPEEDS
              if s != "not moving"] + ["The ego vehicle is going straight. The ego vehicle is not moving."]
OPTIONS_PROMPT = " Please select the correct answer from the following options:"
IMPORTANT_Q = ("What are the important objects in the current scene? Those objects will be considered for the "
               "future reasoning and driving decision.")
NOTICE_Q = ("What object should the ego vehicle notice first when the ego vehicle is getting to the next possible "
            "location? What is the state of the object that is first noticed by the ego vehicle and what action "
            "should the ego vehicle take? What object should the ego vehicle notice second when the ego vehicle is "
            "getting to the next possible location? What is the state of the object perceived by the ego vehicle "
            "as second and what action should the ego vehicle take? What object should the ego vehicle notice "
            "third? What is the state of the object perceived by the ego vehicle as third and what action should "
            "the ego vehicle take?")
MAX_KEY_OBJECTS = 4


def qa(question: str, answer: str) -> dict:
    return {"Q": question, "A": answer, "C": None, "con_up": None, "con_down": None, "cluster": None, "layer": None}


def where(camera: str) -> str:
    return f"to the {DIRECTION[camera]} of the ego car"


def count_phrase(kind: str, n: int) -> str:
    return f"{NUMBER.get(n, 'many')} {kind if n == 1 else PLURAL[kind]}"


def join(items: list[str]) -> str:
    if len(items) <= 2:
        return " and ".join(items)
    return ", ".join(items[:-1]) + ", and " + items[-1]


def article(phrase: str) -> str:
    return ("an " if phrase[0] in "aeiou" else "a ") + phrase


def description(obj: WorldObject) -> str:
    """DriveLM's Visual_description, without the full stop."""
    if obj.kind in VEHICLE_KINDS:
        return f"{obj.colour} {obj.kind}"
    if obj.kind == "pedestrian":
        return f"pedestrian in {obj.colour}"
    if obj.kind == "barrier":
        return f"{obj.colour} barrier"
    return f"{obj.status} light"


def status_word(obj: WorldObject) -> str | None:
    """moving / parked / stopped / standing: the adjective of DriveLM's "Are there parked trucks ..."."""
    if obj.kind in VEHICLE_KINDS:
        return "parked" if obj.parked else ("stopped" if obj.status == "stopped" else "moving")
    if obj.kind == "pedestrian":
        return "moving" if obj.status == "walking" else "standing"
    return None


def cap(text: str) -> str:
    return text[0].upper() + text[1:]


class _Choice:
    def __init__(self, rng: np.random.Generator):
        self.rng = rng

    def __call__(self, question: str, answer: str, pool: list[str]) -> dict:
        """A 4-option choice question: the answer plus 3 distractors from pool, shuffled."""
        others = [p for p in pool if p != answer]
        picks = [others[i] for i in self.rng.choice(len(others), size=3, replace=False)] + [answer]
        order = self.rng.permutation(4)
        options = [picks[i] for i in order]
        letters = "ABCD"
        text = question + OPTIONS_PROMPT + "".join(f" {letters[i]}. {opt}" for i, opt in enumerate(options))
        return qa(text, letters[options.index(answer)])


def _balance(items: list[tuple[str, dict]], rng: np.random.Generator) -> list[dict]:
    """Keep per template as many yes as no answers, dropping at random; templates whose name
    starts with "=" are asked once per frame and kept as they are."""
    by_template: dict[str, list[dict]] = {}
    for template, item in items:
        by_template.setdefault(template, []).append(item)
    keep_ids = set()
    for template, group in by_template.items():
        if template.startswith("="):
            keep_ids.update(id(q) for q in group)
            continue
        yes = [q for q in group if q["A"] == "Yes."]
        no = [q for q in group if q["A"] == "No."]
        limit = min(len(yes), len(no))
        for side in (yes, no):
            for i in sorted(rng.permutation(len(side))[:limit]):
                keep_ids.add(id(side[i]))
        keep_ids.update(id(q) for q in group if q["A"] not in ("Yes.", "No."))
    return [item for _, item in items if id(item) in keep_ids]


# Where an object is, never what it does, decides which objects are key objects and their order
# (c1, c2, ...): a parking strip holds only parked vehicles in a single-frame scene, and a moving
# one too in a scene in motion, whose tags must not tell which.
def _in_ego_path(obj: WorldObject) -> bool:
    if obj.kind == "traffic light":
        return True
    if obj.s <= 0:
        return False
    if obj.kind == "pedestrian":
        return obj.place == "crossing"
    return abs(obj.d) < LANE_WIDTH / 2 and obj.place != "parking"


def _priority(obj: WorldObject) -> float:
    """Lower first: what matters most to the ego's next move."""
    if obj.kind == "traffic light":
        return 0.0 + (0.5 if obj.place == "overhead" else 0.0)
    if obj.kind == "pedestrian" and obj.place == "crossing":
        return 1.0 + obj.distance / 100
    if _in_ego_path(obj):
        return 2.0 + obj.distance / 100
    if obj.s > 0 and obj.place != "parking":
        return 3.0 + obj.distance / 100
    return 4.0 + obj.distance / 100


def _action(world: World, obj: WorldObject) -> tuple[str, str]:
    """(action, reason) of the ego because of obj, as DriveLM phrases them."""
    if obj.kind == "traffic light":
        return {"red": ("stop", "to follow the traffic rules"), "yellow": ("slow down", "to follow the traffic rules"),
                "green": ("keep going at the same speed", "to follow the traffic rules")}[obj.status]
    if obj.kind == "pedestrian" and obj.place == "crossing":
        return "stop", "to yield to the pedestrian"
    if _in_ego_path(obj) and obj.kind in VEHICLE_KINDS:
        if obj.status == "stopped" and obj.s < 16.0:
            return "stop", "to avoid a collision"
        if obj.s < 20.0:
            return "slow down", "to keep a safe distance"
    if _in_ego_path(obj) and obj.kind == "barrier" and obj.s < 20.0:
        return "slow down", "to avoid a collision"
    return "keep going at the same speed", "there is no safety issue"


def _collision_action(world: World, obj: WorldObject) -> str:
    road = world.road
    if _in_ego_path(obj) and obj.kind != "traffic light":
        return "Accelerate and go straight."
    if obj.kind in VEHICLE_KINDS and abs(obj.d) < LANE_WIDTH / 2 and obj.s < 0:
        return "Back up."
    if obj.kind in VEHICLE_KINDS + ("barrier",) and obj.place != "parking" and -20.0 < obj.s < 20.0:
        if abs(obj.d - LANE_WIDTH) < LANE_WIDTH / 2 and road.ego_lane + 1 < road.n_same + road.n_opposite:
            return "Change to the left lane."
        if abs(obj.d + LANE_WIDTH) < LANE_WIDTH / 2 and road.ego_lane > 0:
            return "Change to the right lane."
    return "No such action will lead to a collision."


def lane_change_safe(world: World, side: str) -> bool:
    road = world.road
    j = road.ego_lane + (1 if side == "left" else -1)
    if j < 0 or j >= road.n_same:       # no lane there, or it carries oncoming traffic
        return False
    centre = road.lane_centre(j)
    for obj in world.objects:
        if abs(obj.d - centre) < LANE_WIDTH / 2 and -25.0 < obj.s < 20.0 and obj.kind != "traffic light":
            return False
    return True


def frame_qa(world: World, objects: list[tuple[WorldObject, str, dict]], rng: np.random.Generator,
             frames: int = 1) -> tuple[dict, dict[int, str]]:
    """(frame dict with key_object_infos and QA, {id(object): "cN"}). objects: (object, camera, views).
    frames > 1: a scene in motion over that many steps (objects carry motion.Motion).

    The question groups below draw from `rng` in this order, which is what keeps a seed's
    SynthDrive set the same: a new group goes after the others, never between them."""
    # IDs c1.. by priority; the first MAX_KEY_OBJECTS are the key objects questions name.
    ranked = sorted(objects, key=lambda t: _priority(t[0]))
    tags, tag_text, infos = _key_object_tags(ranked[:MAX_KEY_OBJECTS])
    f = _FrameView(world, objects, rng, [t[0] for t in ranked[:MAX_KEY_OBJECTS]], tag_text, frames)

    perception = _important_objects(f) + _objects_by_direction(f) + _group_status(f)
    _are_there(f)
    perception += _counts_and_colours(f) + _traffic_light(f) + _key_object_perception(f)
    prediction = _prediction(f)
    planning = _planning(f)
    behaviour = [qa("Predict the behavior of the ego vehicle.", world.behaviour),
                 f.choice("Predict the behavior of the ego vehicle.", world.behaviour, BEHAVIOURS)]
    if frames > 1:
        planning += _motion(f)

    perception += _balance(f.yes_no["perception"], rng)
    prediction = _balance(f.yes_no["prediction"], rng) + prediction
    planning = _balance(f.yes_no["planning"], rng) + planning
    frame = {"key_object_infos": infos,
             "QA": {"perception": perception, "prediction": prediction, "planning": planning, "behavior": behaviour}}
    return frame, tags


def _key_object_tags(key: list[tuple[WorldObject, str, dict]]) -> tuple[dict, dict, dict]:
    """({id: "cN"}, {id: "<cN,CAM_X,x,y>"}, key_object_infos) of the key objects, in priority order."""
    tags, tag_text, infos = {}, {}, {}
    for n, (obj, cam, views) in enumerate(key, start=1):
        x, y = views[cam].centre
        tags[id(obj)] = f"c{n}"
        tag_text[id(obj)] = f"<c{n},{cam},{x:.1f},{y:.1f}>"
        category = {"pedestrian": "Pedestrian", "barrier": "Barrier", "traffic light": "Traffic element"}.get(
            obj.kind, "Vehicle")
        infos[tag_text[id(obj)]] = {"Category": category, "Status": obj.observed_status,
                                    "Visual_description": cap(description(obj)) + ".",
                                    "2d_bbox": [round(v, 1) for v in views[cam].bbox]}
    return tags, tag_text, infos


KINDS_ORDER = list(VEHICLE_KINDS) + ["pedestrian", "barrier", "traffic light"]


class _FrameView:
    """What the question groups of one frame read: the objects the cameras show, grouped by camera
    and kind, the key objects with their tags, and the yes/no questions collected per section
    (balanced per template at the end)."""

    def __init__(self, world: World, objects: list[tuple[WorldObject, str, dict]], rng: np.random.Generator,
                 key: list[WorldObject], tag_text: dict[int, str], frames: int = 1):
        self.world, self.objects, self.rng, self.key, self.tag_text = world, objects, rng, key, tag_text
        self.frames = frames
        self.choice = _Choice(rng)
        self.cam_of = {id(o): cam for o, cam, _ in objects}
        self.groups: dict[str, Counter] = {cam: Counter() for cam in DIRECTION}
        self.status_groups: dict[tuple, list] = {}
        for obj, cam, _ in objects:
            self.groups[cam][obj.kind] += 1
            self.status_groups.setdefault((cam, obj.kind), []).append(obj)
        lights = [o for o, cam, _ in objects if o.kind == "traffic light" and cam == "CAM_FRONT"]
        self.front_light = lights[0].status if lights else None     # the state of the light ahead, if any
        self.yes_no: dict[str, list[tuple[str, dict]]] = {"perception": [], "prediction": [], "planning": []}

    def timed(self, item: dict) -> dict:
        """Mark a question whose answer depends on how objects move: in a scene in motion it is
        defined over `frames` frame sets (DriveLM's item plus "frames"); a single frame's is left as is."""
        if self.frames > 1:
            item["frames"] = self.frames
        return item


# -- perception --------------------------------------------------------------------------------

def _important_objects(f: _FrameView) -> list[dict]:
    if not f.key:
        return [qa(IMPORTANT_Q, "There are no important objects in the current scene.")]
    phrases = [f"{article(description(o))} {where(f.cam_of[id(o)]).replace('ego car', 'ego vehicle')}" for o in f.key]
    ids = [f.tag_text[id(o)] for o in f.key]
    return [qa(IMPORTANT_Q, f"There is {join(phrases)}. The IDs of these objects are {join(ids)}.")]


def _objects_by_direction(f: _FrameView) -> list[dict]:
    """"What are objects to the front of the ego car?" for every camera with objects and one without."""
    out = []
    occupied = [cam for cam in DIRECTION if f.groups[cam]]
    empty = [cam for cam in DIRECTION if not f.groups[cam]]
    listed = occupied + ([empty[f.rng.integers(len(empty))]] if empty else [])
    for cam in listed:
        parts = [count_phrase(k, f.groups[cam][k]) for k in KINDS_ORDER if f.groups[cam][k]]
        if parts:
            verb = "There is" if parts[0].startswith("one ") else "There are"
            answer = f"{verb} {join(parts)} {where(cam)}."
        else:
            answer = f"There are no objects {where(cam)}."
        out.append(qa(f"What are objects {where(cam)}?", answer))
    return out


def _group_status(f: _FrameView) -> list[dict]:
    """Status of a group: "What is the status of the cars that are to the front of the ego car?" """
    out = []
    movers = [(cam, kind) for (cam, kind), objs in f.status_groups.items()
              if kind in VEHICLE_KINDS + ("pedestrian",) and len(objs) <= 3]
    for i in f.rng.permutation(len(movers))[:2]:
        cam, kind = movers[i]
        objs = f.status_groups[(cam, kind)]
        words = Counter(status_word(o) for o in objs)
        if len(objs) == 1:
            answer = f"The {kind} {where(cam)} is {status_word(objs[0])}."
            question = f"What is the status of the {kind} that is {where(cam)}?"
        else:
            question = f"What is the status of the {PLURAL[kind]} that are {where(cam)}?"
            if len(words) == 1:
                answer = f"{cap(NUMBER[len(objs)])} {PLURAL[kind]} are {next(iter(words))}."
            else:
                answer = _status_mix(kind, words)
        out.append(f.timed(qa(question, answer)))
    return out


def _are_there(f: _FrameView) -> None:
    """Yes/no: "Are there parked trucks to the back left of the ego car?", one yes and its no twin."""
    present = {(cam, o.kind, status_word(o)) for o, cam, _ in f.objects}
    vehicle_words = ["moving", "parked", "stopped"]
    candidates = [(cam, kind, word) for cam in DIRECTION for kind in KINDS_ORDER
                  for word in ({"car": vehicle_words, "truck": vehicle_words, "bus": vehicle_words,
                                "pedestrian": ["moving", "standing"]}.get(kind, [None]))]
    yes_c = [c for c in candidates if c in present]
    no_c = [c for c in candidates if c not in present]
    for i in f.rng.permutation(len(yes_c))[:1]:
        cam, kind, word = yes_c[i]
        # Its "no" twin asks about the same direction and another kind or status that is absent
        # there, else about the same kind and status elsewhere: one yes and one no per frame.
        twins = [c for c in no_c if c[0] == cam] or [c for c in no_c if c[1:] == (kind, word)]
        if not twins:
            continue
        twin = twins[f.rng.integers(len(twins))]
        for (c, k, w), answer in (((cam, kind, word), "Yes."), (twin, "No.")):
            noun = PLURAL[k] if w is None else f"{w} {PLURAL[k]}"
            item = qa(f"Are there {noun} {where(c)}?", answer)
            f.yes_no["perception"].append(("are_there", item if w is None else f.timed(item)))


def _counts_and_colours(f: _FrameView) -> list[dict]:
    """Counts and colours, as choice questions."""
    out = []
    count_pairs = [(cam, kind) for cam in DIRECTION for kind in KINDS_ORDER if kind != "traffic light"]
    picks = [p for p in count_pairs if f.groups[p[0]][p[1]]]
    for pool in (picks, count_pairs):
        if pool:
            cam, kind = pool[f.rng.integers(len(pool))]
            n = f.groups[cam][kind]
            answer = COUNT_OPTIONS[min(n, 4)]
            out.append(f.choice(f"How many {PLURAL[kind]} are there {where(cam)}?", answer, COUNT_OPTIONS))
    singles = [(cam, kind) for (cam, kind), objs in f.status_groups.items()
               if len(objs) == 1 and kind in VEHICLE_KINDS + ("pedestrian",)]
    for i in f.rng.permutation(len(singles))[:2]:
        cam, kind = singles[i]
        obj = f.status_groups[(cam, kind)][0]
        q = (f"What colour is the {kind} {where(cam)}?" if kind != "pedestrian"
             else f"What colour is the shirt of the pedestrian {where(cam)}?")
        out.append(f.choice(q, cap(obj.colour) + ".", COLOUR_OPTIONS))
    return out


def _traffic_light(f: _FrameView) -> list[dict]:
    f.yes_no["perception"].append(("=light_present", qa("Is there a traffic light in front of the ego car?",
                                                        "Yes." if f.front_light else "No.")))
    state = f.front_light
    return [f.choice("What is the state of the traffic light in front of the ego car?",
                     f"{cap(state)} light." if state else LIGHT_OPTIONS[-1], LIGHT_OPTIONS)]


def _key_object_perception(f: _FrameView) -> list[dict]:
    out = []
    for obj in f.key:
        t = f.tag_text[id(obj)]
        out.append(qa(f"What is the visual description of {t}?", cap(description(obj)) + "."))
        if obj.kind in VEHICLE_KINDS + ("pedestrian",) and f.rng.random() < 0.6:
            out.append(f.timed(qa(f"What is the observed status of object {t}?", obj.observed_status + ".")))
        if obj.kind in VEHICLE_KINDS:
            out.append(f.timed(f.choice(f"What is the moving status of object {t}?", STATUS_TEXT[obj.status],
                                        MOVING_OPTIONS)))
    return out


# -- prediction --------------------------------------------------------------------------------

def _prediction(f: _FrameView) -> list[dict]:
    out = []
    for obj in f.key:
        t = f.tag_text[id(obj)]
        f.yes_no["prediction"].append(("sign_or_barrier", qa(
            f"Is {t} a traffic sign or a road barrier?",
            "Yes." if obj.kind in ("traffic light", "barrier") else "No.")))
        f.yes_no["prediction"].append(("in_path", qa(
            f"Would {t} be in the moving direction of the ego vehicle?", "Yes." if _in_ego_path(obj) else "No.")))
        if obj.kind in VEHICLE_KINDS + ("pedestrian",):
            f.yes_no["prediction"].append(("is_moving", f.timed(qa(f"Is {t} moving?",
                                                                   "Yes." if obj.moving else "No."))))
            if obj.kind in VEHICLE_KINDS:
                future = STATUS_TEXT[obj.status]
            elif obj.place == "crossing":
                future = "Cross the road."
            else:
                future = "Keep walking." if obj.status == "walking" else "Keep standing."
            if f.rng.random() < 0.5:
                out.append(f.timed(qa(f"What is the future state of {t}?", future)))
    if f.key:
        out.append(qa(NOTICE_Q, " ".join(_notice_sentence(f, ordinal, obj)
                                         for ordinal, obj in zip(["Firstly", "Secondly", "Thirdly"], f.key))))
    return out


def _notice_sentence(f: _FrameView, ordinal: str, obj: WorldObject) -> str:
    action, _ = _action(f.world, obj)
    if obj.kind == "traffic light":
        state_text = f"a traffic light showing {obj.status}"
    elif obj.kind == "barrier":
        state_text = "a road barrier"
    elif obj.kind == "pedestrian":
        state_text = "crossing the road" if obj.place == "crossing" else f"{status_word(obj)}"
    else:
        state_text = {"going ahead": "going ahead", "turn left": "turning left", "turn right": "turning right",
                      "stopped": "parked" if obj.parked else "stopped"}[obj.status]
    return (f"{ordinal} notice that {f.tag_text[id(obj)]}. The object is {state_text}, "
            f"so the ego vehicle should {action}.")


# -- planning ----------------------------------------------------------------------------------

def _planning(f: _FrameView) -> list[dict]:
    world, out = f.world, []
    for obj in f.key:
        t = f.tag_text[id(obj)]
        action, reason = _action(world, obj)
        reason_text = f"The reason is {reason}"
        if f.rng.random() < 0.6:
            out.append(qa(f"What actions could the ego vehicle take based on {t}? Why take this action and "
                          f"what's the probability?",
                          f"The action is to {action}. {reason_text}, which has a high probability."))
        if obj.kind != "traffic light" and f.rng.random() < 0.6:
            out.append(qa(f"What actions taken by the ego vehicle can lead to a collision with {t}?",
                          _collision_action(world, obj)))
    for side in ("left", "right"):
        f.yes_no["planning"].append(("lane_change", qa(
            f"Is it safe for the ego vehicle to change to the {side} lane?",
            "Yes." if lane_change_safe(world, side) else "No.")))
    stop = world.ego_speed == "not moving"
    # Asked both ways round, so that the pair is always one yes and one no.
    f.yes_no["planning"].append(("=stop", qa("Does the ego vehicle need to stop?", "Yes." if stop else "No.")))
    f.yes_no["planning"].append(("=stop", qa("Can the ego vehicle keep going without stopping?",
                                             "No." if stop else "Yes.")))
    state = f.front_light
    out.append(qa("What is the traffic signal that the ego vehicle should pay attention to?",
                  f"{cap(state)} light." if state else "None."))
    turn = world.road.curvature
    if stop:
        target, safe, danger = "Stop.", "Stop, keep stationary.", "Accelerate and go straight."
    elif world.ego_speed == "driving slowly":
        target = "Slow down."
        safe, danger = "Slow down, decelerate gradually without braking.", "Accelerate and go straight."
    else:
        target = "Go straight." if turn == 0 else ("Turn left." if turn > 0 else "Turn right.")
        safe = "Keep going at the same speed, decelerate gradually without braking."
        danger = "Back up, brake suddenly."
    for side in ("left", "right"):
        if not lane_change_safe(world, side):
            danger = danger[:-1] + f", change to the {side} lane."
    out.append(qa("What is the target action of the ego vehicle?", target))
    out.append(qa("In this scenario, what are safe actions to take for the ego vehicle?", safe))
    out.append(qa("In this scenario, what are dangerous actions to take for the ego vehicle?", danger))
    return out


# -- motion (scenes in motion only) --------------------------------------------------------------

def _motion(f: _FrameView) -> list[dict]:
    """Questions only time answers: is a key object approaching the ego, will it cross the ego
    lane (yes/no, balanced per frame with the others of their template), and what the ego should
    do next because of the vehicle it follows. Labels that fall between the thresholds of
    motion.labels are None and not asked. Returns the planning questions; the yes/no ones join
    the frame's prediction questions (python -m litevlm_runtime.evaluation.one_frame measures how much
    of them one frame's layout still tells)."""
    for obj in f.key:
        found = obj.motion.labels if obj.motion is not None else None
        if obj.kind not in VEHICLE_KINDS + ("pedestrian",) or found is None:
            continue
        t = f.tag_text[id(obj)]
        # Balanced per frame within what one frame shows that ties to the answer: a standing object
        # ahead of a moving ego comes closer, an oncoming vehicle ahead too; only pedestrians on
        # the crossing and vehicles turn across the road.
        side = ("ahead" if obj.s > 0 else "behind") + (" oncoming" if obj.place == "oncoming lane" else "")
        if found.approaching is not None:
            f.yes_no["prediction"].append((f"approaching {side}", f.timed(qa(
                f"Is {t} approaching the ego vehicle?", "Yes." if found.approaching else "No."))))
        if found.crosses_ego_lane is not None:
            who = obj.place if obj.kind == "pedestrian" else "vehicle"
            f.yes_no["prediction"].append((f"crosses_ego_lane {who}", f.timed(qa(
                f"Will {t} cross the lane of the ego vehicle?", "Yes." if found.crosses_ego_lane else "No."))))
    answer = _do_next(f.world)
    return [f.timed(f.choice(DO_NEXT_Q, answer, DO_NEXT_OPTIONS))] if answer else []


def _do_next(world: World) -> str | None:
    """What the ego should do next because of the vehicle it follows (the nearest ahead in its lane,
    within LEAD_RANGE_M): stop for a standing one closer than 20 m, slow down for a standing one
    farther or a moving one it closes on, keep its speed behind one that keeps the distance,
    speed up behind one that pulls away. None where something one frame shows decides instead
    (a red or yellow light, pedestrians on the crossing), where no vehicle leads, or where the
    lead's relative speed is between the thresholds."""
    if world.light_state in ("red", "yellow") or any(o.kind == "pedestrian" and o.place == "crossing"
                                                     for o in world.objects):
        return None
    ahead = sorted((o for o in world.objects if o.kind in VEHICLE_KINDS and o.place == "ego lane"
                    and 0 < o.s < LEAD_RANGE_M and o.motion is not None and o.motion.labels is not None),
                   key=lambda o: o.s)
    if not ahead:
        return None
    lead = ahead[0].motion.labels
    if not lead.moving:
        return "Stop." if ahead[0].s < 20.0 else "Slow down."
    if lead.approaching:
        return "Slow down."
    if lead.approaching is None:
        return None
    if abs(lead.closing_mps) < STEADY_MPS:
        return "Keep going at the same speed."
    return "Speed up." if lead.closing_mps > APPROACH_MPS else None


def _status_mix(kind: str, words: Counter) -> str:
    """"One of the trucks is parked, and two are moving." (DriveLM's phrasing for mixed groups)."""
    (w1, c1), *rest = sorted(words.items(), key=lambda kv: (kv[1], kv[0]))
    first = f"{cap(NUMBER[c1])} of the {PLURAL[kind]} {'is' if c1 == 1 else 'are'} {w1}"
    tail = [f"{NUMBER[c]} {'is' if c == 1 else 'are'} {w}" for w, c in rest]
    return first + ", and " + ", and ".join(tail) + "."
