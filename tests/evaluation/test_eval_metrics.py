"""DriveLM scoring against numbers computed independently: pycocoevalcap's scorers called
directly, match F1 by hand, accuracy by counting; under the challenge's rules (the default) and
--lenient. The edge answers are in test_eval_challenge_rules.py."""

from __future__ import annotations

import json
import shutil

import pytest

from litevlm_runtime.cli import main
from litevlm_runtime.errors import InputError
from litevlm_runtime.evaluation.data import frame_images, load_frames
from litevlm_runtime.evaluation.metrics import (
    ACCURACY,
    CHALLENGE,
    GPT,
    LANGUAGE,
    LENIENT,
    MATCH,
    derive_tags,
    match_f1,
    score,
)
from litevlm_runtime.evaluation.runner import read_predictions

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap's PTB tokenizer needs Java")
pytest.importorskip("pycocoevalcap")

C1, C2, C3 = "<c1,CAM_BACK,1088.3,497.5>", "<c2,CAM_BACK,864.2,468.3>", "<c3,CAM_FRONT,1043.2,82.2>"


def item(q, a):
    return {"Q": q, "A": a, "C": None, "con_up": None, "con_down": None, "cluster": None, "layer": None}


QA = {"scene1": {"scene_description": "x", "key_frames": {"frame1": {
    "key_object_infos": {},
    "image_paths": {},
    "QA": {
        "perception": [
            item("What are the important objects in the current scene?",
                 f"There is a brown SUV to the back, a black sedan to the back, and a green light to the front. "
                 f"The IDs of these objects are {C1}, {C2}, and {C3}."),
            item(f"What is the moving status of object {C1}? Please select the correct answer from the following "
                 f"options: A. Going ahead. B. Stopped. C. Back up. D. Turn left.", "D"),
            item(f"What is the visual description of {C2}?", "Black sedan."),
            item("Are there barriers to the front right of the ego car?", "Yes."),
        ],
        "prediction": [
            item(f"Is {C3} a traffic sign or a road barrier?", "Yes."),
            item("What object should the ego vehicle notice first?",
                 "Firstly notice that <c1,CAM_FRONT,100.0,100.0>. Secondly notice that <c2,CAM_FRONT,110.0,100.0>."),
        ],
        "planning": [
            item("What is the target action of the ego vehicle?", "Go straight."),
            item("Which objects matter?", f"Only {C3}."),
        ],
        "behavior": [
            item("Predict the behavior of the ego vehicle.",
                 "The ego vehicle is going straight. The ego vehicle is driving fast."),
            item("Predict the behavior of the ego vehicle. Please select the correct answer from the following "
                 "options: A. x B. y C. z D. w", "B"),
        ],
    }}}}}
ID = "scene1_frame1_{}".format
PREDICTIONS = {
    ID(0): "There is a brown car to the back and a green light to the front. The IDs of these objects are "
           "<c1,CAM_BACK,1090.0,500.0>, <c2,CAM_BACK,900.0,468.3>, and <c5,CAM_FRONT,1040.0,80.0>.",
    ID(1): "D",
    ID(2): "Black car.",
    ID(3): "Yes",                 # not exactly "Yes.": wrong under exact match
    ID(4): "No.",
    # GT points (100,100) and (110,100). The first predicted point is 15 from the first and 5 from
    # the second, so greedy gives it the second; the next point (113,100) is then 13 from the
    # first: still a match. A third point, far away, is a false positive.
    ID(5): "Firstly notice that <c1,CAM_FRONT,115.0,100.0>. Then <c2,CAM_FRONT,113.0,100.0> and "
           "<c3,CAM_FRONT,400.0,400.0>.",
    ID(6): "Go straight.",
    ID(7): "Nothing.",            # reference has one point, prediction none: F1 0
    ID(8): "The ego vehicle is going straight. The ego vehicle is driving slowly.",
    ID(9): "C",
}


@pytest.fixture()
def questions(tmp_path):
    path = tmp_path / "qa.json"
    path.write_text(json.dumps(QA))
    return [q for f in load_frames(path) for q in f.questions]


