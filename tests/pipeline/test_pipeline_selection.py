"""The view selection stage inside the pipeline: only the selected cameras are decoded and encoded."""

import pytest
import torch
from helpers import options, random_frames

from litevlm_runtime.errors import InputError
from litevlm_runtime.pipeline.pipeline import Pipeline, prompt_ids
from litevlm_runtime.stages.view_selector import ViewSelector, ViewSelectorConfig, save_view_selector, train_tokenizer


@pytest.fixture(scope="module")
def selector_dir(tmp_path_factory):
    """An untrained selector: its learned part is noise, so the keyword map and tags decide."""
    torch.manual_seed(0)
    tok = train_tokenizer(["what is behind the ego car", "is there a car in the front left"])
    model = ViewSelector(ViewSelectorConfig(vocab_size=tok.get_vocab_size(), width=32, layers=1, heads=2, ffn=64))
    folder = tmp_path_factory.mktemp("vs") / "view_selector"
    save_view_selector(folder, model, tok)
    return folder


def test_selected_views_only(tiny_model, selector_dir):
    pipe = Pipeline.from_pretrained(tiny_model, options(
        max_new_tokens=4, views__mode="selector", views__selector_dir=str(selector_dir), views__threshold=0.4))
    frames = random_frames(0)
    frames["CAM_FRONT"] = b"this camera is never decoded"       # an unselected view may even be broken
    ans = pipe.answer(frames, "Is there a truck at <c1,CAM_BACK_LEFT,700.0,400.0>?")
    assert "CAM_BACK_LEFT" in ans.cameras and "CAM_FRONT" not in ans.cameras
    assert ans.visual_tokens == len(ans.cameras) * pipe.rt.tokens_per_camera
    assert ans.pipeline == "litevlm[views]"
    ids, spans = prompt_ids(pipe.rt, ans.cameras, ans.question)
    assert ans.input_tokens == len(ids) and len(spans) == len(ans.cameras)
    # The same question with all views costs more visual tokens.
    full = Pipeline.from_pretrained(tiny_model, options(max_new_tokens=4))
    assert full.answer(random_frames(0), ans.question).visual_tokens > ans.visual_tokens
    with pytest.raises(InputError, match="CAM_FRONT: cannot decode"):
        full.answer(frames, ans.question)


def test_unknown_selection_mode(tiny_model):
    with pytest.raises(InputError, match="views.mode: 'magic' is not one of auto, all, selector"):
        Pipeline.from_pretrained(tiny_model, options(views__mode="magic"))
