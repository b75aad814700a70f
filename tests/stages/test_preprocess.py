"""Preprocessing: decoding every accepted input, tiling, normalization against a float64 reference."""

import io

import numpy as np
import pytest
import torch
from helpers import png_claiming
from PIL import Image

from litevlm_runtime.errors import InputError
from litevlm_runtime.stages.preprocess import IMAGENET_MEAN, IMAGENET_STD, Normalizer, load_image, to_tiles_uint8


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


def jpeg_bytes(arr, **kw):
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def test_minimum_size_is_one_rule_for_every_input(tmp_path):
    """A 1x1 image is refused whatever it comes as (it used to be answered as a JPEG and refused
    as an array); 2x2 is accepted as every kind."""
    from litevlm_runtime.stages.preprocess import MIN_IMAGE_SIDE

    for h, w, ok in ((1, 1, False), (1, 5, False), (5, 1, False), (MIN_IMAGE_SIDE, MIN_IMAGE_SIDE, True)):
        arr = np.full((h, w, 3), 90, np.uint8)
        p = tmp_path / f"{h}x{w}.png"
        Image.fromarray(arr).save(p)
        for src in (arr, arr[:, :, 0], png_bytes(arr), jpeg_bytes(arr), p, Image.fromarray(arr)):
            if ok:
                assert load_image(src, "CAM_BACK", (16, 16)).size == (w, h)
            else:
                with pytest.raises(InputError, match=f"CAM_BACK: image is {w}x{h} pixels; at least 2x2"):
                    load_image(src, "CAM_BACK", (16, 16))


def test_pixel_limit_is_checked_before_decoding(tmp_path):
    arr = np.zeros((30, 40, 3), np.uint8)
    p = tmp_path / "x.jpg"
    p.write_bytes(jpeg_bytes(arr))
    for src in (arr, png_bytes(arr), p, Image.fromarray(arr)):
        assert load_image(src, "CAM_FRONT", (16, 16), max_image_pixels=1200).size == (40, 30)
        with pytest.raises(InputError, match="CAM_FRONT: image is 40x30 = 0.0 Mpixel, above the limit"):
            load_image(src, "CAM_FRONT", (16, 16), max_image_pixels=1199)


@pytest.mark.parametrize("size, words", [
    ((5000, 5000), "image is 5000x5000 = 25.0 Mpixel, above the limit of 16.8 Mpixel"),    # our limit
    ((10000, 10000), "refused before decoding: Image size (100000000 pixels) exceeds"),    # PIL's warning
    ((20000, 20000), "refused before decoding: Image size (400000000 pixels) exceeds"),    # PIL's error
])
def test_decompression_bombs_are_named_input_errors(size, words):
    with pytest.raises(InputError) as e:
        load_image(png_claiming(*size), "CAM_FRONT_LEFT", (448, 448))
    assert str(e.value).startswith("CAM_FRONT_LEFT: ") and words in str(e.value)


@pytest.mark.parametrize("bad", [b"garbage, not an image", b"\xff\xd8\xff\xe0 truncated jpeg",
                                 png_bytes(np.zeros((8, 8, 3), np.uint8))[:45]])
def test_errors_carry_no_object_reprs(bad):
    """PIL's own messages name the BytesIO object ("<_io.BytesIO object at 0x7f..>")."""
    with pytest.raises(InputError) as e:
        load_image(bad, "CAM_BACK", (16, 16))
    assert str(e.value).startswith("CAM_BACK: cannot decode image") and " at 0x" not in str(e.value)
    assert "object" not in str(e.value)


def test_16bit_png_is_scaled_not_clipped():
    """image_transport's "mono16; png compressed mono16": PIL's own conversion would clip every
    value above 255 to white."""
    samples = np.array([[0, 257 * 100], [65535, 30000]], np.uint16)
    buf = io.BytesIO()
    Image.fromarray(samples).save(buf, format="PNG")
    img = load_image(buf.getvalue(), "CAM_FRONT", (2, 2))
    want = np.rint(samples * 255.0 / 65535.0)
    assert np.array_equal(np.asarray(img)[:, :, 0], want) and img.mode == "RGB"


def test_jpeg_draft_can_be_turned_off():
    rng = np.random.default_rng(1)
    data = jpeg_bytes(rng.integers(0, 256, (90, 160, 3), dtype=np.uint8), quality=95)
    assert load_image(data, "CAM_FRONT", (40, 20)).size == (40, 23)          # 1/4 DCT scale
    full = load_image(data, "CAM_FRONT", (40, 20), jpeg_draft=False)
    assert full.size == (160, 90)
    assert np.array_equal(np.asarray(full), np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
