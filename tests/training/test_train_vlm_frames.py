"""`litevlm train vlm` on frame sets over time (issue 45 item 7): a motion QA is trained on the
prompt the pipeline builds for it (each camera's K frame sets), with temporal token selection as a
mask that equals dropping the rows at inference; --freeze-vision's cached tower output; the
grouping and share of QA over time; a run end to end."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.decoding.greedy import greedy
from litevlm_runtime.models.internvl import InternVL
from litevlm_runtime.pipeline.frame_sets import FrameSet
from litevlm_runtime.pipeline.pipeline import Pipeline, preprocess_images
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.stages.preprocess import Normalizer
from litevlm_runtime.training import packing, vlm, vlm_data
from litevlm_runtime.weights.checkpoint import write_checkpoint
from litevlm_runtime.weights.presets import preset
from litevlm_runtime.weights.random_init import init_weights
from litevlm_runtime.weights.tokenizer import Tokenizer, train_bpe_tokenizer

K = 4


@pytest.fixture(scope="module")
def motion_set(tmp_path_factory) -> Path:
    """Four SynthDrive scenes in motion, 4 frame sets 0.5 s apart, at 160x90."""
    from litevlm_runtime.synth.generate import SynthSpec, generate

    out = tmp_path_factory.mktemp("motion") / "set"
    generate(out, SynthSpec(4, seed=11, width=160, height=90, val_fraction=0.25, frames=K), workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def model_dir(motion_set, tmp_path_factory) -> Path:
    """A random tiny checkpoint with a tokenizer trained on the set's text."""
    folder = tmp_path_factory.mktemp("tiny-motion")
    frames = vlm_data.load_frames(motion_set / "train.json", motion_set)
    train_bpe_tokenizer([t for f in frames for qa in f.qa for t in (qa.question, qa.answer)], 600,
                        folder / "tokenizer.json")
    model = InternVL(preset("tiny", vocab_size=Tokenizer(folder).vocab_size))
    init_weights(model, seed=3, std=0.05)
    write_checkpoint(folder, model, folder / "tokenizer.json")
    return folder


def test_motion_frames_have_their_earlier_sets_and_tiles_in_prompt_order(motion_set, model_dir):
    frames = vlm_data.load_frames(motion_set / "train.json", motion_set)
    f = next(i for i, fr in enumerate(frames) if any(qa.frames == K for qa in fr.qa))
    assert len(frames[f].past) == K - 1 and all(set(s) == set(CAMERAS) for s in frames[f].past)
    assert {qa.frames for qa in frames[f].qa} == {1, K}
    pipe = Pipeline.from_pretrained(model_dir)
    cache = vlm_data.TileCache(frames, pipe.rt.cfg.force_image_size)
    cams = (1, 3)
    key = (f, cams, K)
    sets = frames[f].past + [frames[f].images]
    expected = [(CAMERAS[c], sets[t][CAMERAS[c]]) for c in cams for t in range(K)]   # camera by camera, oldest first
    with torch.inference_mode():      # (one vision call holds six tiles)
        pixels = torch.cat([preprocess_images(pipe.rt, expected[i:i + 4]).clone() for i in (0, 4)])
    got = vlm_data.pixels_for(cache, [key], Normalizer(torch.float32, torch.device("cpu")))
    assert torch.equal(got, pixels)
    assert cache.key_tiles([0, key]) == [0, 1, 2, 3, 4, 5, 6 + K - 1, 6 + 2 * K - 1]   # frame 0: one set of six


