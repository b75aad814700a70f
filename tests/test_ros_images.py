"""Camera payload conversion (sensor_msgs/Image and CompressedImage contents -> pipeline input)."""

import numpy as np
import pytest

from litevlm_runtime.ros.images import CompressedPayload, ImageError, RawPayload, to_pipeline_image


def test_rgb_bgr_mono_with_row_padding():
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    padded = np.zeros((2, 12), dtype=np.uint8)
    padded[:, :9] = rgb.reshape(2, 9)
    out = to_pipeline_image("CAM_FRONT", RawPayload("rgb8", 2, 3, 12, padded.tobytes()))
    assert np.array_equal(out, rgb)
    bgr = rgb[:, :, ::-1].copy()
    out = to_pipeline_image("CAM_FRONT", RawPayload("bgr8", 2, 3, 9, bgr.tobytes()))
    assert np.array_equal(out, rgb)
    mono = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8)
    out = to_pipeline_image("CAM_FRONT", RawPayload("mono8", 2, 3, 3, mono.tobytes()))
    assert out.shape == (2, 3, 3) and np.array_equal(out[:, :, 1], mono)


@pytest.mark.parametrize("payload, words", [
    (RawPayload("rgb8", 2, 3, 9, b"\0" * 10), "expected step x height"),
    (RawPayload("yuv422", 2, 3, 6, b"\0" * 12), "unsupported"),
    (RawPayload("rgb8", 2, 3, 4, b"\0" * 8), "step"),
    (CompressedPayload("jpeg", b""), "empty"),
    (CompressedPayload("jpeg", b"this is not a picture"), "neither JPEG nor PNG"),
])
def test_bad_images_name_camera_and_defect(payload, words):
    with pytest.raises(ImageError) as e:
        to_pipeline_image("CAM_BACK", payload)
    assert "CAM_BACK" in str(e.value) and words in str(e.value)


def test_jpeg_and_png_pass_through_as_bytes():
    for data in (b"\xff\xd8\xff\xe0rest", b"\x89PNG\r\n\x1a\nrest"):
        assert to_pipeline_image("CAM_FRONT", CompressedPayload("jpeg", data)) == data
