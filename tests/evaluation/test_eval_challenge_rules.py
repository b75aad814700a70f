"""`litevlm eval` with default flags against the DriveLM challenge's evaluation.py rules, on edge
answers whose expected values are worked out by hand here (the rules are listed in
evaluation/metrics.py), and the --lenient variant's values where they differ.

Hand rules used below: coordinates are the `\\d+\\.\\d+` numbers of a text in pairs (a prediction
with an odd count drops its last number); a predicted point matches the nearest remaining
reference point if the L1 distance is under 16; F1 = 2PR / (P + R + 1e-8) with
P = TP / (TP + FP + 1e-8), R = TP / (TP + FN + 1e-8); accuracy is `answer == gt`. Tolerance 1e-15
wherever a value is a float computed two ways, exact otherwise.
"""

from __future__ import annotations

import json
import shutil

import pytest

from litevlm_runtime.cli import main
from litevlm_runtime.errors import InputError
from litevlm_runtime.evaluation.data import load_frames
from litevlm_runtime.evaluation.metrics import (
    CHALLENGE,
    LENIENT,
    Question,
    answer_is_correct,
    language_metrics,
    match_f1,
    points,
    score,
)

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="pycocoevalcap's PTB tokenizer needs Java")
pytest.importorskip("pycocoevalcap")

C1, C2, C3 = "<c1,CAM_BACK,1088.3,497.5>", "<c2,CAM_BACK,864.2,468.3>", "<c3,CAM_FRONT,1043.2,82.2>"
OBJECTS_Q = "What are the important objects in the current scene?"
OBJECTS_A = f"There is a brown SUV {C1}, a black sedan {C2} and a green light {C3}."


def f1(tp: int, fp: int, fn: int) -> float:
    """The challenge's F1 from hand-counted true/false positives and false negatives."""
    p = tp / (tp + fp + 1e-8)
    r = tp / (tp + fn + 1e-8)
    return 2 * p * r / (p + r + 1e-8)


# The prediction for OBJECTS_Q (reference points C1, C2, C3) with, by hand: (TP, FP, FN) and the
# graph (which of C1..C3 it matched) under the challenge's rules, and (TP, FP, FN) under --lenient.
COORDINATE_CASES = [
    ("tags", f"{C1}, {C2} and {C3}", (3, 0, 0), {1, 2, 3}, (3, 0, 0)),
    # Bare numbers are coordinates to the challenge: both points at distance 0. No tag: nothing lenient.
    ("bare pairs", "(1088.3, 497.5) and (1043.2, 82.2)", (2, 0, 1), {1, 3}, (0, 0, 3)),
    # Integers are no numbers to the challenge; lenient reads the tags: L1 0.8 to C1, 0.4 to C3.
    ("integer tags", "<c1,CAM_BACK,1088,497>, <c3,CAM_FRONT,1043,82>", (0, 0, 3), set(), (2, 0, 1)),
    # No sign in the challenge's regex: -1088.3 reads 1088.3 (a match). Lenient keeps the sign:
    # (-1088.3, 497.5) is 1981.7 from its nearest point, C2.
    ("negative", "<c1,CAM_BACK,-1088.3,497.5>", (1, 0, 2), {1}, (0, 1, 3)),
    ("newlines", "<c1,CAM_BACK,1088.3,\n497.5>\n", (1, 0, 2), {1}, (1, 0, 2)),
    # 12.5, 864.2, 468.3: odd, the last is dropped, the point (12.5, 864.2) matches nothing.
    ("number before", "At 12.5 m/s: <c2,CAM_BACK,864.2,468.3>.", (0, 1, 3), set(), (1, 0, 2)),
    # 864.2, 468.3, 12.5: the dropped last number is the speed.
    ("number after", "<c2,CAM_BACK,864.2,468.3> at 12.5 m/s.", (1, 0, 2), {2}, (1, 0, 2)),
    ("no coordinates", "There is a car behind.", (0, 0, 3), set(), (0, 0, 3)),
    ("empty", "", (0, 0, 3), set(), (0, 0, 3)),
    # Python's \d and float() take full-width digits: 1043.2, 82.2.
    ("unicode digits", "<c3,CAM_FRONT,\uff11\uff10\uff14\uff13.\uff12,\uff18\uff12.\uff12>", (1, 0, 2), {3}, (1, 0, 2)),
    # Greedy in the prediction's order: (1050.0, 82.2) takes C3 (6.8); (1043.2, 82.2) then finds
    # C1 460.4 away: a false positive although it is exactly C3.
    ("greedy order", "(1050.0, 82.2) (1043.2, 82.2)", (1, 1, 2), {3}, (0, 0, 3)),
]

