"""Explanations from the command line, as users run them (issue 33): `litevlm ask ... --explain out.png`
draws the picture; `litevlm bag eval BAG --explain OUT.mcap` writes every answer's explanation into an
MCAP that the `mcap` reader reads back: each answer has its camera images, annotations, both heatmaps
and its picture, all decoded with the Foxglove schemas the file carries, and the answer record."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import jsonschema
import pytest
from mcap.reader import make_reader
from PIL import Image
from test_explain_outputs import _decoder

from litevlm_runtime.bag.io import write_bag
from litevlm_runtime.bag.make import drivelm_contents
from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.explain.foxglove_mcap import ANSWER_TOPIC, KINDS, PICTURE_TOPIC, camera_topic

SMALL = ["--set", "max_new_tokens=4", "--set", "warmup=false", "--set", "tokens.mode=layer0",
         "--set", "tokens.keep_ratio=0.5"]
FOXGLOVE = {"image": "foxglove.CompressedImage", "attention": "foxglove.CompressedImage",
            "token_scores": "foxglove.CompressedImage", "annotations": "foxglove.ImageAnnotations"}


def _cli(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", *args], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
    return run


def test_ask_explain_writes_the_picture(tmp_path, drivelm_dir, tiny_model):
    out = tmp_path / "pictures" / "out.png"
    question = "What is the status of <c1,CAM_FRONT,800.0,500.0>?"
    run = _cli("ask", "--model", str(tiny_model), "--frames", str(drivelm_dir / "samples"), "--question", question,
               "--max_new_tokens", "4", "--tokens.mode", "layer0", "--tokens.keep_ratio", "0.5",
               "--explain", str(out), "--explain-width", "900")
    picture = Image.open(out)
    assert picture.format == "PNG" and picture.size[0] == 900 and picture.size[1] > 500
    assert f"explanation: {out}" in run.stderr and "attention" in run.stderr
    assert f"Q: {question}" in run.stdout
    jpeg = tmp_path / "out.jpg"
    _cli("ask", "--model", str(tiny_model), "--frames", str(drivelm_dir / "samples"), "--question", question,
         "--max_new_tokens", "2", "--explain", str(jpeg))
    assert Image.open(jpeg).format == "JPEG"


def test_ask_explain_refuses_an_unknown_picture_format(tmp_path, tiny_model):
    run = subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "ask", "--model", str(tiny_model),
                          "--question", "What is behind?", "--explain", str(tmp_path / "out.gif")],
                         capture_output=True, text=True)
    assert run.returncode != 0 and "--explain" in run.stderr and ".png or .jpg" in run.stderr


@pytest.fixture(scope="module")
def explained_bag(tmp_path_factory, drivelm_dir, tiny_model):
    """`bag eval --explain` on two key frames of the DriveLM sample (two questions each): (rows, mcap path)."""
    tmp = tmp_path_factory.mktemp("explained_bag")
    bag = write_bag(drivelm_contents(drivelm_dir, max_frames=2, questions_per_frame=2, max_width=320), tmp / "bag")
    out, mcap = tmp / "eval.jsonl", tmp / "explained.mcap"
    run = _cli("bag", "eval", str(bag), "--out", str(out), "--explain", str(mcap), "--set",
               f"model_dir={tiny_model}", *SMALL)
    assert "4 explained answers" in run.stdout and (tmp / "explained.layout.json").is_file()
    return [json.loads(line) for line in out.read_text().splitlines()], mcap


def test_bag_eval_explain_mcap_read_back(explained_bag):
    rows, path = explained_bag
    assert [r["status"] for r in rows] == ["ok"] * 4
    messages, decoders = {}, {}
    with open(path, "rb") as f:
        for schema, channel, message in make_reader(f).iter_messages():
            if schema.encoding == "protobuf":
                decode = decoders.setdefault(schema.name, _decoder(schema))
                messages[channel.topic, message.log_time] = (schema.name, decode(message.data))
            else:
                assert (schema.encoding, channel.message_encoding) == ("jsonschema", "json")
                body = json.loads(message.data)
                jsonschema.validate(body, json.loads(schema.data))
                messages[channel.topic, message.log_time] = (schema.name, body)
    for row in rows:
        stamp = row["query_stamp_ns"]
        name, body = messages[ANSWER_TOPIC, stamp]
        assert name == "litevlm.ExplainedAnswer" and body["id"] == row["query_id"] and body["answer"] == row["answer"]
        assert body["extra"]["prompt_sha256"] == row["prompt_sha256"]                # the answer record rides along
        assert body["question_objects"] == row["question_objects"]
        name, picture = messages[PICTURE_TOPIC, stamp]
        assert name == "foxglove.CompressedImage" and Image.open(io.BytesIO(picture.data)).format == "JPEG"
        for camera in CAMERAS:
            for kind in KINDS:
                name, msg = messages[camera_topic(camera, kind), stamp]
                assert name == FOXGLOVE[kind]
                assert (msg.timestamp.seconds, msg.timestamp.nanos) == divmod(stamp, 10 ** 9)
            image = Image.open(io.BytesIO(messages[camera_topic(camera, "image"), stamp][1].data))
            for kind in ("attention", "token_scores"):
                heat = Image.open(io.BytesIO(messages[camera_topic(camera, kind), stamp][1].data))
                assert heat.size == image.size
            notes = messages[camera_topic(camera, "annotations"), stamp][1]
            selected = camera in row["cameras"]
            assert [p.type for p in notes.points] == ([2, 4] if selected else [2])     # frame, kept tokens
            tagged = [o for o in row["question_objects"] + row["objects"] if o["camera"] == camera]
            assert [t.text for t in notes.texts[1:]] == [o["object_id"] for o in tagged]