def test_packed_motion_sample_with_the_temporal_mask_equals_the_pipelines_logits(motion_set, model_dir):
    """The first answer token's logits of a K-frame QA: the training forward (every row present,
    unchanged older tokens masked out of attention) equals the pipeline's prefill (those rows
    dropped, kept rows at their positions), within float32 rounding; and some tokens were dropped."""
    frames = vlm_data.load_frames(motion_set / "train.json", motion_set)
    f = next(i for i, fr in enumerate(frames) if any(qa.frames == K for qa in fr.qa))
    qa = next(qa for qa in frames[f].qa if qa.frames == K)
    threshold = 0.05
    pipe = Pipeline.from_pretrained(model_dir, _options(threshold))
    rt = pipe.rt
    seen = {}

    def first_logits(rt_, q, prompt, max_new, on_tokens=None):
        seen["logits"] = rt_.engines.head.run(prompt.hidden[-1:])[0].clone()
        return greedy(rt_, q, prompt, max_new, on_tokens)

    sets = [FrameSet(s) for s in frames[f].past] + [FrameSet(frames[f].images)]
    ans = pipe.answer(sets, QueryRequest(qa.question, frames=K, max_new_tokens=1), decoder=first_logits)
    assert ans.frames == K
    e = vlm_data.encode_qa(rt.tok, rt.cfg.system_message, rt.tokens_per_camera, qa)
    assert e.frames == K and len(e.spans) == 6 * K
    batch = packing.pack([((f, vlm_data.ALL_CAMERAS, K), [e])])
    pixels = vlm_data.pixels_for(vlm_data.TileCache(frames, rt.cfg.force_image_size), batch.frames,
                                 Normalizer(torch.float32, torch.device("cpu")))
    loss = packing.PackedLoss(rt.model, change_threshold=threshold)
    with torch.inference_mode():
        lm = rt.model.language_model
        visual = rt.model.encode_images(pixels)
        embeds = lm.embed(batch.ids).index_copy(0, batch.visual_rows, visual.reshape(-1, visual.shape[-1]))
        hidden, _, _ = lm(embeds, batch.positions, loss.temporal_mask(batch, embeds))
        train_logits = lm.head(hidden[batch.target_rows[0]])
    dropped = loss.last_dropped
    assert 0 < dropped < 6 * (K - 1) * rt.tokens_per_camera
    assert sum(ans.kept_per_frame[:-1]) == 6 * (K - 1) * rt.tokens_per_camera - dropped
    assert torch.allclose(train_logits, seen["logits"], atol=1e-4, rtol=1e-4)
    # --freeze-vision: the rows decided on the cached features and left out of the sequence
    features = vlm_data.VisionFeatureCache(vlm_data.TileCache(frames, rt.cfg.force_image_size), rt.model,
                                           Normalizer(torch.float32, torch.device("cpu")), torch.device("cpu"))
    groups = [((f, vlm_data.ALL_CAMERAS, K), [e])]
    gone = features.dropped(groups, threshold)
    assert len(gone[0]) == dropped
    short = packing.pack(groups, dropped=gone)
    assert len(short.ids) == len(batch.ids) - dropped
    frozen = packing.PackedLoss(rt.model, change_threshold=threshold, frozen_vision=True)
    with torch.inference_mode():
        visual = features.batch(short.frames)
        flat = visual.reshape(-1, visual.shape[-1])[short.visual_index]
        embeds = lm.embed(short.ids).index_copy(0, short.visual_rows, flat)
        hidden, _, _ = lm(embeds, short.positions, frozen.temporal_mask(short, embeds))
        short_logits = lm.head(hidden[short.target_rows[0]])
    assert torch.allclose(short_logits, seen["logits"], atol=1e-4, rtol=1e-4)
    # threshold 0: every row, the unmasked packed forward
    loss0 = packing.PackedLoss(rt.model, change_threshold=0.0)
    assert loss0.temporal_mask(batch, embeds) is batch.mask


def _options(threshold: float):
    from helpers import options

    return options(pipeline="baseline", max_new_tokens=1, temporal__mode="all",
                   temporal__change_threshold=threshold)


def test_motion_qa_get_groups_of_their_own_on_the_selected_cameras(motion_set, model_dir):
    frames = vlm_data.load_frames(motion_set / "train.json", motion_set)
    tok = Tokenizer(model_dir)
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    encode = lambda qa, cams=CAMERAS: vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, qa, cams)  # noqa: E731
    f = next(i for i, fr in enumerate(frames) if any(qa.frames == K for qa in fr.qa))
    groups = [(f, [encode(qa) for qa in frames[f].qa])]
    select = lambda q: ["CAM_FRONT"] if "front" in q else ["CAM_BACK", "CAM_BACK_LEFT"]  # noqa: E731
    split = vlm_data.split_by_views(groups, select, 0.0, np.random.default_rng(0), encode)
    timed = [(key, items) for key, items in split if vlm_data.group_of(key)[2] == K]
    assert timed and all(e.frames == K for _, items in timed for e in items)
    for key, items in timed:
        _, cams, _ = vlm_data.group_of(key)
        assert all([CAMERAS[c] for c in cams] == select(e.qa.question) for e in items)
        assert all(len(e.spans) == len(cams) * K for e in items)
        packing.pack([(key, items)])                 # (one shared prefix holds every visual token)
    still = [items for key, items in split if vlm_data.group_of(key)[2] == 1]
    assert sum(len(i) for i in still) == sum(qa.frames == 1 for qa in frames[f].qa)
    # without a view selector a motion QA keeps all six cameras, still in a group of its own
    split = vlm_data.split_by_views(groups, None, 0.0, np.random.default_rng(0), encode)
    assert {vlm_data.group_of(k)[1:] for k, _ in split} == {(vlm_data.ALL_CAMERAS, 1), (vlm_data.ALL_CAMERAS, K)}


