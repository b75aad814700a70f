"""Camera x time selection (issue 45 item 3): the view selector's time head, its fusion with the
time cue, its labels (only files in motion say what a question needs), its training by
`litevlm train views` and its report by `litevlm eval-views`; selectors without it load and select
as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.cli import main
from litevlm_runtime.evaluation.views import QARecord, time_metrics
from litevlm_runtime.stages.view_selector import (
    LoadedViewSelector,
    ViewSelector,
    ViewSelectorConfig,
    fuse_time,
    load_view_selector,
    save_view_selector,
    time_cue,
    train_tokenizer,
)
from litevlm_runtime.training.views import NO_TIME_LABEL, time_labels, tune_time


@pytest.fixture(scope="module")
def motion_qa(tmp_path_factory) -> Path:
    """Twelve SynthDrive scenes in motion (4 frame sets) and eight single-frame ones, at 160x90."""
    from litevlm_runtime.synth.generate import SynthSpec, generate

    root = tmp_path_factory.mktemp("qa")
    generate(root / "motion", SynthSpec(12, seed=21, width=160, height=90, val_fraction=0.25, frames=4), workers=1,
             progress=False)
    generate(root / "still", SynthSpec(8, seed=22, width=160, height=90, val_fraction=0.0), workers=1, progress=False)
    return root


def test_time_cue():
    assert time_cue("Is <c1,CAM_FRONT,800.0,450.0> moving?") == 1.0
    assert time_cue("Will <c2,CAM_BACK,1.0,2.0> cross the lane of the ego vehicle?") == 1.0
    assert time_cue("What colour is the car to the front of the ego car?") == 0.0
    assert time_cue("Is there a traffic light in front of the ego car?") == 0.0


def test_fuse_time():
    # no head: the cue alone, every frame set asked for
    assert fuse_time(1.0, None, 0.4, 0.5)[0] is None and fuse_time(0.0, None, 0.4, 0.5)[0] == 0
    # a head sure of 3 past sets overrides no cue at weight 0.4: 0.6 * 0.97 >= 0.5
    past, why = fuse_time(0.0, [0.03, 0.0, 0.0, 0.97], 0.4, 0.5)
    assert past == 3 and why["module"] == pytest.approx(0.97)
    # a cue with a head sure of none: 0.4 + 0.6 * 0.05 < 0.5
    assert fuse_time(1.0, [0.95, 0.0, 0.05, 0.0], 0.4, 0.5)[0] == 0
    # the head's most likely count above 0
    assert fuse_time(1.0, [0.2, 0.1, 0.6, 0.1], 0.4, 0.5)[0] == 2


def test_only_files_in_motion_label_time():
    def rec(source, frames, q="Is X moving?"):
        return QARecord(source, "s", "f", "motion" if frames > 1 else "prediction", q, "Yes.", frames)

    records = [rec("motion.json", 4), rec("motion.json", 1, "What colour?"), rec("still.json", 1),
               rec("drivelm.json", 1)]
    assert time_labels(records, 3) == [3, 0, NO_TIME_LABEL, NO_TIME_LABEL]
    assert time_labels(records, 2)[0] == 2
    m = time_metrics(records[:2], [None, 0])
    assert m == {"motion_questions": 1, "motion_with_past": 1.0, "static_questions": 1, "static_without_past": 1.0}


def test_a_head_without_time_keeps_todays_state_dict_and_camera_logits(tmp_path):
    """A time head adds parameters and a seventh query; the camera logits of the same weights are
    the same with or without it (each latent query cross-attends on its own)."""
    tok = train_tokenizer(["is the car moving", "what colour is the car"])
    torch.manual_seed(0)
    plain = ViewSelector(ViewSelectorConfig(vocab_size=tok.get_vocab_size(), dropout=0.0)).eval()
    timed = ViewSelector(ViewSelectorConfig(vocab_size=tok.get_vocab_size(), dropout=0.0, max_past_frames=3)).eval()
    missing, unexpected = timed.load_state_dict(plain.state_dict(), strict=False)
    assert set(missing) == {n for n in timed.state_dict() if n.startswith(("time_query", "time_head"))}
    assert not unexpected
    ids = torch.tensor([[2, 3, 4, 5]])
    pad = torch.zeros_like(ids, dtype=torch.bool)
    with torch.no_grad():
        cams, time = timed.forward_all(ids, pad)
        assert torch.allclose(cams, plain(ids, pad), atol=1e-6) and time.shape == (1, 4)
        assert plain.forward_all(ids, pad)[1] is None
    save_view_selector(tmp_path / "sel", timed, tok)
    loaded = load_view_selector(tmp_path / "sel")
    sel = loaded.explain("Is <c1,CAM_FRONT,800.0,450.0> moving?")
    assert "CAM_FRONT" in sel.cameras and set(sel.time) == {"cue", "module", "score"}
    assert sel.past_frames is None or 0 <= sel.past_frames <= 3


def test_tune_time_prefers_the_setting_that_separates_best():
    records = [QARecord("m", "s", "f", "motion", "Is X moving?", "Yes.", 4),
               QARecord("m", "s", "f", "perception", "Is X moving too?", "Yes.", 1),
               QARecord("m", "s", "f", "perception", "What colour is X?", "Red.", 1)]
    # the head is right about the second question, which the cue gets wrong
    probs = torch.tensor([[0.1, 0.0, 0.0, 0.9], [0.9, 0.0, 0.0, 0.1], [0.95, 0.0, 0.0, 0.05]])
    w, t, m = tune_time(records, probs)
    assert m["motion_with_past"] == 1.0 and m["static_without_past"] == 1.0 and w == 0.0


def test_train_views_learns_time_and_eval_views_reports_it(motion_qa, tmp_path, capsys):
    """`litevlm train views` on a file in motion and a single-frame one: a time head of range
    frames - 1, chosen fusion on the validation frames, and on held-out motion frames past frame
    sets for motion questions and none for the others (the time cue alone is not that good)."""
    out = tmp_path / "sel"
    val = json.loads((motion_qa / "motion" / "val.json").read_text())
    val_frames = ",".join(t for scene in val.values() for t in scene["key_frames"])
    assert main(["train", "views", "--data", str(motion_qa / "motion" / "train.json"),
                 "--data", str(motion_qa / "motion" / "val.json"), "--data", str(motion_qa / "still" / "train.json"),
                 "--out", str(out), "--frames-holdout", "0", "--val-frames", val_frames, "--epochs", "12",
                 "--batch-size", "32", "--width", "64", "--layers", "2", "--heads", "2", "--fusion", "remove",
                 "--seed", "0", "--threads", "1"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architecture"]["max_past_frames"] == 3
    assert "time" in config["training"]["fusion_tuning"]
    selector = load_view_selector(out)
    assert selector.cfg.max_past_frames == 3
    capsys.readouterr()
    assert main(["eval-views", "--selector", str(out), "--data", str(motion_qa / "motion" / "val.json"),
                 "--frames", "all", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["time"]
    fused = next(v for k, v in rows.items() if k.startswith("selector"))
    assert fused["motion_questions"] > 0 and fused["static_questions"] > 0
    assert fused["motion_with_past"] >= 0.9 and fused["static_without_past"] >= 0.9
    # a selector without a time head (trained on a single-frame file only) has none
    plain = tmp_path / "plain"
    assert main(["train", "views", "--data", str(motion_qa / "still" / "train.json"), "--out", str(plain),
                 "--frames-holdout", "0", "--val-frames", "0", "--fusion", "remove", "--epochs", "1", "--width", "32",
                 "--layers", "1", "--heads", "2", "--threads", "1"]) == 0
    assert load_view_selector(plain).cfg.max_past_frames == 0
    assert LoadedViewSelector.explain(load_view_selector(plain), "Is <c1,CAM_FRONT,1.0,2.0> moving?").past_frames \
        is None
    assert set(CAMERAS) >= set(load_view_selector(plain).select("What colour is the car in front?"))
