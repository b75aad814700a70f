"""Camera payload conversion (sensor_msgs/Image and CompressedImage contents -> pipeline input).

Every raw encoding is checked against a reference computed here with numpy from the encoding's
definition, never with the code under test: channel order by slicing, 16 -> 8 bit as
round(v * 255 / 65535) in float64, YUV by the BT.601 equations derived from Kr/Kb, Bayer from
mosaics built by hand of known images.
"""

import io

import numpy as np
import pytest
from helpers import png_claiming
from PIL import Image

from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.serving.images import (
    RAW_ENCODINGS,
    CompressedPayload,
    ImageError,
    RawPayload,
    payload_from_msg,
    rgb_to_raw,
    to_pipeline_image,
)
from litevlm_runtime.stages.preprocess import MIN_IMAGE_SIDE

RNG = np.random.default_rng(0)


def raw(encoding, pixels, step_pad=0, bigendian=False):
    """Rows of `pixels` (H x W x C samples, uint8 or uint16) as a RawPayload, padded by step_pad bytes."""
    h, w = pixels.shape[:2]
    dtype = ">u2" if bigendian else "<u2"
    body = (pixels.astype(dtype) if pixels.dtype == np.uint16 else pixels).reshape(h, -1).view(np.uint8)
    rows = np.zeros((h, body.shape[1] + step_pad), np.uint8)
    rows[:, :body.shape[1]] = body
    return RawPayload(encoding, h, w, rows.shape[1], rows.tobytes(), bigendian)


def convert(payload):
    return to_pipeline_image("CAM_FRONT", payload)


def test_rgb_bgr_mono_with_row_padding():
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    assert np.array_equal(convert(raw("rgb8", rgb, step_pad=3)), rgb)
    assert np.array_equal(convert(raw("bgr8", rgb[:, :, ::-1])), rgb)
    mono = np.array([[1, 2, 3], [4, 5, 6]], dtype=np.uint8)
    for enc in ("mono8", "8UC1"):
        out = convert(raw(enc, mono[:, :, None], step_pad=1))
        assert out.shape == (2, 3, 3) and all(np.array_equal(out[:, :, c], mono) for c in range(3))


@pytest.mark.parametrize("encoding, order", [("rgba8", [0, 1, 2]), ("bgra8", [2, 1, 0])])
def test_four_channel_8bit_drops_alpha(encoding, order):
    rgba = RNG.integers(0, 256, (4, 6, 4), dtype=np.uint8)
    out = convert(raw(encoding, rgba, step_pad=4))
    assert out.dtype == np.uint8 and np.array_equal(out, rgba[:, :, order])


@pytest.mark.parametrize("bigendian", [False, True])
@pytest.mark.parametrize("encoding, channels, order", [
    ("rgb16", 3, [0, 1, 2]), ("bgr16", 3, [2, 1, 0]), ("rgba16", 4, [0, 1, 2]), ("bgra16", 4, [2, 1, 0]),
    ("mono16", 1, [0, 0, 0]), ("16UC1", 1, [0, 0, 0]),
])
def test_16bit_scaled_to_8bit(encoding, channels, order, bigendian):
    samples = RNG.integers(0, 65536, (5, 7, channels), dtype=np.uint16)
    samples[0, 0] = 0
    samples[0, 1] = 65535
    ref = np.rint(samples.astype(np.float64) * 255.0 / 65535.0)[:, :, order]
    out = convert(raw(encoding, samples, step_pad=2, bigendian=bigendian))
    assert out.dtype == np.uint8 and np.array_equal(out, ref.astype(np.uint8))     # exact
    assert out[0, 0].tolist() == [0, 0, 0] and out[0, 1].tolist() == [255, 255, 255]


def test_16bit_byte_order_matters():
    """The same bytes read little- and big-endian give different images: is_bigendian is used."""
    samples = np.full((2, 2, 1), 0x00FF, np.uint16)            # 255 LE -> 1 in 8 bit; BE 0xFF00 -> 254
    le = raw("mono16", samples)
    be = RawPayload(le.encoding, le.height, le.width, le.step, le.data, is_bigendian=True)
    assert convert(le)[0, 0, 0] == 1 and convert(be)[0, 0, 0] == 254


