"""`litevlm eval --constrain`: choices derived from a closed-form question's text alone, and the
command's with/without table on a small fresh SynthDrive set with the bundled model (every
constrained closed-form answer is one of its choices)."""

import re
import subprocess
import sys

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.evaluation.choices import closed_form_choices


def test_choices_from_the_question_alone():
    q = ("What is the state of the car? Please select the correct answer from the following options: "
         "A. Parked. B. Moving. C. Turning. D. Reversing.")
    assert closed_form_choices(q) == ["A", "B", "C", "D"]
    assert closed_form_choices("Options: A. left B. right") == ["A", "B"]
    assert closed_form_choices("Is there a pedestrian in front of the ego car?") == ["Yes.", "No."]
    assert closed_form_choices("Would <c1,CAM_FRONT,1.0,2.0> be in the moving direction of the ego vehicle?") == [
        "Yes.",
        "No.",
    ]
    assert closed_form_choices("What are the important objects in the current scene?") is None
    assert closed_form_choices("Island ahead: what now?") is None          # "Is" only as a whole word


def test_eval_constrain_on_a_fresh_synthdrive_set(tmp_path):
    synth = tmp_path / "synth"
    subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "synth", "--out", str(synth), "--scenes", "2",
                    "--seed", "4243", "--width", "480", "--height", "270", "--workers", "1", "--quiet"], check=True)
    run = subprocess.run([sys.executable, "-m", "litevlm_runtime.cli", "eval", "--model", str(DEFAULT_MODEL),
                          "--data", str(synth / "train.json"), "--frames", str(synth), "--limit", "24", "--constrain",
                          "--quiet"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    m = re.search(
        r"constrained answers: (\d+) closed-form questions \(scored by accuracy\), (\d+) with choices", run.stdout
    )
    assert m and int(m.group(1)) > 0 and m.group(1) == m.group(2), run.stdout
    n = m.group(1)
    assert re.search(rf"^with\s+{n}/{n}\s+[\d.]+$", run.stdout, re.M), run.stdout       # every one a valid choice
    assert re.search(rf"^without\s+\d+/{n}\s+[\d.]+$", run.stdout, re.M), run.stdout
