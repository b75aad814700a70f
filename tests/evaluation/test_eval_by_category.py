"""`eval --json` accuracy per question category (scores.by_category.<name>.accuracy), motion among
them: the categories split exactly the questions the totals count, under either rules; and
`eval --compare` per category."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from litevlm_runtime.cli import main
from litevlm_runtime.evaluation.compare import compare_runs
from litevlm_runtime.evaluation.data import MOTION, load_frames
from litevlm_runtime.evaluation.metrics import ACCURACY, CHALLENGE, LENIENT, answer_is_correct, score
from litevlm_runtime.synth.generate import SynthSpec, generate

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap's PTB tokenizer needs Java")


@pytest.fixture(scope="module")
def motion_qa(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("motion_eval")
    generate(out, SynthSpec(6, 77, 160, 90, val_fraction=0.0, frames=3, stride=0.5), workers=1, progress=False)
    return out / "train.json"


def _wrong(answer: str) -> str:
    return {"Yes.": "No.", "No.": "Yes.", "A": "B", "B": "C", "C": "D", "D": "A"}.get(answer, "Something else.")


def _predictions(questions, salt: str, motion_right: bool | None = None) -> dict[str, str]:
    """About two thirds of the answers right, chosen by a hash of the id (and `salt`); the motion
    questions all right or all wrong when motion_right is given. A frame's first answer names no
    object in every third frame, so that the challenge's graph filter skips questions there."""
    out = {}
    for q in questions:
        right = int(hashlib.md5((salt + q.id).encode()).hexdigest(), 16) % 3 != 0
        if q.category == MOTION and motion_right is not None:
            right = motion_right
        out[q.id] = q.answer if right else _wrong(q.answer)
        if q.id.endswith("_0") and int(hashlib.md5(q.frame.encode()).hexdigest(), 16) % 3 == 0:
            out[q.id] = "There are no important objects."
    return out


def _assert_split(s, questions, predictions, rules) -> None:
    cats = s.by_category
    assert MOTION in cats and set(cats) == {q.category for q in questions}
    assert sum(v["questions"] for v in cats.values()) == s.counts["scored"]
    assert sum(v["skipped_by_graph"] for v in cats.values()) == s.skipped_by_graph
    assert sum(v["accuracy_questions"] for v in cats.values()) == s.counts["accuracy"]
    assert sum(v["correct"] for v in cats.values()) / s.counts["accuracy"] == pytest.approx(s.accuracy, abs=1e-12)
    motion = [q for q in questions if q.category == MOTION and ACCURACY in q.tags]
    assert all(q.frames == 3 for q in questions if q.category == MOTION)
    if rules is LENIENT:      # nothing skipped: the motion accuracy is that of every closed-form motion question
        assert cats[MOTION]["accuracy_questions"] == len(motion)
        assert cats[MOTION]["correct"] == sum(answer_is_correct(predictions[q.id], q.answer, rules) for q in motion)


def test_categories_split_exactly_what_the_totals_count(motion_qa):
    questions = [q for f in load_frames(motion_qa) for q in f.questions if ACCURACY in q.tags]
    predictions = _predictions(questions, "a")
    for rules in (CHALLENGE, LENIENT):
        s = score(questions, predictions, rules=rules)
        _assert_split(s, questions, predictions, rules)
        assert s.per_category is s.by_category                  # the old name, for the fleet's comparison
    assert score(questions, predictions, rules=CHALLENGE).skipped_by_graph > 0


@needs_java
def test_eval_json_reports_accuracy_per_category_with_motion(motion_qa, tmp_path, capsys):
    questions = [q for f in load_frames(motion_qa) for q in f.questions]
    predictions = _predictions(questions, "b")
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"id": k, "answer": v} for k, v in predictions.items()]))
    for flag, rules in (([], CHALLENGE), (["--lenient"], LENIENT)):
        assert main(["eval", "--data", str(motion_qa), "--from-predictions", str(path), "--json", *flag]) == 0
        scores = json.loads(capsys.readouterr().out)["scores"]
        mine = score(questions, predictions, rules=rules)
        _assert_split(mine, questions, predictions, rules)
        assert scores["by_category"] == json.loads(json.dumps(mine.by_category))
        assert scores["by_category"]["motion"]["accuracy"] == mine.by_category["motion"]["accuracy"] is not None
        assert "per_category" not in scores
    assert main(["eval", "--data", str(motion_qa), "--from-predictions", str(path)]) == 0
    assert any(line.startswith("motion ") for line in capsys.readouterr().out.splitlines())


def test_compare_per_category_moves_only_the_category_that_changed(motion_qa, tmp_path, capsys):
    """Two runs that differ only on motion questions (all right against all wrong): the motion
    category's difference is -100 points, every other category's 0, and the totals' lies between."""
    questions = [q for f in load_frames(motion_qa) for q in f.questions]
    runs = {"four": _predictions(questions, "c", motion_right=True), "one": _predictions(questions, "c",
                                                                                         motion_right=False)}
    for name, preds in runs.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(preds))
    total = compare_runs(questions, runs, LENIENT, resamples=200)
    motion = compare_runs(questions, runs, LENIENT, resamples=200, category=MOTION)
    assert motion[0].accuracy == 1.0 and motion[1].accuracy == 0.0 and motion[1].delta == -1.0
    assert -1.0 < total[1].delta < 0.0
    for category in {q.category for q in questions} - {MOTION}:
        other = compare_runs(questions, runs, LENIENT, resamples=200, category=category)
        assert other[1].delta == 0.0 and other[1].identical == other[1].questions
    assert sum(compare_runs(questions, runs, LENIENT, resamples=10, category=c)[0].scored
               for c in {q.category for q in questions}) == total[0].scored
    args = ["eval", "--data", str(motion_qa), "--lenient", "--compare", f"four={tmp_path / 'four.json'}",
            "--compare", f"one={tmp_path / 'one.json'}"]
    assert main(args + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=lambda name: pytest.fail(f"{name} is not JSON"))
    assert out[1]["by_category"]["motion"]["delta"] == -1.0 and out[1]["by_category"]["planning"]["delta"] == 0.0
    assert main(args) == 0
    assert "category motion:" in capsys.readouterr().out
