"""The fleet over frame sets over time: `fleet eval --set temporal.frames=4` over a bag of SynthDrive
sequences answers every question from its key frame's four sets (the rows say which), and `fleet
compare` against a one-set run reports accuracy per question category with `motion` among them,
in its summary and its HTML report."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers.ros import sequence_bag

from litevlm_runtime.cli import main
from litevlm_runtime.fleet.dataset import RunFolder


@pytest.mark.skipif(shutil.which("java") is None, reason="language scores need Java")
def test_fleet_over_sequences_reports_motion_per_category(tmp_path, tiny_model):
    bag = sequence_bag(tmp_path / "motion", frames=4, query_frames=0, questions=6)
    common = [str(bag), "--set", f"model_dir={tiny_model}", "--set", "max_new_tokens=4", "--set", "warmup=false",
              "--ground-truth", str(tmp_path / "motion" / "synth"), "--workers", "0", "--quiet"]
    assert main(["fleet", "eval", *common, "--out", str(tmp_path / "one")]) == 0
    assert main(["fleet", "eval", *common, "--set", "temporal.frames=4", "--out", str(tmp_path / "four")]) == 0
    one, four = RunFolder(tmp_path / "one").read_rows(), RunFolder(tmp_path / "four").read_rows()
    assert len(one) == len(four) == 18 and all(r["status"] == "ok" for r in one + four)
    assert {r["frames"] for r in one} == {1} and {r["frames"] for r in four} == {4}
    for r in four:
        assert len(r["frame_set_stamps_ns"]) == 4 and len(r["kept_per_frame"]) == 4
        assert [b - a for a, b in zip(r["frame_set_stamps_ns"], r["frame_set_stamps_ns"][1:])] == [500_000_000] * 3
    assert {r["gt_category"] for r in four} >= {"motion"}          # the references say which questions need time

    assert main(["fleet", "compare", str(tmp_path / "one"), str(tmp_path / "four"), "--report", str(tmp_path / "r"),
                 "--lenient"]) in (0, 1)
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    by_category = {c["category"]: c for c in summary["categories"]}
    assert "motion" in by_category and by_category["motion"]["A"]["questions"] > 0
    assert by_category["motion"]["A"]["questions"] == by_category["motion"]["B"]["questions"]
    html = (tmp_path / "r" / "index.html").read_text()
    assert "<td class=\"l\">motion</td>" in html or ">motion<" in html