def test_time_share_of_a_visit(motion_set, model_dir):
    frames = vlm_data.load_frames(motion_set / "train.json", motion_set)
    tok = Tokenizer(model_dir)
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    encoded = [[vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, qa) for qa in f.qa] for f in frames]
    groups = vlm_data.epoch_groups(encoded, 100, np.random.default_rng(0), per_visit=8, time_share=0.75)
    for f, items in groups:
        timed = sum(e.frames > 1 for e in items)
        assert len(items) == 8 and timed == min(6, sum(e.frames > 1 for e in encoded[f]))


def test_frozen_vision_features_equal_the_towers_output(motion_set, model_dir):
    """--freeze-vision: the cached visual tokens are those the pixels give, in the same order."""
    frames = vlm_data.load_frames(motion_set / "train.json", motion_set)
    pipe = Pipeline.from_pretrained(model_dir)
    model = pipe.rt.model
    normalize = Normalizer(torch.float32, torch.device("cpu"))
    tiles = vlm_data.TileCache(frames, pipe.rt.cfg.force_image_size)
    features = vlm_data.VisionFeatureCache(tiles, model, normalize, torch.device("cpu"))
    keys = [0, (1, (2, 4), K)]
    with torch.inference_mode():
        direct = model.encode_images(vlm_data.pixels_for(tiles, keys, normalize))
        cached = features.batch(keys)
    assert cached.shape == direct.shape
    assert torch.allclose(cached, direct, atol=1e-5, rtol=1e-5)
    assert len(features.store) == 1 + K


def test_a_training_run_over_time_with_a_frozen_tower(motion_set, model_dir, tmp_path):
    """`train vlm --init --freeze-vision --time-share` runs, leaves the tower as --init had it,
    and checks held-out accuracy with motion questions asked over their frame sets."""
    from litevlm_runtime.cli import build_parser
    from litevlm_runtime.weights.checkpoint import load_model

    out = tmp_path / "model"
    args = build_parser().parse_args([
        "train", "vlm", "--data", str(motion_set / "train.json"), "--frames", str(motion_set),
        "--val", str(motion_set / "val.json"), "--out", str(out), "--preset", "tiny", "--init", str(model_dir),
        "--steps", "3", "--frames-per-step", "2", "--questions-per-frame", "8", "--questions-per-visit", "8",
        "--time-share", "0.5", "--freeze-vision", "--max-sequence-tokens", "2048", "--lr", "3e-3",
        "--log-every", "1", "--eval-every", "3", "--eval-questions", "8", "--seed", "1", "--threads", "1"])
    record = vlm.train(args)
    assert record["steps"] == 3 and "--freeze-vision" in record["command"] and "--time-share 0.5" in record["command"]
    held = record["final"]["held_out"]
    assert held["questions"] == 8
    assert set(held["by_category"]) <= {"perception", "prediction", "planning", "behavior", "motion", "motion@1"}
    before, after = dict(load_model(model_dir).named_parameters()), dict(load_model(out).named_parameters())
    frozen = [n for n in before if n.startswith(("vision_model.", "mlp1."))]
    assert all(torch.equal(before[n], after[n]) for n in frozen)
    assert not all(torch.equal(before[n], after[n]) for n in before if n.startswith("language_model."))


