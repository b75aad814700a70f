"""The bundled default model loads through the pipeline and answers in the trained templates."""

from __future__ import annotations

import json

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions


def test_bundled_model_is_small_and_answers_like_its_training(tmp_path):
    size = sum(p.stat().st_size for p in DEFAULT_MODEL.rglob("*") if p.is_file())
    assert size <= 40 * 2**20
    from litevlm_runtime.synth.generate import SynthSpec, generate

    generate(tmp_path / "set", SynthSpec(1, seed=99, width=480, height=270, val_fraction=0.0), workers=1,
             progress=False)
    doc = json.loads((tmp_path / "set" / "train.json").read_text())
    frame = next(iter(next(iter(doc.values()))["key_frames"].values()))
    images = {cam: tmp_path / "set" / p for cam, p in frame["image_paths"].items()}
    pipe = Pipeline.from_pretrained(DEFAULT_MODEL, PipelineOptions())      # the deployed LiteVLM pipeline
    assert pipe.rt.options.label() == "litevlm[views,tokens@0.8,eagle]"
    behaviour = pipe.answer(images, "Predict the behavior of the ego vehicle.")
    assert behaviour.text.startswith("The ego vehicle is "), behaviour.text
    yes_no = pipe.answer(images, "Does the ego vehicle need to stop?")
    assert yes_no.text in ("Yes.", "No."), yes_no.text