def mosaic(image, pattern):
    """A Bayer mosaic made by hand: each pixel keeps the colour its place in the 2x2 cell names."""
    out = np.zeros(image.shape[:2], image.dtype)
    for k, colour in enumerate(pattern):
        dy, dx = divmod(k, 2)
        out[dy::2, dx::2] = image[dy::2, dx::2, "RGB".index(colour)]
    return out


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("pattern", ["RGGB", "BGGR", "GBRG", "GRBG"])
def test_bayer_constant_colour_is_exact(pattern, bits):
    colour = np.array([200, 90, 20], np.uint16 if bits == 16 else np.uint8) * (257 if bits == 16 else 1)
    flat = np.broadcast_to(colour, (6, 8, 3)).copy()
    out = convert(raw(f"bayer_{pattern.lower()}{bits}", mosaic(flat, pattern)[:, :, None]))
    assert (out == [200, 90, 20]).all()


@pytest.mark.parametrize("pattern", ["RGGB", "BGGR", "GBRG", "GRBG"])
def test_bayer_pattern_offset_on_a_ramp(pattern):
    """Bilinear demosaicing reproduces a linear ramp exactly away from the border; a pattern read
    one pixel off (OpenCV's historical naming offset) would be off by a slope, 8 levels here."""
    y, x = np.mgrid[0:16, 0:20].astype(np.float64)
    image = np.stack([40 + 8 * x, 30 + 8 * y, 200 - 4 * x - 4 * y], axis=2)
    out = convert(raw(f"bayer_{pattern.lower()}8", mosaic(image.astype(np.uint8), pattern)[:, :, None]))
    inner = (slice(2, -2), slice(2, -2))
    assert np.abs(out[inner].astype(np.float64) - image[inner]).max() <= 1.0


def bt601(y, u, v):
    """BT.601 limited range ("video range": Y in 16..235, U/V in 16..240) to RGB in float64,
    from the standard's luma weights Kr, Kb; the equations, not a library's constants."""
    kr, kb = 0.299, 0.114
    kg = 1 - kr - kb
    yy = (y - 16.0) * 255 / 219
    pb, pr = (u - 128.0) * 255 / 224, (v - 128.0) * 255 / 224
    r = yy + 2 * (1 - kr) * pr
    b = yy + 2 * (1 - kb) * pb
    g = yy - (2 * (1 - kb) * kb * pb + 2 * (1 - kr) * kr * pr) / kg
    return np.clip(np.stack([r, g, b], axis=-1), 0, 255)


YUV_TOLERANCE = 1.5     # OpenCV's fixed-point conversion vs the float64 equations, uint8 levels


@pytest.mark.parametrize("encoding, layout", [("yuv422", "UYVY"), ("uyvy", "UYVY"),
                                              ("yuv422_yuy2", "YUYV"), ("yuyv", "YUYV")])
