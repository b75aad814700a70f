"""Object tags as data (litevlm_runtime/objects.py): every tag of the DriveLM sample found, none
invented, malformed ones reported by name; the scorers and the view selector read the same syntax."""

from __future__ import annotations

import json

import pytest

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.evaluation.metrics import LENIENT, match_f1, points
from litevlm_runtime.objects import OBJECT_TAG, ObjectRef, parse_objects
from litevlm_runtime.stages.view_selector import tagged_cameras


def _drivelm_texts(drivelm_dir):
    """(frame's key objects, text) for every question and answer of the sample."""
    data = json.loads((drivelm_dir / "qa_scene_n008.json").read_text())
    for scene in data.values():
        for frame in scene["key_frames"].values():
            for items in frame["QA"].values():
                for item in items:
                    for text in (item["Q"], item["A"]):
                        yield frame["key_object_infos"], text


def _fields_by_hand(tag: str) -> tuple[str, str, float, float]:
    """A tag's four fields with str methods only (independent of the parser's regular expressions)."""
    object_id, camera, x, y = tag.removeprefix("<").removesuffix(">").split(",")
    return object_id, camera, float(x), float(y)


def test_every_tag_of_the_drivelm_sample_is_found_and_none_invented(drivelm_dir):
    texts = tagged = found = 0
    for key_objects, text in _drivelm_texts(drivelm_dir):
        texts += 1
        parsed = parse_objects(text)
        assert parsed.malformed == ()
        # Found: DriveLM writes '<' nowhere but in a tag, so every '<' opens one object.
        assert len(parsed.objects) == text.count("<"), text
        tagged += bool(parsed.objects)
        cursor = 0
        for obj in parsed.objects:
            found += 1
            # Not invented: each object is literally in the text, spans in order and disjoint, and is
            # one of its key frame's key objects (the file's own list of the frame's objects).
            assert text[obj.start:obj.end] == obj.tag and obj.start >= cursor
            cursor = obj.end
            assert obj.tag in key_objects
            assert (obj.object_id, obj.camera, obj.x, obj.y) == _fields_by_hand(obj.tag)
            assert obj.camera in CAMERAS
            assert obj.tag in obj.phrase and obj.phrase in text
    assert texts == 622 and tagged == 186 and found == 246     # the sample as shipped (DriveLM n008)


def test_phrase_is_the_sentence_the_tag_stands_in():
    text = ("There is a brown SUV to the back of the ego vehicle. The IDs of these objects are "
            "<c1,CAM_BACK,1088.3,497.5>, and <c3,CAM_FRONT,1043.2,82.2>. Is <c2,CAM_BACK_LEFT,10,20> moving?")
    c1, c3, c2 = parse_objects(text).objects
    assert c1.phrase == c3.phrase == ("The IDs of these objects are <c1,CAM_BACK,1088.3,497.5>, and "
                                      "<c3,CAM_FRONT,1043.2,82.2>.")
    assert c2 == ObjectRef("c2", "CAM_BACK_LEFT", 10.0, 20.0, "Is <c2,CAM_BACK_LEFT,10,20> moving?",
                           "<c2,CAM_BACK_LEFT,10,20>", text.index("<c2"), len(text) - len(" moving?"))
    assert parse_objects("What about <c4,CAM_FRONT,1.5,-2.0>").objects[0].phrase == "What about <c4,CAM_FRONT,1.5,-2.0>"
    # Tags are pixels of DriveLM's 1600 x 900 frame, at whatever size the camera's image is.
    assert c1.pixel(1600, 900) == (1088.3, 497.5) and c1.pixel(800, 450) == (544.15, 248.75)


@pytest.mark.parametrize("bad, reason", [
    ("<c1,CAM_NOSE,1.0,2.0>", "unknown camera CAM_NOSE"),
    ("<c1,CAM_BACK,1088.3>", "3 fields"),
    ("<c1,CAM_BACK,abc,2.0>", "x 'abc' is not a number"),
    ("<c1,CAM_BACK,1.0,2.0,3.0>", "5 fields"),
    ("<obj1,CAM_BACK,1.0,2.0>", "object id 'obj1'"),
    ("<c1,cam_back,1.0,2.0>", "camera 'cam_back'"),
    ("<c1,CAM_BACK,1.0,2.0", "not closed"),
    ("< c1,CAM_BACK,1.0,2.0>", "a space after '<'"),
    ("<c2>", "1 fields"),
])
def test_malformed_tags_are_reported_by_name_and_name_no_object(bad, reason):
    text = f"Is {bad} near <c7,CAM_FRONT,3.0,4.0>? <img> and <|im_end|> are no tags."
    parsed = parse_objects(text)
    assert [o.object_id for o in parsed.objects] == ["c7"]
    (malformed,) = parsed.malformed
    assert malformed.text == bad and malformed.start == text.index(bad) and reason in malformed.reason


def test_scoring_and_view_selector_read_the_same_tags():
    text = "<c1,CAM_BACK,1088.3,497.5> is behind <c2 , CAM_FRONT_LEFT , 12 , -3.5> and <c3,CAM_NOSE,1.0,2.0>."
    parsed = parse_objects(text)
    assert [(o.x, o.y) for o in parsed.objects] == [(1088.3, 497.5), (12.0, -3.5)]
    # The lenient scoring reads every syntactically valid tag (also one outside the rig) ...
    assert points(text, LENIENT.coordinates) == [(1088.3, 497.5), (12.0, -3.5), (1.0, 2.0)]
    assert match_f1(text, text, coordinates="tags")[0] == pytest.approx(1.0)
    # ... the view selector and the parser only the rig's cameras.
    assert tagged_cameras(text) == ["CAM_FRONT_LEFT", "CAM_BACK"] == parsed.cameras()
    assert len(OBJECT_TAG.findall(text)) == 3
