"""Arrival checks of camera frames (ros/frame_health.py), the too-large refusal in the frame
store, deadlines answered on time and questions of replacement/noncharacters, in-process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import png_claiming
from helpers.ros import jpeg

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.options import PipelineOptions
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.serving.frame_health import header_defect, too_large
from litevlm_runtime.serving.frame_store import Frame
from litevlm_runtime.serving.images import CompressedPayload, RawPayload
from litevlm_runtime.serving.server import QueryServer, ServerSettings
from litevlm_runtime.stages.prompt import is_blank


def test_raw_size_from_the_header_before_the_data():
    msg = SimpleNamespace(width=8000, height=8000, encoding="rgb8", data=bytes(8))   # the header decides
    why = too_large("CAM_FRONT", msg, 4096 * 4096)
    assert why.startswith("CAM_FRONT: image is 8000x8000 = 64.0 Mpixel") and "images.max_pixels" in why
    assert too_large("CAM_FRONT", SimpleNamespace(width=1600, height=900, encoding="rgb8", data=bytes(8)),
                     4096 * 4096) is None
    assert too_large("CAM_FRONT", SimpleNamespace(format="jpeg", data=bytes(32)), 4) is None
    # a small header over a huge buffer: bounded by bytes too (max_pixels x 8)
    huge = SimpleNamespace(width=2, height=2, encoding="mono8", data=bytes(1000))
    assert "frame data of 0.0 MB, above images.max_pixels x 8 bytes" in too_large("CAM_BACK", huge, 100)
    assert "above images.max_pixels x 8" in too_large("CAM_BACK", SimpleNamespace(format="jpeg", data=bytes(801)), 100)
    # and by the frame store's per-camera bound (frame_memory_mb), which could never hold it
    why = too_large("CAM_BACK", SimpleNamespace(format="jpeg", data=bytes(2_000_001)), 4096 * 4096, 2_000_000)
    assert why.startswith("CAM_BACK: frame data of 2.0 MB, above frame_memory_mb (2 MB held per camera at most)")
    assert too_large("CAM_BACK", SimpleNamespace(format="jpeg", data=bytes(2_000_000)), 4096 * 4096, 2_000_000) is None


@pytest.mark.parametrize("payload, why", [
    (CompressedPayload("jpeg", jpeg(1)), None),
    (CompressedPayload("jpeg", b"GIF89a...."), "neither JPEG nor PNG"),
    (CompressedPayload("png", png_claiming(9000, 9000)), "images.max_pixels"),
    (CompressedPayload("jpeg", jpeg(1)[:40]), "cannot decode image"),     # cut inside its header
    (RawPayload("rgb8", 4, 4, 12, bytes(48)), None),
    (RawPayload("rgb8", 4, 4, 12, bytes(47)), "47 bytes"),
    (RawPayload("8UC3", 4, 4, 12, bytes(48)), "unsupported"),
    (RawPayload("rgb8", 1, 1, 3, bytes(3)), "at least 2x2"),
])
def test_header_defects(payload, why):
    got = header_defect("CAM_BACK", payload, 4096 * 4096)
    assert (got is None) if why is None else (why in got and got.startswith("CAM_BACK")), got


def server(published):
    s = QueryServer(ServerSettings(queue_size=4), published.append, clock_ns=lambda: 10 ** 9)
    # submit's question check is skipped below; stats() counts the runtime's kept conversations, and
    # matching reads the temporal settings (one frame set, the shipped defaults)
    rt = SimpleNamespace(conversations=SimpleNamespace(turns={}), options=PipelineOptions())
    s.pipeline, s.active = SimpleNamespace(rt=rt), True
    return s


def test_a_camera_with_only_refused_frames_is_bad_image(monkeypatch):
    # No pipeline here: the request check (QueryRequest.checked) passes all.
    monkeypatch.setattr(QueryRequest, "checked", lambda self, rt, max_chars=0: self)
    published = []
    s = server(published)
    for cam in CAMERAS[1:]:
        s.frames.add(Frame(cam, 10 ** 9, b""))
    s.frames.refuse("CAM_FRONT", "CAM_FRONT: image is 8000x8000 ... refused on arrival")
    assert s.submit(QueryRequest("Anything ahead?", query_id="a"), allow_wait=False) is None
    assert (published[0].status, published[0].status_message) == (
        "bad_image",
        "CAM_FRONT: image is 8000x8000 ... refused on arrival",
    )
    s.frames.add(Frame("CAM_FRONT", 10 ** 9, b""), now_ns=10 ** 9 + 1)      # a good frame after it: served
    assert s.submit(QueryRequest("Anything ahead?", query_id="b"), allow_wait=False) is not None
    assert s.stats()["frames_bad_image"]["CAM_FRONT"] == 1


def test_queued_deadline_is_answered_when_it_passes(monkeypatch):
    # No pipeline here: the request check (QueryRequest.checked) passes all.
    monkeypatch.setattr(QueryRequest, "checked", lambda self, rt, max_chars=0: self)
    published = []
    s = server(published)
    for cam in CAMERAS:
        s.frames.add(Frame(cam, 10 ** 9, b""))
    assert s.submit(QueryRequest("soon?", query_id="d", deadline_ns=10 ** 9 + 50_000_000), now_ns=10 ** 9) is not None
    assert s.submit(QueryRequest("later?", query_id="e"), now_ns=10 ** 9) is not None
    s.expire_deadlines(now_ns=10 ** 9 + 40_000_000)
    assert published == []
    s.expire_deadlines(now_ns=10 ** 9 + 60_000_000)          # no worker ever took it: answered anyway
    assert [(r.query_id, r.status) for r in published] == [("d", "deadline_passed")]
    assert "60.0 ms in the queue" in published[0].status_message
    assert [r.query_id for r in s.queue.drain()] == ["e"]


@pytest.mark.parametrize("text, blank", [("\ufffd", True), ("\ufffd\ufffd \ufffd", True), ("\ufdd0\uffff", True),
                                         ("\U0010fffe", True), ("\u200b\ufeff", True), ("car \ufffd?", False),
                                         ("ok", False)])
def test_replacement_and_noncharacters_only_is_blank(text, blank):
    assert is_blank(text) is blank
