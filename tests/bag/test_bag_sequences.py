"""`bag make` of a SynthDrive set in motion: each scene's K frame sets in stamp order at their capture
times, `stride` apart, questions asked after the key frame set only, scenes far enough apart
that no question's history reaches into the scene before; the bag reads back the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from litevlm_runtime.bag.io import read_bag, write_bag
from litevlm_runtime.bag.make import BagTiming, drivelm_contents
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.evaluation.data import load_frames
from litevlm_runtime.synth.generate import SynthSpec, generate

SCENES, K, STRIDE_NS, GAP_S = 3, 3, 500_000_000, 2.0


@pytest.fixture(scope="module")
def motion_set(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("motion_bag")
    generate(out, SynthSpec(SCENES, 5, 160, 90, val_fraction=0.0, frames=K, stride=0.5), workers=1, progress=False)
    return out


def test_sequences_in_stamp_order_questions_after_key_frames(motion_set):
    contents = drivelm_contents(motion_set, questions_per_frame=2, timing=BagTiming(scene_gap_s=GAP_S))
    stamps = {cam: [f.stamp_ns for f in frames] for cam, frames in contents.frames.items()}
    assert all(len(v) == SCENES * K and v == sorted(v) for v in stamps.values())
    assert len({tuple(v) for v in stamps.values()}) == 1          # SynthDrive's cameras share a capture time
    sets = stamps["CAM_FRONT"]
    scenes = [sets[i * K:(i + 1) * K] for i in range(SCENES)]
    for seq in scenes:
        assert [b - a for a, b in zip(seq, seq[1:])] == [STRIDE_NS] * (K - 1)
    asked = {}
    for q in contents.queries:
        scene = next(i for i, seq in enumerate(scenes) if seq[0] <= q.stamp_ns < seq[-1] + 10**9)
        asked.setdefault(scene, []).append(q)
        assert q.stamp_ns > scenes[scene][-1]                   # after the key frame set, none after history
    assert sorted(asked) == list(range(SCENES)) and all(len(v) == 2 for v in asked.values())
    for earlier, later in zip(scenes, scenes[1:]):
        last_query = max(q.stamp_ns for q in contents.queries if q.stamp_ns < later[0])
        assert later[0] - max(earlier[-1], last_query) == int(GAP_S * 1e9)
        assert later[0] - earlier[-1] > (K - 1) * STRIDE_NS         # a K-frame history stays in its scene
    by_front = {Path(f.image_paths["CAM_FRONT"]).name: {q.question for q in f.questions}
                for f in load_frames(motion_set / "train.json")}
    fronts = [f.data for f in contents.frames["CAM_FRONT"]]
    assert len(by_front) == SCENES and len(set(fronts)) == SCENES * K
    texts = {q.question for q in contents.queries}
    assert texts <= set().union(*by_front.values())


def test_sequence_bag_reads_back_in_time_with_its_stamps(motion_set, tmp_path):
    contents = drivelm_contents(motion_set, questions_per_frame=1)
    bag = write_bag(contents, tmp_path / "seq")
    frames = {cam: [] for cam in CAMERAS}
    queries = []
    last = 0
    for t, topic, msgtype, raw, reader in read_bag(bag):
        assert t >= last
        last = t
        msg = reader.deserialize(raw, msgtype)
        assert msg.header.stamp.sec * 10**9 + msg.header.stamp.nanosec == t
        if msgtype.endswith("CompressedImage"):
            frames[topic.split("/")[1].upper()].append(t)
        else:
            queries.append(t)
    assert {cam: v for cam, v in frames.items()} == {cam: [f.stamp_ns for f in v] for cam, v in contents.frames.items()}
    assert queries == [q.stamp_ns for q in contents.queries] and len(queries) == SCENES
    info = json.loads((motion_set / "synthdrive.json").read_text())
    assert info["frames"] == K
