"""The calibration plan: `litevlm calibrate` refuses a bad plan (stages, method, precision's
options, data) before any model is loaded or question answered, naming the flag; a good plan gets
its defaults resolved once. `litevlm quantize`'s plan likewise. No ModelOpt needed: nothing here
quantizes."""

from __future__ import annotations

import dataclasses
import json

import pytest
from helpers import options, random_frames

from litevlm_runtime.cli import main
from litevlm_runtime.errors import InputError
from litevlm_runtime.export.calibration.plan import QUANTIZED_STAGES, CalibrationPlan


def write_qa(folder):
    """A DriveLM v1.1 file of one key frame (six random PNGs) and one question."""
    from PIL import Image

    paths = {}
    for cam, image in random_frames(5).items():
        path = folder / "samples" / cam / "frame0.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(path)
        paths[cam] = f"../nuscenes/samples/{cam}/frame0.png"
    qa = {"scene0": {"scene_description": "", "key_frames": {"frame0": {
        "QA": {"perception": [{"Q": "Is the road clear?", "A": "Yes."}]}, "image_paths": paths}}}}
    (folder / "qa.json").write_text(json.dumps(qa))
    return folder / "qa.json"


@pytest.mark.parametrize("flags, named", [
    (["--stages", "vision,lm_head"], "--stages lm_head"),
    (["--stages", ","], "--stages (none)"),
    (["--precision", "int4", "--method", "max"], "--method max: int4 is weight-only"),
    (["--precision", "int4", "--stages", "vision"], "--stages is for int8/fp8"),
    (["--precision", "int8", "--fp8-decode"], "--fp8-decode is for --precision fp8"),
    (["--keep-float", "layers.(0"], "--keep-float 'layers.(0': not a regular expression"),
    (["--samples", "0"], "--samples 0: at least 1"),
    (["--name", "a/b"], "--name 'a/b'"),
])
def test_a_bad_plan_is_refused_before_the_model_is_loaded(tmp_path, capsys, flags, named):
    """The model folder does not exist: had calibration loaded it (or answered a question) before
    checking the plan, the error would name the folder, not the flag; the control below shows that
    a good plan does reach the model."""
    qa, model = write_qa(tmp_path), tmp_path / "no-model-here"
    assert main(["calibrate", "--model", str(model), "--data", str(qa), "--out", str(tmp_path / "out"), *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and str(model) not in err, err
    assert not (tmp_path / "out").exists()


def test_a_good_plan_goes_on_to_load_the_model(tmp_path, capsys):
    qa, model = write_qa(tmp_path), tmp_path / "no-model-here"
    assert main(["calibrate", "--model", str(model), "--data", str(qa), "--out", str(tmp_path / "out"),
                 "--stages", "prefill,decoder"]) == 2
    err = capsys.readouterr().err
    assert "1 questions in" in err and str(model) in err, err          # read the questions, then the model


def test_missing_data_and_out_are_named(tmp_path, capsys):
    model = tmp_path / "no-model-here"
    assert main(["calibrate", "--model", str(model), "--data", str(tmp_path / "qa.json"),
                 "--out", str(tmp_path / "out")]) == 2
    assert "--data" in capsys.readouterr().err
    assert main(["calibrate", "--model", str(model), "--data", str(write_qa(tmp_path))]) == 2
    assert "--out is required" in capsys.readouterr().err


def test_checked_resolves_the_defaults_once(tmp_path):
    qa = write_qa(tmp_path)
    plan = CalibrationPlan(tmp_path / "m", options(), qa, tmp_path / "out", stages=["prefill", "decoder"])
    assert plan.stages == ("prefill", "decoder")                 # a list given: kept as a tuple
    assert plan.checked().method == "entropy"
    assert dataclasses.replace(plan, precision="fp8").checked().method == "max"
    assert dataclasses.replace(plan, precision="fp8", method="entropy").checked().method == "entropy"
    int4 = dataclasses.replace(plan, precision="int4", stages=QUANTIZED_STAGES).checked()
    assert int4.method == "" and int4.quant_dir == tmp_path / "out" / "int4"
    assert int4.source_bundle == tmp_path / "out" / "fp32"
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.precision = "fp8"


def test_options_for_another_precision_or_source_are_refused(tmp_path):
    qa = write_qa(tmp_path)
    plan = CalibrationPlan(tmp_path / "m", options(), qa, tmp_path / "out")
    (tmp_path / "weights").mkdir()
    for changes, named in [({"quantized": tmp_path / "weights"}, "--quantized is for --precision int4"),
                           ({"precision": "int4", "quantized": tmp_path / "none"}, "--quantized"),
                           ({"method": "percentile"}, "--method 'percentile'"),
                           ({"precision": "int2"}, "--precision 'int2'"),
                           ({"bundle": tmp_path / "weights"}, "--bundle"),
                           ({"eval_questions": -1}, "--eval-questions"),
                           ({"data": tmp_path / "qa.txt"}, "--data"),
                           ({"frames_root": tmp_path / "frames"}, "--frames-root")]:
        with pytest.raises(InputError, match=named.replace("(", r"\(")):
            dataclasses.replace(plan, **changes).checked()
    (tmp_path / "weights" / "manifest.json").write_text("{}")
    with pytest.raises(InputError, match="--buckets is for the export made without --bundle"):
        dataclasses.replace(plan, bundle=tmp_path / "weights", buckets="vision=6").checked()


@pytest.mark.parametrize("flags, named", [
    (["--weights", "int4"], "--weights int4 (AWQ) needs --data"),
    (["--weights", "int4", "--data", "qa.txt"], "--data qa.txt: no such file"),
    (["--weights", "int8", "--rows", "0"], "--questions and --rows must be at least 1"),
])
def test_a_bad_quantize_plan_is_refused_before_the_model_is_loaded(tmp_path, capsys, monkeypatch, flags, named):
    monkeypatch.chdir(tmp_path)
    model = tmp_path / "no-model-here"
    assert main(["quantize", "--model", str(model), *flags]) == 2
    err = capsys.readouterr().err
    assert named in err and str(model) not in err, err


def test_a_good_quantize_plan_goes_on_to_load_the_model(tmp_path, capsys):
    model = tmp_path / "no-model-here"
    assert main(["quantize", "--model", str(model), "--weights", "int8"]) == 2
    assert str(model) in capsys.readouterr().err
