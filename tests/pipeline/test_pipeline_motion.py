"""A model with a motion network (issue 45: motion below the token grid): its folder's motion/ is
loaded and checked, a question over frame sets gets the flow's network output added to each
camera's newest visual tokens (and nothing else), a one-set question and a model without the
network answer as before, and training gives the network the same inputs the pipeline does."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import options
from test_pipeline_frames import QUESTION, moving_sets

from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.models.motion import MotionTokens
from litevlm_runtime.pipeline.pipeline import Pipeline, grey_tiles_of, query_views, with_motion
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.stages.motion import grey_tile, tiles_motion
from litevlm_runtime.weights.checkpoint import load_model, save_motion
from litevlm_runtime.weights.integrity import write_manifest


def with_network(tiny_model, root, zero: bool):
    folder = root / ("zero" if zero else "lively")
    shutil.copytree(tiny_model, folder)
    width = load_model(tiny_model).cfg.llm.hidden_size
    torch.manual_seed(0)
    net = MotionTokens(8, width)
    if not zero:
        torch.nn.init.normal_(net.net[2].weight, std=0.5)
    save_motion(net, folder / "motion")
    write_manifest(folder / "motion")
    return folder, net


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("motion")
    return {"zero": with_network(tiny_model, root, True), "lively": with_network(tiny_model, root, False)}


def pipeline(folder):
    return Pipeline.from_pretrained(folder, options(max_new_tokens=3, temporal__mode="all"))


def test_the_folder_round_trips_and_a_wrong_width_is_named(folders, tiny_model, tmp_path):
    folder, net = folders["lively"]
    loaded = load_model(folder).motion
    for (k, a), b in zip(net.state_dict().items(), loaded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=k)
    assert load_model(tiny_model).motion is None
    bad = tmp_path / "bad"
    shutil.copytree(tiny_model, bad)
    save_motion(MotionTokens(4, 7), bad / "motion")
    write_manifest(bad / "motion")
    with pytest.raises(CheckpointError, match=r"motion/config.json: made for a decoder of width 7"):
        load_model(bad)
    (bad / "motion" / "config.json").write_text("[1, 2]")
    write_manifest(bad / "motion")
    with pytest.raises(CheckpointError, match=r"motion/config.json: not a motion network config"):
        load_model(bad)
    (bad / "motion" / "config.json").write_text("{")
    write_manifest(bad / "motion")
    with pytest.raises(CheckpointError, match=r"motion/config.json: unreadable motion network config"):
        load_model(bad)


def test_a_network_at_zero_and_a_one_set_question_answer_as_without_one(folders, tiny_model):
    plain, zero, lively = pipeline(tiny_model), pipeline(folders["zero"][0]), pipeline(folders["lively"][0])
    sets = moving_sets(4, seed=5)
    a, b = (p.answer(sets, QueryRequest(QUESTION, frames=4)) for p in (plain, zero))
    assert (a.token_ids, a.prompt_sha256) == (b.token_ids, b.prompt_sha256)
    one = [p.answer(sets[-1:], QueryRequest(QUESTION, frames=1)) for p in (plain, lively)]
    assert one[0].token_ids == one[1].token_ids


def test_the_newest_tokens_get_the_networks_output_of_the_flow_from_the_set_before(folders):
    folder, net = folders["lively"]
    pipe = pipeline(folder)
    rt = pipe.rt
    sets = tuple(moving_sets(3, seed=6))
    views = query_views(["CAM_FRONT", "CAM_BACK"], 3, 3)
    visual = [torch.randn(rt.tokens_per_camera, rt.cfg.llm.hidden_size) for _ in views]
    rt.motion_cache.flows.clear()
    shown = with_motion(rt, sets, views, visual)
    grid = int(round(rt.cfg.tokens_per_tile ** 0.5))
    for i, (cam, t) in enumerate(views):
        if t < 2:
            assert shown[i] is visual[i]            # older sets: as the vision stage made them
            continue
        # an independent recomputation: the two sets' tiles cut again, grey, flow, the saved network
        grey = []
        rt.motion_cache.flows.clear()
        for back in (t, t - 1):
            rt.motion_cache.tiles.clear()
            grey.append(grey_tiles_of(rt, sets, (cam, back)))
        ref = visual[i] + net(tiles_motion(grey[0], grey[1], grid))
        torch.testing.assert_close(shown[i], ref, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(shown[i], visual[i])
    # the grey tiles are the vision stage's uint8 tiles, grey
    pipe.rt.motion_cache.tiles.clear()
    tiles = grey_tiles_of(rt, sets, ("CAM_FRONT", 2))
    assert tiles[0].shape == (rt.cfg.force_image_size,) * 2
    assert (tiles[0] == grey_tile(rt.arena.pixels_u8[0])).all()


def test_a_question_over_time_answers_alike_twice_with_the_grey_tiles_kept_or_not(folders):
    pipe = pipeline(folders["lively"][0])
    sets = moving_sets(4, seed=7)
    first = pipe.answer(sets, QueryRequest(QUESTION, frames=4))
    again = pipe.answer(sets, QueryRequest(QUESTION, frames=4))          # features and grey tiles reused
    flows = len(pipe.rt.motion_cache.flows)
    pipe.rt.motion_cache.tiles.clear()
    pipe.rt.motion_cache.flows.clear()
    cut_again = pipe.answer(sets, QueryRequest(QUESTION, frames=4))      # grey tiles cut again, flow made again
    assert first.token_ids == again.token_ids == cut_again.token_ids
    assert again.reused_views == 24 and flows == 6          # one flow per camera, made once


def test_prefetched_frames_keep_their_grey_tiles(folders):
    """The node encodes a new frame set's cameras while idle (Pipeline.prefetch): their grey tiles
    are kept with the features, so the question that follows decodes nothing again."""
    pipe = pipeline(folders["lively"][0])
    sets = moving_sets(2, seed=8)
    pipe.rt.features.clear()
    for s in sets:
        pipe.prefetch(s.images, s.keys)
    assert len(pipe.rt.motion_cache.tiles) == 12
    cache, cut = pipe.rt.motion_cache, []
    put = cache.put
    cache.put = lambda *a: cut.append(a[:2]) or put(*a)          # every tile cut from here on
    ans = pipe.answer(sets, QueryRequest(QUESTION, frames=2))
    assert (ans.encoded_views, ans.reused_views) == (0, 12) and cut == []
