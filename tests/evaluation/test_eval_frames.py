"""`litevlm eval` and `litevlm ask` over frame sets (issue 45 item 1, the pipeline and CLI side):
`--set temporal.frames=N` reads each key frame's N sets through the merged loader; a missing one
is each question's error naming the camera and the time step, the other frames still answered."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from litevlm_runtime.cli import main
from litevlm_runtime.evaluation.data import frame_images_over_time, load_frames


@pytest.fixture(scope="module")
def motion_set(tmp_path_factory) -> Path:
    from litevlm_runtime.synth.generate import SynthSpec, generate

    out = tmp_path_factory.mktemp("motion") / "set"
    generate(out, SynthSpec(3, seed=31, width=160, height=90, val_fraction=0.0, frames=4), workers=1, progress=False)
    return out


def test_eval_over_four_frame_sets(motion_set, tiny_model, tmp_path, capsys):
    preds = tmp_path / "p.json"
    assert main(["eval", "--model", str(tiny_model), "--data", str(motion_set / "train.json"), "--limit", "30",
                 "--set", "temporal.frames=4", "--set", "max_new_tokens=2", "--predictions", str(preds), "--json",
                 "--quiet"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["run"]["errors"] == 0
    records = json.loads(preds.read_text())
    assert all(r["frames"] == 4 for r in records)      # (no view selector: temporal.mode all)
    first = {}
    for r in records:                                   # a frame's first question encodes its 24 views
        frame = r["id"].rsplit("_", 1)[0]
        if frame not in first:
            first[frame] = r
            assert (r["encoded_views"], r["reused_views"]) == (24, 0)
        else:
            assert (r["encoded_views"], r["reused_views"]) == (0, 24)
    assert "motion" in out["scores"]["by_category"]


def test_a_missing_frame_set_is_each_questions_error_naming_camera_and_step(motion_set, tiny_model, tmp_path,
                                                                            capsys):
    broken = tmp_path / "set"
    shutil.copytree(motion_set, broken)
    frame = load_frames(broken / "train.json")[0]
    gone = frame_images_over_time(broken, frame, 4, 0.5)[1].paths["CAM_BACK_LEFT"]     # t-2
    gone.unlink()
    preds = tmp_path / "p.json"
    assert main(["eval", "--model", str(tiny_model), "--data", str(broken / "train.json"), "--set",
                 "temporal.frames=4", "--set", "max_new_tokens=2", "--predictions", str(preds), "--quiet"]) == 0
    err = capsys.readouterr().err
    records = json.loads(preds.read_text())
    failed = [r for r in records if "error" in r]
    assert failed and all(r["id"].startswith(f"{frame.scene}_{frame.token}") for r in failed)
    assert len(failed) == len(frame.questions) and f"{len(failed)} question(s) were rejected" in err
    assert "CAM_BACK_LEFT: no frame at time step t-2" in failed[0]["error"]
    assert all("error" not in r for r in records if not r["id"].startswith(f"{frame.scene}_{frame.token}"))


def test_ask_over_four_frame_sets(motion_set, tiny_model, capsys):
    key = frame_images_over_time(motion_set, load_frames(motion_set / "train.json")[0], 4, 0.5)[-1].paths
    args = ["ask", "--model", str(tiny_model), "--question", "Is <c1,CAM_FRONT,800.0,450.0> moving?", "--set",
            "temporal.frames=4", "--set", "max_new_tokens=2"] + [a for c, p in key.items() for a in ("--image",
                                                                                                  f"{c}={p}")]
    assert main(args + ["--json"]) == 0
    ans = json.loads(capsys.readouterr().out)
    assert ans["frames"] == 4 and ans["encoded_views"] == 24 and len(ans["kept_per_frame"]) == 4
    assert main(args) == 0
    assert "frame sets: 4 of 4 asked" in capsys.readouterr().out
    # a key file without a capture time in its name has no earlier frames to find
    plain = Path(key["CAM_FRONT"]).with_name("CAM_FRONT.jpg")
    shutil.copy(key["CAM_FRONT"], plain)
    try:
        bad = [a if not a.startswith("CAM_FRONT=") else f"CAM_FRONT={plain}" for a in args]
        assert main(bad) == 2
        assert "CAM_FRONT: CAM_FRONT.jpg has no capture time in its name" in capsys.readouterr().err
    finally:
        plain.unlink()
