"""How much of a motion question one frame gives away: each motion question of a SynthDrive set in
motion answered from what a perfect single-frame perceiver knows about the scene, its ground truth
at the key frame without the motion (the object's kind, place, camera, side and distance; the
traffic light, pedestrians on the crossing, the gap to the vehicle ahead), by a random forest
fitted on another set, beside the per-template majority answer. A question that needs time scores
the majority there; where the forest beats it, one frame's layout tells part of the answer
(physics does: a standing object ahead of a moving ego comes closer).

    python -m litevlm_runtime.evaluation.one_frame TRAIN_SET TEST_SET

(sets made with `litevlm synth --frames K`; scikit-learn, which is not among the runtime's
requirements, fits the forest)."""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

from ..objects import OBJECT_TAG
from ..report import table
from ..synth.world import VEHICLE_KINDS
from .breakdown import question_template
from .data import MOTION, load_frames
from .metrics import ACCURACY

OPTION = re.compile(r"([A-D])\. ([^.]+\.)")


def _bucket(value: float, edges: tuple[float, ...]) -> int:
    return sum(value >= e for e in edges)


def one_frame_facts(truth: dict, obj: dict | None) -> dict[str, str]:
    """What one frame shows that bears on motion, as categorical features."""
    objects = truth["objects"]
    lead = min((o["s"] for o in objects if o["kind"] in VEHICLE_KINDS and o["place"] == "ego lane" and o["s"] > 0),
               default=None)
    facts = {"light": str(truth["ego"]["light_state"]),
             "crossing": str(any(o["kind"] == "pedestrian" and o["place"] == "crossing" for o in objects)),
             "lead_gap": "none" if lead is None else str(_bucket(lead, (16.0, 20.0, 38.0)))}
    if obj is not None:
        facts |= {"kind": obj["kind"], "place": obj["place"], "camera": obj["camera"], "ahead": str(obj["s"] > 0),
                  "distance": str(_bucket(obj["distance_m"], (10.0, 20.0, 40.0))),
                  "side": str(_bucket(obj["d"], (-5.25, -1.75, 1.75, 5.25)))}
    return facts


def motion_rows(set_dir: str | Path) -> list[tuple[str, dict, str, str, dict]]:
    """(template, facts, answer text, question, {option text: letter}) of every closed-form motion question."""
    set_dir = Path(set_dir)
    truth = json.loads((set_dir / "ground_truth.json").read_text())
    rows = []
    for split in ("train", "val"):
        for frame in load_frames(set_dir / f"{split}.json"):
            by_id = {o["id"]: o for o in truth[frame.token]["objects"] if o["id"]}
            for q in frame.questions:
                if q.category != MOTION or ACCURACY not in q.tags:
                    continue
                tag = OBJECT_TAG.search(q.question)
                obj = by_id.get(f"c{tag.group(1)}") if tag else None
                options = {text: letter for letter, text in OPTION.findall(q.question.split("options:")[-1])} \
                    if "options:" in q.question else {}
                answer = next((t for t, letter in options.items() if letter == q.answer), q.answer)
                rows.append((question_template(q.question), one_frame_facts(truth[frame.token], obj), answer,
                             q.question, options))
    return rows


def compare(train_dir: str | Path, test_dir: str | Path, seed: int = 0) -> list[dict]:
    """Per motion template of the test set: questions, the majority answer's accuracy (majority from
    the train set), the one-frame forest's."""
    # scikit-learn is not a requirement of the package: only this study needs it (pip install scikit-learn).
    from sklearn.ensemble import RandomForestClassifier
    from sklearn.feature_extraction import DictVectorizer

    train, test = motion_rows(train_dir), motion_rows(test_dir)
    vec = DictVectorizer()
    x_train = vec.fit_transform([{"template": t} | f for t, f, *_ in train])
    x_test = vec.transform([{"template": t} | f for t, f, *_ in test])
    forest = RandomForestClassifier(n_estimators=300, min_samples_leaf=3, random_state=seed)
    forest.fit(x_train, [a for _, _, a, *_ in train])
    probabilities = forest.predict_proba(x_test)
    majority = {t: Counter(a for tt, _, a, *_ in train if tt == t).most_common() for t in {r[0] for r in train}}
    out: dict[str, dict] = {}
    for (template, _, answer, _, options), p in zip(test, probabilities):
        allowed = list(options) if options else ["Yes.", "No."]
        ranked = sorted(zip(p, forest.classes_), reverse=True)
        guess = next((c for _, c in ranked if c in allowed), allowed[0])
        common = next((a for a, _ in majority.get(template, []) if a in allowed), allowed[0])
        row = out.setdefault(template, {"template": template, "questions": 0, "majority": 0, "one_frame": 0})
        row["questions"] += 1
        row["majority"] += common == answer
        row["one_frame"] += guess == answer
    rows = sorted(out.values(), key=lambda r: -r["questions"])
    total = {"template": "all motion questions", "questions": sum(r["questions"] for r in rows),
             "majority": sum(r["majority"] for r in rows), "one_frame": sum(r["one_frame"] for r in rows)}
    return rows + [total]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("train_set")
    p.add_argument("test_set")
    args = p.parse_args(argv)
    rows = compare(args.train_set, args.test_set)
    print(f"closed-form motion questions of {args.test_set}, answered from one frame's facts "
          f"(forest fitted on {args.train_set})")
    print(table(["template", "questions", "majority answer", "one-frame forest"],
                [[r["template"], r["questions"], r["majority"] / r["questions"], r["one_frame"] / r["questions"]]
                 for r in rows], floatfmt="{:.3f}"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