# (reference, prediction, correct under the challenge's rules, correct under --lenient)
ACCURACY_CASES = [
    ("Yes.", "Yes.", True, True),
    ("Yes.", "Yes. ", False, True),
    ("Yes.", "Yes.\n", False, True),
    ("No.", "\tNo.\r\n", False, True),
    ("No.", "no.", False, False),
    ("No.", "No", False, False),
    ("B", "B", True, True),
    ("B", " B", False, True),
    ("B", "B.", False, False),
    ("B", "", False, False),
    ("Yes.", "Yes.\u00a0", False, True),             # str.strip() takes the no-break space too
    ("Yes.", "Yes\uff0e", False, False),             # full-width full stop
    ("Caf\u00e9.", "Cafe\u0301.", False, False),     # same text, NFD: no normalisation anywhere
    ("Caf\u00e9.", "Caf\u00e9.", True, True),
]


@pytest.mark.parametrize("name,prediction,challenge,graph,lenient", COORDINATE_CASES,
                         ids=[c[0] for c in COORDINATE_CASES])
def test_match_f1_edge_answers_by_hand(name, prediction, challenge, graph, lenient):
    reference_points = {1: (1088.3, 497.5), 2: (864.2, 468.3), 3: (1043.2, 82.2)}
    got, matched = match_f1(prediction, OBJECTS_A)
    assert got == pytest.approx(f1(*challenge), abs=1e-15)
    assert sorted(matched) == sorted(reference_points[i] for i in graph)
    got, _ = match_f1(prediction, OBJECTS_A, coordinates="tags")
    assert got == pytest.approx(f1(*lenient), abs=1e-15)


def test_coordinate_parsing_quirks():
    assert points("(1043.2, 82.2)") == [(1043.2, 82.2)]
    assert points("(1043.2, 82.2)", "tags") == []
    assert points("<c1,CAM_FRONT,-5.5,-7.25>") == [(5.5, 7.25)]
    assert points("<c1,CAM_FRONT,-5.5,-7.25>", "tags") == [(-5.5, -7.25)]
    assert points("1.2.3 4.5") == [(1.2, 4.5)]          # "1.2.3" reads 1.2 only (".3" has no integer part)
    assert points("007.50, 1e3, 2.0") == [(7.5, 2.0)]    # 1e3 is no d.d number
    assert points("1.5 2.5 3.5") == [(1.5, 2.5)]         # a prediction drops an unpaired last number
    with pytest.raises(ValueError, match="3 decimal numbers"):
        points("1.5 2.5 3.5", odd="refuse")             # a reference or question cannot (the script fails)
    assert points("\u0661\u0660.\u0665, 2.0") == [(10.5, 2.0)]   # Arabic-Indic digits are \d too


def test_no_points_on_either_side_scores_zero():
    # TP = FP = FN = 0: P = R = 0 and F1 = 0 / 1e-8 = 0, even though "none" is the right answer.
    assert match_f1("There is nothing.", "No objects.") == (0.0, [])
    assert f1(0, 0, 0) == 0.0


@pytest.mark.parametrize("reference,prediction,challenge,lenient", ACCURACY_CASES)
def test_accuracy_edge_answers(reference, prediction, challenge, lenient):
    assert answer_is_correct(prediction, reference, CHALLENGE) is challenge
    assert answer_is_correct(prediction, reference, LENIENT) is lenient


