"""Explanation pictures of DriveLM sample questions (what docs/explain.md shows): each question is
answered by the model on its key frame's six images and its explanation drawn (explain/picture.py).

    python scripts/studies/explain_pictures.py [--model DIR] [--out DIR] [--colours 256] [--width 1440]
                                       [--question ID ...] [--set KEY=VALUE]

Without --question: the docs' three (one camera named by a tag, one by a phrase, one scene-wide).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import litevlm_runtime  # noqa: F401 - first, so that torch's threads sleep when idle (threads.py)
from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.explain.capture import answer_and_explain, drivelm_questions
from litevlm_runtime.explain.picture import write_picture
from litevlm_runtime.options import options_from_flat
from litevlm_runtime.pipeline.pipeline import Pipeline

SAMPLE = Path(__file__).resolve().parents[3] / "shared" / "drivelm_sample"
SCENE = "f0f120e4d4b0441da90ec53b16ee169d"
DOCS_QUESTIONS = {   # DriveLM ids (scene_frame_index) -> the docs' file names
    f"{SCENE}_ffd1bdf020d145759224c629b501d2b2_56": "explain_tagged.png",          # a tag names CAM_FRONT_LEFT
    f"{SCENE}_4a0798f849ca477ab18009c3a20b7df2_3": "explain_back_left.png",        # "back left": one camera
    f"{SCENE}_4a0798f849ca477ab18009c3a20b7df2_27": "explain_scene.png",           # no cue: every camera
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument("--data", type=Path, default=SAMPLE / "qa_scene_n008.json")
    ap.add_argument("--frames", type=Path, default=SAMPLE)
    ap.add_argument("--out", type=Path, default=Path("docs"))
    ap.add_argument("--question", action="append", default=[], metavar="ID", help="a DriveLM question id")
    ap.add_argument("--width", type=int, default=1440)
    ap.add_argument("--colours", type=int, default=0, help="palette size of the PNG (0: full colour)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a pipeline setting")
    args = ap.parse_args()
    names = {q: f"explain_{i}.png" for i, q in enumerate(args.question)} or DOCS_QUESTIONS
    pipe = Pipeline.from_pretrained(args.model, options_from_flat(dict(s.split("=", 1) for s in args.set)))
    args.out.mkdir(parents=True, exist_ok=True)
    for q in drivelm_questions(args.data, args.frames, list(names)):
        images = {c: p.read_bytes() for c, p in q.images.items()}
        answer, explanation = answer_and_explain(pipe, images, q.question)
        out = write_picture(explanation, images, args.out / names[q.id], args.width, args.colours)
        print(json.dumps({"picture": str(out), "kB": out.stat().st_size // 1024, "question": q.question,
                          "answer": answer.text, "reference": q.reference, "cameras": answer.cameras,
                          "pipeline": answer.pipeline, "visual_share": round(explanation.visual_share, 4),
                          "cost_ms": {k: round(v, 1) for k, v in explanation.cost_ms.items()}}, ensure_ascii=False),
              flush=True)


if __name__ == "__main__":
    main()