def test_training_gives_the_motion_network_what_the_pipeline_gives_it(motion_set, model_dir, tmp_path):
    """A model with a motion network (stages/motion.py): the training forward's first answer logits
    of a K-frame QA, the network's output added to the newest set's tiles that _StepInputs.motion
    names, equal the pipeline's (which adds it in pipeline.with_motion), within float32 rounding."""
    import shutil

    from litevlm_runtime.models.motion import MotionTokens
    from litevlm_runtime.weights.checkpoint import save_motion
    from litevlm_runtime.weights.integrity import write_manifest

    folder = tmp_path / "with-motion"
    shutil.copytree(model_dir, folder)
    torch.manual_seed(2)
    net = MotionTokens(8, preset("tiny").llm.hidden_size)
    torch.nn.init.normal_(net.net[2].weight, std=0.5)
    save_motion(net, folder / "motion")
    write_manifest(folder / "motion")
    frames = vlm_data.load_frames(motion_set / "train.json", motion_set)
    f = next(i for i, fr in enumerate(frames) if any(qa.frames == K for qa in fr.qa))
    qa = next(qa for qa in frames[f].qa if qa.frames == K)
    pipe = Pipeline.from_pretrained(folder, _options(0.0))
    rt, seen = pipe.rt, {}

    def first_logits(rt_, q, prompt, max_new, on_tokens=None):
        seen["logits"] = rt_.engines.head.run(prompt.hidden[-1:])[0].clone()
        return greedy(rt_, q, prompt, max_new, on_tokens)

    sets = [FrameSet(s) for s in frames[f].past] + [FrameSet(frames[f].images)]
    pipe.answer(sets, QueryRequest(qa.question, frames=K, max_new_tokens=1), decoder=first_logits)
    e = vlm_data.encode_qa(rt.tok, rt.cfg.system_message, rt.tokens_per_camera, qa)
    cams = (0, 2)
    still = next(q for q in frames[f].qa if q.frames == 1)          # a one-set group first: the tiles' offsets
    batch = packing.pack([(f, [vlm_data.encode_qa(rt.tok, rt.cfg.system_message, rt.tokens_per_camera, still)]),
                          ((f, vlm_data.ALL_CAMERAS, K), [e])])
    cache = vlm_data.TileCache(frames, rt.cfg.force_image_size)
    inputs = vlm._StepInputs(cache, torch.device("cpu"))
    inputs.motion_grid = int(round(rt.cfg.tokens_per_tile ** 0.5))
    tiles, flow = inputs.motion(batch.frames)
    assert tiles.tolist() == [6 + c * K + K - 1 for c in range(6)]       # after frame f's one set of six
    assert inputs.motion([(f, cams, 1)]) is None
    pixels = vlm_data.pixels_for(cache, batch.frames, Normalizer(torch.float32, torch.device("cpu")))
    with torch.inference_mode():
        lm = rt.model.language_model
        visual = rt.model.encode_images(pixels)
        visual = visual.index_add(0, tiles, rt.model.motion(flow))
        embeds = lm.embed(batch.ids).index_copy(0, batch.visual_rows, visual.reshape(-1, visual.shape[-1]))
        hidden, _, _ = lm(embeds, batch.positions, batch.mask)
        second = batch.target_rows[batch.target_rows > batch.visual_rows[6 * rt.tokens_per_camera]][0]
        train_logits = lm.head(hidden[second])          # the K-frame QA's first answer token
    assert torch.allclose(train_logits, seen["logits"], atol=1e-4, rtol=1e-4)


def test_a_training_run_with_a_motion_network(motion_set, model_dir, tmp_path):
    """`train vlm --motion 8` adds the network (zero at the start), trains it with the decoder and
    writes it in the output's motion/, which loads."""
    from litevlm_runtime.cli import build_parser
    from litevlm_runtime.weights.checkpoint import load_model

    out = tmp_path / "model"
    args = build_parser().parse_args([
        "train", "vlm", "--data", str(motion_set / "train.json"), "--frames", str(motion_set),
        "--out", str(out), "--preset", "tiny", "--init", str(model_dir), "--motion", "8",
        "--steps", "3", "--frames-per-step", "2", "--questions-per-frame", "8", "--questions-per-visit", "8",
        "--time-share", "1.0", "--freeze-vision", "--max-sequence-tokens", "4096", "--lr", "3e-3",
        "--log-every", "1", "--seed", "1", "--threads", "1"])
    record = vlm.train(args)
    assert record["steps"] == 3 and "--motion 8" in record["command"]
    net = load_model(out).motion
    assert net is not None and net.net[0].out_features == 8
    assert net.net[2].weight.abs().sum() > 0          # it trained from zero


def test_the_motion_network_learns_at_its_own_rate():
    """--motion-lr-scale: the motion network's parameters are a group of their own whose rate is
    that multiple of the schedule's (the training loop sets lr x lr_scale on every group)."""
    import argparse

    from litevlm_runtime.models.motion import MotionTokens

    model = InternVL(preset("tiny"))
    model.motion = MotionTokens(8, model.cfg.llm.hidden_size)
    opt = vlm._optimizer(argparse.Namespace(lr=1e-3, weight_decay=0.1, motion_lr_scale=10.0), model, None)
    scaled = [g for g in opt.param_groups if g.get("lr_scale", 1.0) != 1.0]
    assert len(scaled) == 1 and scaled[0]["lr_scale"] == 10.0
    assert {id(p) for p in scaled[0]["params"]} == {id(p) for p in model.motion.parameters()}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(list(model.parameters()))