def test_tags_are_derived_like_the_challenge_file():
    assert derive_tags("Is it? Please select ... options: A. x B. y", "B") == (ACCURACY,)
    assert derive_tags("Are there cars?", "No.") == (ACCURACY,)
    assert derive_tags("Describe.", "A red car.") == (GPT, LANGUAGE)
    assert derive_tags("Which?", f"It is {C1}.") == (GPT, LANGUAGE, MATCH)


def test_match_f1_by_hand():
    ref = f"{C1}, {C2}, and {C3}"
    f1, matched = match_f1(PREDICTIONS[ID(0)], ref)
    # TP 2 (c1 at L1 4.2, c3 at L1 5.4), FP 1 (c2 at L1 35.8), FN 1: P = R = 2/3
    assert f1 == pytest.approx(2 / 3, abs=1e-6)
    assert matched == [(1088.3, 497.5), (1043.2, 82.2)]
    f1, _ = match_f1(PREDICTIONS[ID(5)], QA["scene1"]["key_frames"]["frame1"]["QA"]["prediction"][1]["A"])
    # TP 2, FP 1, FN 0: P = 2/3, R = 1, F1 = 0.8
    assert f1 == pytest.approx(0.8, abs=1e-6)
    assert match_f1("no points", C1)[0] == pytest.approx(0.0, abs=1e-6)
    assert match_f1("<c1,CAM_BACK,1104.3,497.5>", C1)[0] == pytest.approx(0.0, abs=1e-6)   # L1 16: not < 16


@needs_java
@pytest.mark.parametrize("rules", [CHALLENGE, LENIENT], ids=["challenge", "lenient"])
def test_scores_equal_independent_computation(questions, rules):
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    s = score(questions, PREDICTIONS, rules=rules)
    # accuracy: ids 1 (D=D), 3 (Yes vs Yes.), 4 (No. vs Yes.), 9 (C vs B): 1 of 4
    assert s.counts["accuracy"] == 4 and s.accuracy == pytest.approx(0.25)
    # match: ids 0 (2/3), 5 (0.8), 7 (0); the tags' numbers are all d.d, so both rules read the same points
    assert s.counts["match"] == 3
    assert s.match["f1"] == pytest.approx((2 / 3 + 0.8 + 0.0) / 3, abs=1e-6)
    assert s.match["score"] == pytest.approx(s.match["f1"])
    # language: the free-text questions, corpus level, scorers called directly; the challenge's
    # graph filter skips id 2, about c2, which the first answer missed
    lang_ids = [0, 5, 6, 7, 8] if rules is CHALLENGE else [0, 2, 5, 6, 7, 8]
    refs = {k: [{"caption": questions[i].answer}] for k, i in enumerate(lang_ids)}
    hyps = {k: [{"caption": PREDICTIONS[ID(i)]}] for k, i in enumerate(lang_ids)}
    tok = PTBTokenizer()
    refs, hyps = tok.tokenize(refs), tok.tokenize(hyps)
    bleu, _ = Bleu(4).compute_score(refs, hyps)
    rouge, _ = Rouge().compute_score(refs, hyps)
    cider, _ = Cider().compute_score(refs, hyps)
    assert s.counts["language"] == len(lang_ids)
    for n in range(4):
        assert s.language[f"Bleu_{n + 1}"] == pytest.approx(bleu[n], rel=1e-12)
    assert s.language["ROUGE_L"] == pytest.approx(rouge, rel=1e-12)
    assert s.language["CIDEr"] == pytest.approx(cider, rel=1e-12)
    language = sum(bleu) / 12 + rouge / 3 + cider / 30
    assert s.language["score"] == pytest.approx(language, rel=1e-12)
    assert 0.0 < language < 1.0
    # final: no judge -> GPT unavailable, reported without it and renormalized
    without = 0.2 * language + 0.2 * (2 / 3 + 0.8) / 3 + 0.2 * 0.25
    assert s.gpt["available"] is False and s.final["with_gpt"] is None
    assert s.final["without_gpt"] == pytest.approx(without, abs=1e-6)
    assert s.final["renormalized"] == pytest.approx(without / 0.6, abs=1e-6)


class ExactJudge:
    """A stand-in for the GPT judge with a known rule: 100 for an exact answer, else 40."""
    name = "exact"

    def score(self, question, prediction, reference):
        return 100.0 if prediction == reference else 40.0


