"""Per-template accuracy (evaluation/breakdown.py) and `litevlm eval --versus`."""

from __future__ import annotations

import json

from litevlm_runtime.evaluation.breakdown import accuracy_by_template, question_template
from litevlm_runtime.evaluation.metrics import ACCURACY, LANGUAGE, LENIENT, MATCH, Question


def test_templates_abstract_objects_directions_and_options():
    a = ("What colour is the car to the front left of the ego car? Please select the correct answer from the "
         "following options: A. Red. B. Blue. C. White. D. Black.")
    b = ("What colour is the bus to the back of the ego car? Please select the correct answer from the "
         "following options: A. Green. B. Blue. C. White. D. Black.")
    assert question_template(a) == question_template(b) == "What colour is the OBJ to the DIR of the ego car? (choice)"
    assert question_template("Is <c3,CAM_BACK,12.5,80.0> moving?") == "Is <obj> STATE?"
    assert question_template("Would <c1,CAM_FRONT,1,2> be in the moving direction of the ego vehicle?") == \
        "Would <obj> be in the moving direction of the ego vehicle?"
    assert question_template("Are there parked trucks to the back right of the ego car?") == \
        question_template("Are there moving cars to the front of the ego car?")


def test_accuracy_per_template_and_versus_column():
    qs = [Question("f_0", "f", "Is <c1,CAM_FRONT,1,1> moving?", "Yes.", (ACCURACY,)),
          Question("f_1", "f", "Is <c2,CAM_BACK,5,5> moving?", "No.", (ACCURACY,)),
          Question("f_2", "f", "Is <c3,CAM_BACK,9,9> stopped?", "No.", (ACCURACY,)),
          Question("f_3", "f", "Does the ego vehicle need to stop?", "Yes.", (ACCURACY,)),
          Question("f_4", "f", "What are the important objects?", "A car.", (LANGUAGE,))]
    runs = {"a": {"f_0": "Yes.", "f_1": "Yes.", "f_2": "No.", "f_3": "Yes.", "f_4": "x"},
            "b": {"f_0": "No.", "f_1": "No.", "f_2": "No.", "f_3": "No.", "f_4": "x"}}
    rows = accuracy_by_template(qs, runs)
    # Integer coordinates are no numbers to the challenge's graph filter: nothing is skipped.
    assert rows == [
        {"template": "Is <obj> STATE?", "questions": {"a": 3, "b": 3}, "accuracy": {"a": 2 / 3, "b": 2 / 3}},
        {
            "template": "Does the ego vehicle need to stop?",
            "questions": {"a": 1, "b": 1},
            "accuracy": {"a": 1.0, "b": 0.0},
        },
    ]


def test_templates_follow_each_runs_graph_filter_and_the_accuracy_rule():
    c1, c2 = "<c1,CAM_FRONT,100.5,200.5>", "<c2,CAM_BACK,300.5,400.5>"
    qs = [Question("f_0", "f", "What are the important objects?", f"{c1} and {c2}", (MATCH,)),
          Question("f_1", "f", f"Is {c1} moving?", "Yes.", (ACCURACY,)),
          Question("f_2", "f", f"Is {c2} moving?", "No.", (ACCURACY,)),
          Question("f_3", "f", "Does the ego vehicle need to stop?", "Yes.", (ACCURACY,))]
    runs = {"found both": {"f_0": f"{c1} {c2}", "f_1": "Yes.", "f_2": "No. ", "f_3": "Yes."},
            "found c1": {"f_0": "(100.5, 200.5)", "f_1": "No.", "f_2": "No.", "f_3": "Yes.\n"}}
    rows = accuracy_by_template(qs, runs)
    # "found c1" matched only c1, so its question about c2 is not scored; "No. " is wrong exactly.
    assert rows == [{"template": "Is <obj> STATE?", "questions": {"found both": 2, "found c1": 1},
                     "accuracy": {"found both": 0.5, "found c1": 0.0}},
                    {"template": "Does the ego vehicle need to stop?", "questions": {"found both": 1, "found c1": 1},
                     "accuracy": {"found both": 1.0, "found c1": 0.0}}]
    rows = accuracy_by_template(qs, runs, LENIENT)
    assert rows[0]["questions"] == {"found both": 2, "found c1": 2}
    assert rows[0]["accuracy"] == {"found both": 1.0, "found c1": 0.5}
    assert rows[1]["accuracy"] == {"found both": 1.0, "found c1": 1.0}


def test_eval_versus_reads_two_prediction_files(tmp_path, capsys):
    from litevlm_runtime.cli import main

    data = {"s": {"key_frames": {"f": {"image_paths": {}, "QA": {"prediction": [
        {"Q": "Is <c1,CAM_FRONT,1,1> moving?", "A": "Yes."}, {"Q": "Is <c2,CAM_BACK,5,5> moving?", "A": "No."}]}}}}}
    (tmp_path / "qa.json").write_text(json.dumps(data))
    ids = ["s_f_0", "s_f_1"]
    (tmp_path / "a.json").write_text(json.dumps([{"id": i, "answer": a} for i, a in zip(ids, ["Yes.", "No."])]))
    (tmp_path / "b.json").write_text(json.dumps([{"id": i, "answer": a} for i, a in zip(ids, ["Yes.", "Yes."])]))
    rc = main(["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "a.json"),
               "--versus", f"blanked={tmp_path / 'b.json'}", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["by_template"] == [{"template": "Is <obj> STATE?", "questions": {"this run": 2, "blanked": 2},
                                   "accuracy": {"this run": 1.0, "blanked": 0.5}}]
    rc = main(["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "a.json"),
               "--versus", f"blanked={tmp_path / 'b.json'}"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "QA this run" in text and "QA blanked" in text
    rc = main(["eval", "--data", str(tmp_path / "qa.json"), "--from-predictions", str(tmp_path / "a.json"),
               "--versus", str(tmp_path / "b.json")])
    assert rc != 0 and "expected NAME=PREDICTIONS.json" in capsys.readouterr().err
