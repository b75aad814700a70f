"""The explained query the explanation tests share (test_explanation.py: its numbers;
test_explain_outputs.py: the picture and the Foxglove MCAP): a real query on the tiny random model
with an untrained view selector (the keyword map and the tag decide), layer-0 token selection at
r = 0.5 and greedy decoding, its trace and its explanation over both decoder layers. Module fixture:
`from helpers.explain import explained`."""

import cv2
import pytest
import torch

from helpers import options, random_frames
from litevlm_runtime.pipeline.explanation import explain, trace_from_arena
from litevlm_runtime.pipeline.pipeline import Pipeline
from litevlm_runtime.stages.view_selector import ViewSelector, ViewSelectorConfig, save_view_selector, train_tokenizer

QUESTION = "Is there a car to the front left of <c1,CAM_FRONT_LEFT,805.5,430.0> and behind us?"


def jpeg_frames(seed: int) -> dict[str, bytes]:
    """Six random 160 x 90 frames as JPEG bytes (what a camera topic carries)."""
    return {cam: cv2.imencode(".jpg", img)[1].tobytes() for cam, img in random_frames(seed).items()}


@pytest.fixture(scope="module")
def explained(tiny_model, tmp_path_factory):
    """(pipeline, answer, trace, explanation, frames) of QUESTION."""
    torch.manual_seed(0)
    tok = train_tokenizer(["what is behind the ego car", "is there a car in the front left"])
    selector = ViewSelector(ViewSelectorConfig(vocab_size=tok.get_vocab_size(), width=32, layers=1, heads=2, ffn=64))
    folder = tmp_path_factory.mktemp("vs") / "view_selector"
    save_view_selector(folder, selector, tok)
    pipe = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=6, views__mode="selector",
                                                        views__selector_dir=str(folder), tokens__mode="layer0",
                                                        tokens__keep_ratio=0.5, decoding__mode="greedy"))
    frames = jpeg_frames(1)
    answer = pipe.answer(frames, QUESTION)
    trace = trace_from_arena(pipe.rt, answer)
    return pipe, answer, trace, explain(pipe.rt, trace, layers=(0, 1)), frames
