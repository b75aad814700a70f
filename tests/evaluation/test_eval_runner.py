"""`litevlm eval` end to end with the real pipeline (tiny random-weight checkpoint) on SynthDrive
output and on the real DriveLM sample."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import options

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.cli import main
from litevlm_runtime.errors import InputError
from litevlm_runtime.evaluation.data import load_frames
from litevlm_runtime.evaluation.runner import EvalPlan, blank_frame, run_model
from litevlm_runtime.synth.generate import SynthSpec, generate

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap's PTB tokenizer needs Java")


@pytest.fixture(scope="module")
def synth_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("synth_eval")
    generate(out, SynthSpec(2, 5, 224, 126, val_fraction=0.5), workers=1, progress=False)
    return out


def test_runs_the_pipeline_on_synthdrive(tiny_model, synth_dir):
    records = run_model(
        tiny_model, synth_dir / "val.json", synth_dir, options(max_new_tokens=3), EvalPlan(limit=3), progress=False
    )
    questions = [q for f in load_frames(synth_dir / "val.json") for q in f.questions][:3]
    assert [r["id"] for r in records] == [q.id for q in questions]
    for r, q in zip(records, questions):
        assert r["gt_answer"] == q.answer and isinstance(r["answer"], str) and "error" not in r
        assert set(r["cameras"]) <= set(CAMERAS) and r["total_ms"] > 0


def test_reports_the_arena_bytes(tiny_model, synth_dir):
    """`info` gets the arena's bytes, an INT8 KV cache's (arena.kv_dtype) fewer (exact ratio:
    tests/models/test_kv_cache.py::test_arena_kv_bytes)."""
    sizes = {}
    for kv in ("float", "int8"):
        info = {}
        run_model(tiny_model, synth_dir / "val.json", synth_dir, options(max_new_tokens=2, arena__kv_dtype=kv),
                  EvalPlan(limit=1), progress=False, info=info)
        sizes[kv] = info
        assert info["kv_dtype"] == kv and 0 < info["kv_bytes"] < info["arena_bytes"]
    assert sizes["int8"]["kv_bytes"] < sizes["float"]["kv_bytes"]
    assert (
        sizes["float"]["arena_bytes"] - sizes["int8"]["arena_bytes"]
        == sizes["float"]["kv_bytes"] - sizes["int8"]["kv_bytes"]
    )


def test_blank_images_are_grey_at_the_real_size(synth_dir):
    frame = load_frames(synth_dir / "val.json")[0]
    images = blank_frame(synth_dir, frame)
    assert set(images) == set(CAMERAS)
    for img in images.values():
        assert img.shape == (126, 224, 3) and (img == 128).all()


def test_rejected_question_is_recorded_not_lost(tiny_model, tmp_path, synth_dir):
    data = json.loads((synth_dir / "val.json").read_text())
    frame = next(iter(next(iter(data.values()))["key_frames"].values()))
    frame["QA"]["perception"][0]["Q"] = "   "            # the pipeline rejects an empty question
    (tmp_path / "qa.json").write_text(json.dumps(data))
    records = run_model(tiny_model, tmp_path / "qa.json", synth_dir, options(max_new_tokens=2), EvalPlan(limit=2),
                        progress=False)
    assert len(records) == 2
    assert records[0]["answer"] == "" and "question" in records[0]["error"].lower()
    assert "error" not in records[1]


@needs_java
def test_cli_on_real_drivelm(tiny_model, drivelm_dir, tmp_path, capsys):
    out = tmp_path / "pred.json"
    code = main(["eval", "--model", str(tiny_model), "--data", str(drivelm_dir / "qa_scene_n008.json"),
                 "--frames", str(drivelm_dir), "--limit", "2", "--max_new_tokens", "2", "--json", "--quiet",
                 "--predictions", str(out)])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert result["run"]["questions"] == 2 and result["run"]["errors"] == 0
    assert result["scores"]["gpt"]["available"] is False
    assert len(json.loads(out.read_text())) == 2


def test_cli_settings_and_bad_input(tmp_path):
    from litevlm_runtime.cli import build_parser
    from litevlm_runtime.options import options_from_args

    parse = lambda *a: options_from_args(build_parser().parse_args(["eval", "--data", "x", *a]))  # noqa: E731
    assert parse() == options()
    opts = parse("--pipeline", "baseline", "--decoding.mode", "eagle", "--max_new_tokens", "7")
    assert (opts.pipeline.value, opts.decoding.mode.value, opts.max_new_tokens) == ("baseline", "eagle", 7)
    opts = parse("--backend.threads", "1", "--views.threshold", "0.25")
    assert (opts.backend.threads, opts.views.threshold) == (1, 0.25) and type(opts.backend.threads) is int
    with pytest.raises(InputError, match="not a int"):
        parse("--backend.threads", "two")
    with pytest.raises(InputError, match="not a float"):
        parse("--tokens.keep_ratio", "lots")
    with pytest.raises(InputError, match="unknown setting"):
        parse("--set", "no_such_field=1")
    with pytest.raises(InputError, match="pipeline: 'nonsense' is not one of litevlm, baseline"):
        parse("--pipeline", "nonsense")
    with pytest.raises(InputError, match="no such QA file"):
        load_frames(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text("{\"s\": {\"nokeyframes\": 1}}")
    with pytest.raises(InputError, match="key_frames"):
        load_frames(tmp_path / "x.json")