def test_yuv422(encoding, layout):
    h, w = 4, 10
    y = RNG.integers(16, 236, (h, w), dtype=np.uint8)
    u = RNG.integers(16, 241, (h, w // 2), dtype=np.uint8)
    v = RNG.integers(16, 241, (h, w // 2), dtype=np.uint8)
    packed = np.zeros((h, w // 2, 4), np.uint8)         # one macropixel: two pixels sharing U, V
    planes = {"Y": [y[:, 0::2], y[:, 1::2]], "U": [u], "V": [v]}
    for k, name in enumerate(layout):
        packed[:, :, k] = planes[name].pop(0)
    ref = bt601(y.astype(np.float64), np.repeat(u, 2, axis=1), np.repeat(v, 2, axis=1))
    out = convert(raw(encoding, packed.reshape(h, w, 2), step_pad=4))
    assert np.abs(out - ref).max() <= YUV_TOLERANCE


@pytest.mark.parametrize("encoding", ["nv12", "nv21"])
def test_nv12_nv21(encoding):
    h, w = 6, 8
    y = RNG.integers(16, 236, (h, w), dtype=np.uint8)
    u = RNG.integers(16, 241, (h // 2, w // 2), dtype=np.uint8)
    v = RNG.integers(16, 241, (h // 2, w // 2), dtype=np.uint8)
    pair = (u, v) if encoding == "nv12" else (v, u)
    chroma = np.stack(pair, axis=2).reshape(h // 2, w)          # interleaved, half height
    step = w + 2
    data = np.zeros((h * 3 // 2, step), np.uint8)
    data[:h, :w], data[h:, :w] = y, chroma
    up = lambda c: np.repeat(np.repeat(c, 2, axis=0), 2, axis=1)  # noqa: E731 - one chroma sample per 2x2
    ref = bt601(y.astype(np.float64), up(u), up(v))
    out = convert(RawPayload(encoding, h, w, step, data.tobytes()))
    assert np.abs(out - ref).max() <= YUV_TOLERANCE


@pytest.mark.parametrize("encoding", sorted(RAW_ENCODINGS))
def test_bag_writer_encoding_round_trip(encoding):
    """rgb_to_raw (what `bag make --raw` writes) read back: a flat colour survives every encoding
    (grey ones keep its BT.601 luma), within the YUV tolerance."""
    colour = np.array([180, 120, 40], np.float64)
    image = np.broadcast_to(colour.astype(np.uint8), (6, 8, 3))
    data = rgb_to_raw(image, encoding)
    rows = 9 if RAW_ENCODINGS[encoding].planar_420 else 6
    out = convert(RawPayload(encoding, 6, 8, len(data) // rows, data))
    grey = RAW_ENCODINGS[encoding].channels == 1 and not encoding.startswith(("bayer", "nv"))
    want = np.full(3, colour @ [0.299, 0.587, 0.114]) if grey else colour
    assert np.abs(out - want).max() <= YUV_TOLERANCE


def test_payload_from_rclpy_message():
    from sensor_msgs.msg import CompressedImage
    from sensor_msgs.msg import Image as RosImage

    msg = RosImage(height=2, width=2, encoding="mono16", is_bigendian=1, step=4, data=bytes([0xFF, 0, 0xFF, 0] * 2))
    p = payload_from_msg(msg)
    assert p == RawPayload("mono16", 2, 2, 4, bytes([0xFF, 0, 0xFF, 0] * 2), True)
    assert convert(p)[0, 0, 0] == 254
    c = payload_from_msg(CompressedImage(format="rgb8; jpeg compressed bgr8", data=b"\xff\xd8\xff"))
    assert c == CompressedPayload("rgb8; jpeg compressed bgr8", b"\xff\xd8\xff")


def encoded(size, fmt="JPEG"):
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 20, 30)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("payload, words", [
    (RawPayload("rgb8", 2, 3, 9, b"\0" * 10), "expected step x height"),
    (RawPayload("rgb8", 2, 3, 4, b"\0" * 8), "step"),
    (RawPayload("rgb16", 2, 3, 9, b"\0" * 18), "step 9 < width 3 x 3 channels x 2 bytes"),
    (RawPayload("nv12", 2, 4, 4, b"\0" * 8), "height x 3/2"),
    (RawPayload("yuv422", 2, 3, 6, b"\0" * 12), "even width"),
    (RawPayload("nv12", 3, 4, 4, b"\0" * 16), "even height"),
    (RawPayload("8UC3", 2, 2, 6, b"\0" * 12), "unknown order"),
    (RawPayload("32FC1", 2, 2, 8, b"\0" * 16), "not a camera image"),
    (RawPayload("yuv420", 2, 2, 4, b"\0" * 8), "unsupported"),
    (RawPayload("rgb8", 1, 1, 3, b"\0" * 3), f"at least {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}"),
    (RawPayload("mono8", 1, 64, 64, b"\0" * 64), "1 pixels"),
    (RawPayload("mono8", 0, 0, 0, b""), "0x0"),
    (RawPayload("mono8", 5000, 5000, 5000, b""), "above the limit"),
    (CompressedPayload("jpeg", b""), "empty"),
    (CompressedPayload("jpeg", b"this is not a picture"), "neither JPEG nor PNG"),
    (CompressedPayload("16UC1; compressedDepth png", b"\0" * 12 + encoded((4, 4), "PNG")), "depth image"),
    (CompressedPayload("jpeg", encoded((1, 1))), "1x1 pixels"),
    (CompressedPayload("png", encoded((1, 7), "PNG")), "1x7 pixels"),
    (CompressedPayload("png", png_claiming(6000, 6000)), "6000x6000 = 36.0 Mpixel, above the limit of 16.8"),
    (CompressedPayload("png", png_claiming(12000, 12000)), "refused before decoding"),   # PIL's bomb warning
    (CompressedPayload("png", png_claiming(30000, 30000)), "refused before decoding"),   # PIL's bomb error
])
def test_bad_images_name_camera_and_defect(payload, words):
    with pytest.raises(ImageError) as e:
        to_pipeline_image("CAM_BACK", payload)
    text = str(e.value)
    assert text.startswith("CAM_BACK: ") and words in text and " at 0x" not in text


def test_pixel_limit_is_a_parameter():
    small = raw("rgb8", np.zeros((4, 4, 3), np.uint8))
    assert convert(small).shape == (4, 4, 3)
    with pytest.raises(ImageError, match="above the limit of 0.0 Mpixel"):
        to_pipeline_image("CAM_BACK", small, max_image_pixels=15)
    jpeg = CompressedPayload("jpeg", encoded((40, 30)))
    assert to_pipeline_image("CAM_BACK", jpeg, max_image_pixels=1200) == jpeg.data
    with pytest.raises(ImageError, match="CAM_BACK: image is 40x30"):
        to_pipeline_image("CAM_BACK", jpeg, max_image_pixels=1199)


def test_jpeg_and_png_pass_through_as_bytes():
    for fmt, name in (("JPEG", "jpeg"), ("PNG", "png"), ("JPEG", "rgb8; jpeg compressed bgr8"),
                      ("PNG", "bgr8; png compressed bgr8")):
        data = encoded((4, 3), fmt)
        assert to_pipeline_image("CAM_FRONT", CompressedPayload(name, data)) == data


def test_server_answers_bad_image_naming_the_camera(tiny_model):
    """A decompression bomb or a 1x1 frame on one camera: that query is answered bad_image naming
    the camera (it used to be pipeline_error without it), the next good query is answered ok."""
    from litevlm_runtime.cameras import CAMERAS
    from litevlm_runtime.errors import InputError
    from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
    from litevlm_runtime.serving.frame_store import Frame
    from litevlm_runtime.serving.server import QueryServer
    from litevlm_runtime.serving.settings import ServerSettings

    pipe = Pipeline.from_pretrained(tiny_model, PipelineOptions(max_new_tokens=2))
    records = []
    server = QueryServer(ServerSettings(), records.append, clock_ns=lambda: 0)
    server.load(lambda: pipe, warmup=False)
    server.active = True
    good = CompressedPayload("jpeg", encoded((64, 36)))
    bad = {"CAM_BACK": CompressedPayload("png", png_claiming(12000, 12000)),
           "CAM_FRONT_LEFT": RawPayload("rgb8", 1, 1, 3, b"\0\0\0")}
    for t, (cam, payload) in enumerate([*bad.items(), ("CAM_BACK", good)], start=1):
        for c in CAMERAS:
            server.frames.add(Frame(c, t * 10**9, payload if c == cam else good), now_ns=t * 10**9)
        server.serve(server.submit(QueryRequest("front?"), now_ns=t * 10**9), now_ns=t * 10**9)
    assert [r.status for r in records] == ["bad_image", "bad_image", "ok"]
    assert records[0].status_message.startswith("CAM_BACK: refused before decoding")
    assert records[1].status_message.startswith("CAM_FRONT_LEFT: image is 1x1 pixels")
    # The pipeline itself (litevlm ask, eval) refuses the same way.
    with pytest.raises(InputError, match="^CAM_BACK: refused before decoding"):
        pipe.answer({c: png_claiming(12000, 12000) if c == "CAM_BACK" else good.data for c in CAMERAS}, "front?")