def edge_qa() -> tuple[dict, dict, list]:
    """One frame per coordinate case: the objects question (tags 1, 2, 3) with the case's
    prediction, then three closed questions naming C1, C2, C3 (their references and predictions
    taken in turn from ACCURACY_CASES), then an open question naming nothing.
    Returns the QA file, the predictions, and per frame [(object named, accuracy case)]."""
    frames, predictions, plan = {}, {}, []
    language_answers = ["The ego vehicle is going straight.", "The ego vehicle is\ngoing straight.", "",
                        "The ego vehicle is slowing down, caf\u00e9 ahead."]
    for k, (name, prediction, *_) in enumerate(COORDINATE_CASES):
        token = f"f{k:02d}"
        cases = [ACCURACY_CASES[(3 * k + j) % len(ACCURACY_CASES)] for j in range(3)]
        plan.append(list(zip((1, 2, 3), cases)))
        qa = {
            "perception": [
                {"Q": OBJECTS_Q, "A": OBJECTS_A, "tag": [1, 2, 3]},
                {
                    "Q": f"What is the moving status of object {C1}? Please select the correct answer "
                    f"from the following options: A. Going ahead. B. Stopped.",
                    "A": cases[0][0],
                    "tag": [0],
                },
            ],
            "prediction": [{"Q": f"Is {C2} a traffic sign or a road barrier?", "A": cases[1][0], "tag": [0]}],
            "planning": [
                {"Q": f"Would {C3} be in the moving direction of the ego vehicle?", "A": cases[2][0], "tag": [0]}
            ],
            "behavior": [
                {"Q": "Predict the behavior of the ego vehicle.", "A": "The ego vehicle is going straight.", "tag": [2]}
            ],
        }
        frames[token] = {"image_paths": {}, "QA": qa}
        answers = [prediction, cases[0][1], cases[1][1], cases[2][1], language_answers[k % len(language_answers)]]
        predictions.update({f"s_{token}_{i}": a for i, a in enumerate(answers)})
    return {"s": {"key_frames": frames}}, predictions, plan


def expected(rules_name: str) -> dict:
    """Accuracy, match F1, counts and template counts by hand from the case tables."""
    _, _, plan = edge_qa()
    acc, f1s, skipped, per_object = [], [], 0, {1: [], 2: [], 3: []}
    for (name, _, challenge, graph, lenient), closed in zip(COORDINATE_CASES, plan):
        f1s.append(f1(*(challenge if rules_name == "challenge" else lenient)))
        for obj, (_, _, ok_challenge, ok_lenient) in closed:
            if rules_name == "challenge" and obj not in graph:
                skipped += 1
                continue
            ok = ok_challenge if rules_name == "challenge" else ok_lenient
            acc.append(1.0 if ok else 0.0)
            per_object[obj].append(ok)
    return {"accuracy": sum(acc) / len(acc), "accuracy_questions": len(acc), "skipped": skipped,
            "match_f1": sum(f * 100 for f in f1s) / len(f1s) / 100.0, "per_object": per_object}


