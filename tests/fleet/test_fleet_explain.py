"""Answers you can see in a release review (issue 33): `fleet eval --explain` stores each answer's
explanation picture in the run (a JPEG in the Parquet column explanation_jpeg), and `fleet compare`
shows a changed answer's two pictures, A's and B's, side by side."""

from __future__ import annotations

import io
import re

from PIL import Image

from litevlm_runtime.bag.io import write_bag
from litevlm_runtime.bag.make import drivelm_contents
from litevlm_runtime.cli import main
from litevlm_runtime.fleet.dataset import RunFolder
from litevlm_runtime.fleet.worker import PICTURE_WIDTH


def test_fleet_eval_explain_and_the_report_shows_both_pictures(tmp_path, drivelm_dir, tiny_model):
    bag = write_bag(drivelm_contents(drivelm_dir, max_frames=1, questions_per_frame=3, max_width=160), tmp_path / "bag")
    common = [str(bag), "--set", f"model_dir={tiny_model}", "--set", "warmup=false", "--workers", "0", "--quiet"]
    assert main(["fleet", "eval", *common, "--set", "max_new_tokens=4", "--explain", "--out", str(tmp_path / "a")]) == 0
    assert main(["fleet", "eval", *common, "--set", "max_new_tokens=2", "--explain", "--out", str(tmp_path / "b")]) == 0
    assert main(["fleet", "eval", *common, "--set", "max_new_tokens=2", "--out", str(tmp_path / "plain")]) == 0

    rows = RunFolder(tmp_path / "a").read_rows()
    assert len(rows) == 3 and all(r["status"] == "ok" for r in rows)
    for r in rows:                        # every answer's own picture
        picture = Image.open(io.BytesIO(r["explanation_jpeg"]))
        assert picture.format == "JPEG" and picture.size[0] == PICTURE_WIDTH
    assert len({r["explanation_jpeg"] for r in rows}) == 3
    assert all(r["explanation_jpeg"] is None for r in RunFolder(tmp_path / "plain").read_rows())

    main(["fleet", "compare", str(tmp_path / "a"), str(tmp_path / "b"), "--report", str(tmp_path / "rep"), "--lenient"])
    html = (tmp_path / "rep" / "index.html").read_text()
    changed = int(re.search(r"<b>(\d+)</b> answers changed", html).group(1))
    assert changed >= 1, "max_new_tokens 4 -> 2 must change some answer"
    shown = re.findall(r'<div class="pics">(.*?)</div>', html)
    assert len(shown) == changed
    for block in shown:
        a, b = re.findall(r'<img src="(explain/[^"]+_A\.jpg|explain/[^"]+_B\.jpg)"', block)
        assert a.endswith("_A.jpg") and b.endswith("_B.jpg")
        for name in (a, b):
            assert Image.open(tmp_path / "rep" / name).format == "JPEG"
    # Against a run without pictures: B's side says so.
    main(["fleet", "compare", str(tmp_path / "a"), str(tmp_path / "plain"), "--report", str(tmp_path / "rep2"),
          "--lenient"])
    assert "B: no picture (run without --explain)" in (tmp_path / "rep2" / "index.html").read_text()
