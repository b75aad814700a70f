"""Rules the package writes once (issue 19): the blank-question rule, what an InputError is about,
the percentile, the server's settings shared by the server, the node and bag eval, and the one
DriveLM image-path rule. Each is checked against an independent statement of the rule."""

from __future__ import annotations

import math
from dataclasses import fields

import numpy as np
import pytest

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.errors import InputError
from litevlm_runtime.evaluation.data import resolve_image
from litevlm_runtime.options import PipelineOptions
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.ros.parameters import NodeSettings
from litevlm_runtime.ros.params_file import load_node_params
from litevlm_runtime.serving.server import QueryServer
from litevlm_runtime.serving.settings import ServerSettings
from litevlm_runtime.stages.prompt import is_blank
from litevlm_runtime.timing import percentile

# Characters nobody can see: each is whitespace or a control/format/separator character.
INVISIBLE = ["\u00ad", "\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u180e", "\u2028", "\x00", "\t", "\u3000"]


@pytest.fixture(scope="module")
def pipe(tiny_model):
    return Pipeline.from_pretrained(tiny_model, PipelineOptions(max_new_tokens=2))


@pytest.mark.parametrize("ch", INVISIBLE)
def test_a_question_of_invisible_characters_is_blank_to_the_server_and_the_pipeline(pipe, ch):
    assert is_blank(ch * 3)
    with pytest.raises(InputError, match="empty question") as info:
        pipe.answer({}, ch * 3)
    assert info.value.about == "question"
    records = []
    server = QueryServer(ServerSettings(), records.append, clock_ns=lambda: 0)
    server.load(lambda: pipe, warmup=False)
    server.active = True
    assert server.submit(QueryRequest(ch * 3, query_id="q")) is None
    assert records[0].status == "bad_question" and "empty question" in records[0].status_message


def test_visible_text_is_not_blank():
    assert not is_blank("\u00adWhat is in front?")
    assert not is_blank("?")


def test_input_error_says_what_it_is_about():
    assert InputError("x", camera="CAM_BACK").about == "image"
    assert InputError("x", camera="CAM_BACK").camera == "CAM_BACK"
    assert InputError("x", path="a.json").about == "file"
    assert InputError("x", about="question").about == "question"
    assert InputError("x").about == ""


def test_image_errors_name_their_camera(pipe):
    images = {c: np.zeros((64, 64, 3), np.uint8) for c in CAMERAS}
    images["CAM_BACK"] = b"not an image"
    with pytest.raises(InputError) as info:
        pipe.answer(images, "What is behind the ego car?")
    assert (info.value.about, info.value.camera) == ("image", "CAM_BACK")


def test_percentile_is_numpys_linear_percentile():
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 100):
        values = rng.normal(size=n).tolist()
        for q in (0, 1, 50, 90, 99, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)), abs=1e-12)
    assert math.isnan(percentile([], 50))


def test_server_settings_have_one_source():
    node = NodeSettings()
    shared = [f.name for f in fields(ServerSettings) if f.name != "cameras"]
    assert {f.name for f in fields(NodeSettings)} >= set(shared)
    assert node.server_settings(CAMERAS) == ServerSettings()          # same defaults, every field
    # bag eval builds them from the node's parameters, every field included (drain_timeout_s was dropped).
    params = load_node_params(None, {"drain_timeout_s": "7.5", "match_wait_s": "0.3"})
    built = ServerSettings.from_values(params, CAMERAS)
    assert (built.drain_timeout_s, built.match_wait_s) == (7.5, 0.3)
    with pytest.raises(InputError, match="queue_size"):
        ServerSettings(queue_size=0)


def test_one_image_path_rule(tmp_path):
    image = tmp_path / "samples" / "CAM_FRONT" / "f.jpg"
    image.parent.mkdir(parents=True)
    image.write_bytes(b"x")
    written_by_drivelm = "../nuscenes/samples/CAM_FRONT/f.jpg"       # relative to DriveLM's data root
    assert resolve_image(tmp_path, written_by_drivelm) == image
    assert resolve_image(tmp_path, "samples/CAM_FRONT/f.jpg") == image      # SynthDrive: relative to its folder
    assert resolve_image(tmp_path / "samples", "CAM_FRONT/f.jpg") == tmp_path / "samples" / "CAM_FRONT" / "f.jpg"
    assert resolve_image(tmp_path, str(image)) == image                    # absolute
    assert resolve_image(tmp_path, "elsewhere/f.jpg", camera="CAM_FRONT") == image
    with pytest.raises(InputError, match="not found"):
        resolve_image(tmp_path, "samples/CAM_BACK/f.jpg")