@needs_java
def test_judge_enters_like_the_challenge(questions):
    s = score(questions, PREDICTIONS, judge=ExactJudge())
    # GPT over the five judge-tagged questions the graph filter keeps (not id 2): only id 6 is exact
    gpt = (100 + 4 * 40) / 5 / 100
    assert s.gpt["score"] == pytest.approx(gpt)
    # match = (mean F1 * 100 + mean judge over the match questions) / 2, in 0..1
    assert s.match["score"] == pytest.approx(((2 / 3 + 0.8) / 3 * 100 + 40) / 2 / 100, abs=1e-6)
    expected = 0.4 * gpt + 0.2 * s.language["score"] + 0.2 * s.match["score"] + 0.2 * 0.25
    assert s.final["with_gpt"] == pytest.approx(expected, abs=1e-15)


@needs_java
def test_graph_filter_skips_questions_about_missed_objects(questions):
    # The first answer matched c1 and c3 but not c2, so the question naming c2 (id 2) is skipped.
    s = score(questions, PREDICTIONS)
    assert s.skipped_by_graph == 1 and s.counts["scored"] == 9
    assert s.counts["language"] == 5
    assert s.by_category["perception"] == {"questions": 3, "skipped_by_graph": 1, "accuracy_questions": 2,
                                           "correct": 1, "accuracy": 0.5}
    assert score(questions, PREDICTIONS, rules=LENIENT).skipped_by_graph == 0


def test_missing_prediction_is_an_error(questions):
    with pytest.raises(KeyError, match="no prediction"):
        score(questions, {k: v for k, v in PREDICTIONS.items() if k != ID(3)})


@needs_java
def test_cli_scores_a_predictions_file(tmp_path, capsys):
    (tmp_path / "qa.json").write_text(json.dumps(QA))
    (tmp_path / "out.json").write_text(json.dumps([{"id": k, "answer": v} for k, v in PREDICTIONS.items()]))
    assert main(["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "out.json"),
                 "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["scores"]["accuracy"] == pytest.approx(0.25)
    assert result["scores"]["gpt"]["available"] is False
    assert result["scores"]["rules"]["name"] == "challenge" and result["scores"]["skipped_by_graph"] == 1
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "bad.json")]) == 2
    assert "expected a list" in capsys.readouterr().err


def test_read_predictions_formats(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"x": "A"}))
    (tmp_path / "b.json").write_text(json.dumps([{"id": "x", "answer": "A", "question": "q"}]))
    assert read_predictions(tmp_path / "a.json") == read_predictions(tmp_path / "b.json") == {"x": "A"}
    with pytest.raises(InputError):
        read_predictions(tmp_path / "missing.json")


def test_real_drivelm_file_loads_and_resolves(drivelm_dir):
    frames = load_frames(drivelm_dir / "qa_scene_n008.json")
    assert len(frames) == 4
    ids = [q.id for f in frames for q in f.questions]
    assert len(ids) == len(set(ids)) > 300
    for frame in frames:
        paths = frame_images(drivelm_dir, frame)           # ../nuscenes/samples/CAM_X/f.jpg -> samples/CAM_X/f.jpg
        assert all(p.is_file() and p.parent.name == cam for cam, p in paths.items())


@needs_java
def test_challenge_tags_are_kept_and_empty_answers_score_zero(tmp_path):
    qa = json.loads(json.dumps(QA))
    frame = qa["scene1"]["key_frames"]["frame1"]["QA"]
    frame["planning"][0]["tag"] = [0]          # the challenge's test file may put any question under accuracy
    (tmp_path / "qa.json").write_text(json.dumps(qa))
    questions = [q for f in load_frames(tmp_path / "qa.json") for q in f.questions]
    assert questions[6].tags == (ACCURACY,)
    s = score(questions, {q.id: "" for q in questions})
    # The empty first answer matched nothing: the graph filter skips ids 1, 2, 4 (they name objects)
    assert s.skipped_by_graph == 3
    assert s.counts["accuracy"] == 3 and s.accuracy == 0.0
    assert score(questions, {q.id: "" for q in questions}, rules=LENIENT).counts["accuracy"] == 5
    assert s.language["score"] == 0.0 and s.match["f1"] == pytest.approx(0.0, abs=1e-6)
    assert s.final["without_gpt"] == pytest.approx(0.0, abs=1e-6)