def language_by_hand(qa: dict, predictions: dict) -> float:
    """pycocoevalcap's scorers called directly on the open questions (the objects question and the
    behavior question of every frame: neither can be skipped), combined by the challenge's formula."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    pairs = []
    for token in sorted(qa["s"]["key_frames"]):
        pairs += [(predictions[f"s_{token}_0"], OBJECTS_A),
                  (predictions[f"s_{token}_4"], "The ego vehicle is going straight.")]
    tok = PTBTokenizer()
    refs = tok.tokenize({i: [{"caption": r}] for i, (_, r) in enumerate(pairs)})
    hyps = tok.tokenize({i: [{"caption": p}] for i, (p, _) in enumerate(pairs)})
    bleu, _ = Bleu(4).compute_score(refs, hyps)
    rouge, _ = Rouge().compute_score(refs, hyps)
    cider, _ = Cider().compute_score(refs, hyps)
    return bleu[0] / 4 / 3 + bleu[1] / 4 / 3 + bleu[2] / 4 / 3 + bleu[3] / 4 / 3 + rouge / 3 + cider / 10 / 3


@needs_java
@pytest.mark.parametrize("flags,rules_name", [([], "challenge"), (["--lenient"], "lenient")])
def test_eval_from_predictions_on_edge_answers(tmp_path, capsys, flags, rules_name):
    qa, predictions, _ = edge_qa()
    (tmp_path / "qa.json").write_text(json.dumps(qa))
    (tmp_path / "pred.json").write_text(json.dumps([{"id": k, "answer": v} for k, v in predictions.items()]))
    argv = ["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "pred.json"),
            "--by-question", "--json"] + flags
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    s, want = out["scores"], expected(rules_name)
    n_frames = len(COORDINATE_CASES)

    assert s["rules"]["name"] == rules_name
    assert s["skipped_by_graph"] == want["skipped"]
    assert s["counts"]["questions"] == 5 * n_frames and s["counts"]["scored"] == 5 * n_frames - want["skipped"]
    assert s["counts"]["accuracy"] == want["accuracy_questions"]
    assert s["accuracy"] == pytest.approx(want["accuracy"], abs=1e-15)
    assert s["counts"]["match"] == n_frames
    assert s["match"]["score"] == pytest.approx(want["match_f1"], abs=1e-15)
    # The objects and behavior questions name no object: scored under both rules, same language score.
    assert s["counts"]["language"] == 2 * n_frames
    language = language_by_hand(qa, predictions)
    assert s["language"]["score"] == pytest.approx(language, abs=1e-15)
    without = 0.2 * language + 0.2 * want["match_f1"] + 0.2 * want["accuracy"]
    assert s["final"]["without_gpt"] == pytest.approx(without, abs=1e-15)
    assert s["final"]["renormalized"] == pytest.approx(without / 0.6, abs=1e-15)

    # Per category and per template: exactly the questions the rules scored.
    by_object = want["per_object"]
    cat = s["by_category"]
    assert cat["perception"]["questions"] == n_frames + len(by_object[1])
    assert cat["prediction"]["questions"] == len(by_object[2])
    assert cat["planning"]["questions"] == len(by_object[3])
    assert cat["behavior"]["questions"] == n_frames
    assert sum(v["skipped_by_graph"] for v in cat.values()) == want["skipped"]
    for category, obj in (("perception", 1), ("prediction", 2), ("planning", 3)):
        oks = by_object[obj]
        assert cat[category]["accuracy_questions"] == len(oks)
        assert cat[category]["accuracy"] == (pytest.approx(sum(oks) / len(oks), abs=1e-15) if oks else None)
    rows = {r["template"]: r for r in out["by_template"]}
    assert len(rows) == 3
    counts = sorted(r["questions"]["this run"] for r in rows.values())
    assert counts == sorted(len(v) for v in by_object.values())
    assert sum(r["questions"]["this run"] for r in rows.values()) == s["counts"]["accuracy"]


@needs_java
def test_default_report_names_the_rules(tmp_path, capsys):
    qa, predictions, _ = edge_qa()
    (tmp_path / "qa.json").write_text(json.dumps(qa))
    (tmp_path / "pred.json").write_text(json.dumps(predictions))
    base = ["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "pred.json")]
    assert main(base) == 0
    text = capsys.readouterr().out
    assert "rules: the DriveLM challenge's evaluation.py" in text and "accuracy (exact match)" in text
    assert f"graph filter: {5 * len(COORDINATE_CASES) - expected('challenge')['skipped']} of" in text
    assert main(base + ["--lenient"]) == 0
    text = capsys.readouterr().out
    assert "rules: lenient" in text and "graph filter" not in text and "match after strip()" in text


@needs_java
def test_graph_filter_flag_is_deprecated_not_different(tmp_path, capsys):
    qa, predictions, _ = edge_qa()
    (tmp_path / "qa.json").write_text(json.dumps(qa))
    (tmp_path / "pred.json").write_text(json.dumps(predictions))
    base = ["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "pred.json"), "--json"]
    assert main(base) == 0
    default = json.loads(capsys.readouterr().out)
    assert main(base + ["--graph-filter"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out) == default
    assert "--graph-filter is deprecated" in captured.err
    assert main(base + ["--graph-filter", "--lenient"]) == 2
    assert "contradicts --lenient" in capsys.readouterr().err


def odd_qa(where: str) -> dict:
    objects_a = OBJECTS_A + (" It drives at 12.5 m/s." if where == "reference" else "")
    second_q = f"Is {C2} moving at 12.5 m/s?" if where == "question" else f"Is {C2} moving?"
    return {"s": {"key_frames": {"f": {"image_paths": {}, "QA": {"perception": [
        {"Q": OBJECTS_Q, "A": objects_a, "tag": [1, 2, 3]}, {"Q": second_q, "A": "Yes.", "tag": [0]}]}}}}}


@pytest.mark.parametrize("where", ["reference", "question"])
def test_odd_numbers_in_references_fail_as_in_the_challenge(tmp_path, where):
    # evaluation.py reshapes a reference's or question's numbers to (-1, 2) without dropping an
    # unpaired one, and fails there; here that is an error naming the question.
    (tmp_path / "qa.json").write_text(json.dumps(odd_qa(where)))
    questions = [q for f in load_frames(tmp_path / "qa.json") for q in f.questions]
    culprit = (
        "s_f_0: its reference answer: 7 decimal" if where == "reference" else "s_f_1: its question text: 3 decimal"
    )
    with pytest.raises(InputError, match=culprit):
        score(questions, {"s_f_0": f"{C1} {C2}", "s_f_1": "Yes."})


@needs_java
@pytest.mark.parametrize("where", ["reference", "question"])
def test_odd_numbers_in_references_score_under_lenient_rules(tmp_path, where):
    (tmp_path / "qa.json").write_text(json.dumps(odd_qa(where)))
    questions = [q for f in load_frames(tmp_path / "qa.json") for q in f.questions]
    s = score(questions, {"s_f_0": f"{C1} {C2}", "s_f_1": "Yes."}, rules=LENIENT)
    assert s.match["f1"] == pytest.approx(f1(2, 0, 1), abs=1e-15) and s.accuracy == 1.0


@needs_java
def test_line_breaks_the_tokenizer_splits_are_replicated_and_counted():
    # coco-caption turns "\n" into a space but Stanford's tokenizer also ends lines at "\r": the
    # first prediction becomes two lines and the second is scored against the first's tail.
    qs = [Question(f"f_{i}", "f", "Describe.", a, (2,)) for i, a in enumerate(["go straight now", "turn left"])]
    s = score(qs, {"f_0": "go\rstraight now", "f_1": "turn left"})
    assert s.language["texts_split_by_tokenizer"] == 1
    direct = language_metrics(["go\rstraight now", "turn left"], ["go straight now", "turn left"])
    assert {k: s.language[k] for k in direct} == direct
    assert s.language["Bleu_1"] < 0.5       # "turn left" itself was not compared with "turn left"
    unsplit = score(qs, {"f_0": "go\nstraight now", "f_1": "turn left"})
    assert unsplit.language["texts_split_by_tokenizer"] == 0 and unsplit.language["Bleu_1"] == pytest.approx(1.0)


def test_judge_must_return_a_number():
    class Chatty:
        name = "chatty"

        def score(self, question, prediction, reference):
            return "I would say 62"

    qs = [Question("f_0", "f", "Describe.", "A car.", (1,))]
    with pytest.raises(InputError, match="judge chatty: question f_0"):
        score(qs, {"f_0": "A car."}, judge=Chatty())


@needs_java
def test_cli_judge_enters_the_final_score_like_the_challenge(tmp_path, capsys, monkeypatch):
    # A judge whose reply is a string, as the challenge's GPT reply is (read with float()).
    (tmp_path / "edge_judge.py").write_text(
        "class Judge:\n"
        "    name = 'half'\n"
        "    def score(self, question, prediction, reference):\n"
        "        return '50' if prediction else '0'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    qa, predictions, _ = edge_qa()
    (tmp_path / "qa.json").write_text(json.dumps(qa))
    (tmp_path / "pred.json").write_text(json.dumps(predictions))
    assert main(["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "pred.json"),
                 "--judge", "edge_judge:Judge", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)["scores"]
    want, n = expected("challenge"), len(COORDINATE_CASES)
    # The judged (tag 1) and matched (tag 3) questions are the objects questions; one answer is empty.
    judge_mean = (50 * (n - 1) + 0) / n
    assert s["gpt"]["score"] == pytest.approx(judge_mean / 100, abs=1e-15)
    match = (want["match_f1"] * 100 + judge_mean) / 2 / 100
    assert s["match"]["score"] == pytest.approx(match, abs=1e-15)
    final = 0.4 * judge_mean / 100 + 0.2 * s["language"]["score"] + 0.2 * match + 0.2 * want["accuracy"]
    assert s["final"]["with_gpt"] == pytest.approx(final, abs=1e-15)


def test_challenge_judge_messages():
    from litevlm_runtime.evaluation.judge import challenge_messages
    # gpt_eval.py concatenates without separators: reference first, then the answer.
    assert challenge_messages("Go.", "Stop.") == [
        {"role": "system", "content": "an evaluator who rates my answer based on the correct answer"},
        {"role": "user", "content": "Rate my answer based on the correct answer out of 100, with higher scores "
                                    "indicating that the answer is closer to the correct answer, and you should be "
                                    "accurate to single digits like 62, 78, 41,etc. Output the number onlyThis is "
                                    "the correct answer: Stop.This is my answer: Go."}]
