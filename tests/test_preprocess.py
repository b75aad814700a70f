"""Preprocessing: decoding every accepted input, tiling, normalization against a float64 reference."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from litevlm_runtime.errors import InputError
from litevlm_runtime.preprocess import IMAGENET_MEAN, IMAGENET_STD, Normalizer, load_image, to_tiles_uint8


def png_bytes(arr):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_two_tiles_are_left_and_right_halves():
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (90, 160, 3), dtype=np.uint8)
    img = load_image(png_bytes(arr), "CAM_FRONT", (56, 28))
    out = torch.zeros(2, 3, 28, 28, dtype=torch.uint8)
    to_tiles_uint8(img, 28, 2, out)
    ref = np.asarray(Image.fromarray(arr).resize((56, 28), Image.BICUBIC))
    assert torch.equal(out[0], torch.from_numpy(ref[:, :28].copy()).permute(2, 0, 1))
    assert torch.equal(out[1], torch.from_numpy(ref[:, 28:].copy()).permute(2, 0, 1))


def test_normalization_matches_float64():
    u8 = torch.randint(0, 256, (3, 3, 8, 8), dtype=torch.uint8)
    out = torch.empty(3, 3, 8, 8)
    Normalizer(torch.float32, torch.device("cpu"))(u8, out)
    ref = (u8.double() / 255 - torch.tensor(IMAGENET_MEAN, dtype=torch.float64).view(1, 3, 1, 1)) \
        / torch.tensor(IMAGENET_STD, dtype=torch.float64).view(1, 3, 1, 1)
    assert torch.allclose(out.double(), ref, rtol=0, atol=1e-5)


def test_inputs_accepted(tmp_path):
    arr = np.full((20, 30, 3), 77, np.uint8)
    p = tmp_path / "x.png"
    Image.fromarray(arr).save(p)
    for src in (arr, arr[:, :, 0], png_bytes(arr), p, str(p), Image.fromarray(arr)):
        assert load_image(src, "CAM_BACK", (16, 16)).size == (30, 20)


@pytest.mark.parametrize("bad, msg", [
    (b"", "empty image"),
    (b"not an image at all", "cannot decode"),
    (png_bytes(np.zeros((8, 8, 3), np.uint8))[:40], "cannot decode"),
    (np.zeros((8, 8, 3), np.float32), "uint8"),
    (np.zeros((8, 8, 5), np.uint8), "HxWx3"),
    ("/no/such/file.jpg", "does not exist"),
    (12345, "unsupported image type"),
])
def test_bad_images_raise_named_errors(bad, msg):
    with pytest.raises(InputError, match=f"CAM_BACK_LEFT: .*{msg}"):
        load_image(bad, "CAM_BACK_LEFT", (16, 16))


def test_drivelm_frames_decode(drivelm_dir):
    from litevlm_runtime.frames import frame_set

    frames = frame_set(drivelm_dir, 0)
    assert len(frames) == 6
    for cam, path in frames.items():
        img = load_image(path.read_bytes(), cam, (896, 448))
        assert img.size == (1600, 900)
        out = torch.zeros(2, 3, 448, 448, dtype=torch.uint8)
        to_tiles_uint8(img, 448, 2, out)
        assert out.float().std() > 10     # a real picture, not a blank
