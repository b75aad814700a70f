"""`litevlm train vlm`: packing is exact, a tiny run learns, and what it writes is what the pipeline runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from litevlm_runtime.cameras import CAMERAS
from litevlm_runtime.models.internvl import InternVL
from litevlm_runtime.pipeline.request import QueryRequest
from litevlm_runtime.stages.preprocess import Normalizer
from litevlm_runtime.training import packing, schedule, surgery, vlm, vlm_data
from litevlm_runtime.weights.presets import preset
from litevlm_runtime.weights.random_init import init_weights
from litevlm_runtime.weights.tokenizer import Tokenizer, train_bpe_tokenizer


@pytest.fixture(scope="module")
def synth_set(tmp_path_factory) -> Path:
    """Four SynthDrive scenes at 160x90 (seconds to render)."""
    from litevlm_runtime.synth.generate import SynthSpec, generate

    out = tmp_path_factory.mktemp("synth") / "set"
    generate(out, SynthSpec(4, seed=7, width=160, height=90, val_fraction=0.25), workers=1, progress=False)
    return out


def _reference_loss(model: InternVL, pixels: torch.Tensor, e: vlm_data.Encoded) -> torch.Tensor:
    """One sample on its own, as inference lays it out: prompt + answer, causal, positions 0..T-1;
    pixels holds one tile per camera of the prompt, in its order."""
    lm = model.language_model
    ids = torch.tensor(e.prompt + e.answer)
    t = len(ids)
    visual = model.encode_images(pixels)
    embeds = lm.embed(ids).clone()
    for cam, (start, count) in enumerate(e.spans):
        embeds[start:start + count] = visual[cam]
    hidden, _, _ = lm(embeds, torch.arange(t), torch.ones(t, t, dtype=torch.bool).tril())
    rows = torch.arange(len(e.prompt) - 1, t - 1)
    return F.cross_entropy(lm.head(hidden[rows]), ids[rows + 1], reduction="sum")


def _two_frames_tiny_float64_model(synth_set: Path, tmp_path: Path):
    """Two SynthDrive frames, a BPE tokenizer on their text and a random tiny model in float64."""
    frames = vlm_data.load_frames(synth_set / "train.json", synth_set)[:2]
    train_bpe_tokenizer([t for f in frames for qa in f.qa for t in (qa.question, qa.answer)], 600,
                        tmp_path / "tokenizer.json")
    tok = Tokenizer(tmp_path)
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    torch.manual_seed(0)
    model = InternVL(cfg, max_len=4096)
    init_weights(model, seed=3, std=0.05)
    model = model.double()
    return frames, tok, cfg, model


def test_packed_loss_equals_sum_of_separate_losses(synth_set, tmp_path):
    """Two frames x three questions packed as prefix trees in one sequence: the loss equals the
    sum of the six per-sample losses in float64 to 1e-10 relative (only summation order differs)."""
    frames, tok, cfg, model = _two_frames_tiny_float64_model(synth_set, tmp_path)
    picks = [[frames[0].qa[i] for i in (0, 5, 9)], [frames[1].qa[i] for i in (1, 2, 7)]]
    enc = [[vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, qa) for qa in qs] for qs in picks]
    pixels = torch.randn(2, len(CAMERAS), 3, cfg.force_image_size, cfg.force_image_size, dtype=torch.float64)

    batch = packing.pack([(0, enc[0]), (1, enc[1])])
    assert batch.samples == 6
    # The shared prefixes are really shared: the packed sequence is shorter than the six samples.
    assert len(batch.ids) < sum(len(e.prompt) + len(e.answer) for es in enc for e in es)
    packed = packing.PackedLoss(model)(pixels.flatten(0, 1), batch)
    separate = sum(_reference_loss(model, pixels[f], e) for f in range(2) for e in enc[f])
    assert torch.allclose(packed, separate, rtol=1e-10, atol=0), (packed.item(), separate.item())
    # Per-sample weighting: every QA's weights sum to 1.
    weighted = packing.pack([(0, enc[0]), (1, enc[1])], per_sample=True)
    assert torch.equal(weighted.target_rows, batch.target_rows)
    assert abs(float(weighted.weights.sum()) - 6) < 1e-12
    # ... and a wrong mask would show: letting branches see each other changes the loss.
    leaky = packing.pack([(0, enc[0]), (1, enc[1])])
    leaky.mask = leaky.mask | torch.ones_like(leaky.mask).tril()
    assert not torch.allclose(packing.PackedLoss(model)(pixels.flatten(0, 1), leaky), separate, rtol=1e-6)


def test_split_into_sequences_keeps_every_sample(synth_set, tmp_path):
    frames = vlm_data.load_frames(synth_set / "train.json", synth_set)
    tok_dir = tmp_path
    train_bpe_tokenizer([t for f in frames for qa in f.qa for t in (qa.question, qa.answer)], 500,
                        tok_dir / "tokenizer.json")
    tok = Tokenizer(tok_dir)
    cfg = preset("tiny", vocab_size=tok.vocab_size)
    groups = [(i, [vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, qa) for qa in f.qa[:10]])
              for i, f in enumerate(frames)]
    seqs = packing.split_into_sequences(groups, 400)
    packed = [packing.pack(s) for s in seqs]
    assert sum(b.samples for b in packed) == sum(len(items) for _, items in groups)
    # At most 400 tokens, unless one sample alone is longer (it is never dropped).
    assert all(len(b.ids) <= 400 or b.samples == 1 for b in packed)
    assert len(packed) > 1
    # Greedy and exact: where a frame's QA were split into several groups, the earlier group could
    # not have taken the next QA (its packed length would pass 400).
    pieces = [g for seq in seqs for g in seq]
    splits = [(f, a, b) for (f, a), (g, b) in zip(pieces, pieces[1:]) if f == g]
    assert splits
    assert all(len(packing.pack([(f, a + b[:1])]).ids) > 400 for f, a, b in splits)


def test_prefetch_keeps_order_and_raises_the_producers_error():
    def items():
        yield from range(5)
        raise ValueError("bad frame")

    it = vlm_data.prefetch(items(), depth=2)
    assert [next(it) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="bad frame"):
        next(it)


@pytest.fixture(scope="module")
def tiny_run(synth_set, tmp_path_factory):
    from litevlm_runtime.cli import build_parser

    out = tmp_path_factory.mktemp("vlm") / "model"
    args = build_parser().parse_args([
        "train", "vlm", "--data", str(synth_set / "train.json"), "--frames", str(synth_set),
        "--val", str(synth_set / "val.json"), "--out", str(out), "--preset", "tiny", "--vocab-size", "600",
        "--steps", "24", "--frames-per-step", "2", "--questions-per-frame", "8", "--lr", "3e-3",
        "--log-every", "4", "--eval-every", "24", "--eval-questions", "4", "--seed", "1", "--threads", "1"])
    record = vlm.train(args)
    return out, record


def test_tiny_training_run_reduces_loss_and_writes_record(tiny_run):
    out, record = tiny_run
    losses = [h["loss"] for h in record["history"] if "loss" in h]
    assert len(losses) == 6
    assert losses[-1] < 0.7 * losses[0], losses
    saved = json.loads((out / vlm.RECORD_FILE).read_text())
    assert saved["steps"] == 24 and saved["settings"]["seed"] == 1
    assert saved["data"]["generator"]["seed"] == 7          # the SynthDrive set's own settings
    assert saved["final"]["held_out"]["questions"] == 4
    assert saved["command"].startswith("litevlm train vlm --data ") and "--steps 24" in saved["command"]


def test_checkpoint_answers_through_pipeline_as_trained(tiny_run, synth_set):
    """The written folder loads with Pipeline.from_pretrained and answers; the pipeline's logits for
    the first answer token equal the training forward's on the same frame and question (same
    preprocessing, same prompt ids)."""
    from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions

    out, _ = tiny_run
    from litevlm_runtime.decoding.greedy import greedy

    # the folder records the layout its prompts were trained in, and the pipeline reads it there
    assert json.loads((out / "litevlm.json").read_text()) == {"prompt_layout": vlm_data.SCRATCH_LAYOUT}
    pipe = Pipeline.from_pretrained(out, PipelineOptions())
    rt = pipe.rt
    assert rt.prompt_layout == vlm_data.SCRATCH_LAYOUT
    frame = vlm_data.load_frames(synth_set / "val.json", synth_set)[0]
    qa = frame.qa[0]
    ans = pipe.answer(frame.images, QueryRequest(qa.question, max_new_tokens=12))
    assert isinstance(ans.text, str) and ans.visual_tokens == 6 * rt.tokens_per_camera
    assert ans.token_ids and ans.text.strip()
    # The first token's logits: the head over prefill's last feature.
    seen = {}

    def first_logits(rt_, q, prompt, max_new, on_tokens=None):
        seen["logits"] = rt_.engines.head.run(prompt.hidden[-1:])[0].clone()
        return greedy(rt_, q, prompt, max_new, on_tokens)

    first_only = pipe.answer(frame.images, QueryRequest(qa.question, max_new_tokens=1), decoder=first_logits)
    assert first_only.token_ids == ans.token_ids[:1]
    pipeline_logits = seen["logits"]
    ref_ids, ref_pixels = pipe.reference_inputs(frame.images, qa.question)

    model = rt.model
    tok = rt.tok
    e = vlm_data.encode_qa(tok, rt.cfg.system_message, rt.tokens_per_camera, qa)
    assert e.prompt == ref_ids[0].tolist()
    cache = vlm_data.TileCache([frame], rt.cfg.force_image_size)
    batch = packing.pack([(0, [e])])
    pixels = vlm_data.pixels_for(cache, [0], Normalizer(torch.float32, torch.device("cpu")))
    assert torch.equal(pixels, ref_pixels)
    with torch.inference_mode():
        lm = model.language_model
        lm.init_rope(4096)
        visual = model.encode_images(pixels)
        embeds = lm.embed(batch.ids).index_copy(0, batch.visual_rows, visual.reshape(-1, visual.shape[-1]))
        hidden, _, _ = lm(embeds, batch.positions, batch.mask)
        train_logits = lm.head(hidden[batch.target_rows[0]])
    assert torch.allclose(train_logits, pipeline_logits, atol=1e-4, rtol=1e-4)
    assert int(train_logits.argmax()) == ans.token_ids[0]


def test_selected_view_groups_train_the_prompts_the_selector_makes(synth_set, tmp_path):
    """split_by_views: QA sent to a camera subset are re-encoded with only those cameras (the
    prompt Pipeline.prompt_ids builds for them), grouped per subset, and their packed loss equals
    per-sample losses over exactly those cameras' tiles (float64, 1e-10 relative)."""
    import numpy as np

    frames, tok, cfg, model = _two_frames_tiny_float64_model(synth_set, tmp_path)
    # A stand-in selection rule (the rule itself is the view selector's business, tested there).
    subsets = [["CAM_FRONT"], ["CAM_FRONT_LEFT", "CAM_BACK"]]
    select = lambda q: subsets[len(q) % 2]  # noqa: E731
    encode = lambda qa, cams: vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, qa, cams)  # noqa: E731
    groups = [(f, [encode(qa, CAMERAS) for qa in frames[f].qa[:6]]) for f in range(2)]

    split = vlm_data.split_by_views(groups, select, 1.0, np.random.default_rng(0), encode)
    assert all(not isinstance(key, int) for key, _ in split)
    assert sum(len(items) for _, items in split) == 12
    for (f, cams), items in split:
        for e in items:
            assert [CAMERAS[c] for c in cams] == select(e.qa.question)
            assert len(e.spans) == len(cams)
            assert e.prompt.count(tok.img_context_id) == len(cams) * cfg.tokens_per_tile
    # fraction 0: nothing changes.
    assert vlm_data.split_by_views(groups, select, 0.0, np.random.default_rng(0), encode) == groups

    cache = vlm_data.TileCache(frames, cfg.force_image_size)
    f0, cams0 = split[0][0]
    assert torch.equal(cache.batch([(f0, cams0)]), cache.batch([f0])[list(cams0)])
    normalize = Normalizer(torch.float32, torch.device("cpu"))
    batch = packing.pack(split)
    packed = packing.PackedLoss(model)(vlm_data.pixels_for(cache, batch.frames, normalize).double(), batch)
    separate = sum(_reference_loss(model, vlm_data.pixels_for(cache, [key], normalize).double(), e)
                   for key, items in split for e in items)
    assert torch.allclose(packed, separate, rtol=1e-10, atol=0), (packed.item(), separate.item())


def test_vision_probe_adds_its_weighted_label_loss(synth_set, tmp_path):
    """With a probe, PackedLoss = answer loss + weight * (binary cross-entropy summed over labels and
    visual tokens) / tokens per tile, the latter recomputed by hand in float64."""
    from litevlm_runtime.training.vision_labels import LABELS, VisionProbe, load_vision_labels

    frames, tok, cfg, model = _two_frames_tiny_float64_model(synth_set, tmp_path)
    grid = int(round(cfg.tokens_per_tile ** 0.5))
    labels = load_vision_labels(synth_set / "ground_truth.json", [f.key.split("/")[-1] for f in frames], grid)
    assert labels.shape == (2, len(CAMERAS), grid * grid, len(LABELS)) and labels.sum() > 0
    probe = VisionProbe(model.mlp1[-1].out_features).double()
    torch.nn.init.normal_(probe.linear.weight, std=0.3)
    enc = [vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, frames[f].qa[0]) for f in range(2)]
    batch = packing.pack([(0, [enc[0]]), (1, [enc[1]])])
    pixels = vlm_data.pixels_for(vlm_data.TileCache(frames, cfg.force_image_size), batch.frames,
                            Normalizer(torch.float32, torch.device("cpu"))).double()
    y = labels.reshape(-1, len(LABELS)).double()
    plain = packing.PackedLoss(model)(pixels, batch)
    with_probe = packing.PackedLoss(model, probe, 0.3)(pixels, batch, labels.reshape(-1, len(LABELS)))
    with torch.no_grad():
        z = probe.linear(model.encode_images(pixels).reshape(-1, cfg.llm.hidden_size))
    sig = 1 / (1 + torch.exp(-z))
    bce = -(y * torch.log(sig) + (1 - y) * torch.log(1 - sig)).sum()
    expected = plain + 0.3 * bce / cfg.tokens_per_tile
    assert torch.allclose(with_probe, expected, rtol=1e-9, atol=0), (with_probe.item(), expected.item())


def test_training_with_selected_views_and_vision_labels_runs_end_to_end(synth_set, tmp_path):
    """The CLI path with both options: the probe's loss is logged apart from the answer loss, and
    the held-out check also runs through the view-selector pipeline. (That the probe learns is
    shown by the bundled model's stage-3 record, 0.52 -> 0.15; 12 tiny steps start at the prior.)"""
    from litevlm_runtime.bundled import DEFAULT_MODEL
    from litevlm_runtime.cli import build_parser

    args = build_parser().parse_args([
        "train", "vlm", "--data", str(synth_set / "train.json"), "--frames", str(synth_set),
        "--val", str(synth_set / "val.json"), "--out", str(tmp_path / "m"), "--preset", "tiny", "--vocab-size", "600",
        "--steps", "12", "--frames-per-step", "2", "--questions-per-frame", "8", "--lr", "3e-3",
        "--log-every", "4", "--eval-every", "12", "--eval-questions", "4", "--seed", "1", "--threads", "1",
        "--vision-labels", str(synth_set / "ground_truth.json"), "--vision-weight", "1.0",
        "--view-selector", str(DEFAULT_MODEL / "view_selector"), "--selected-views", "0.5"])
    record = vlm.train(args)
    probe = [h["probe_loss"] for h in record["history"] if "probe_loss" in h]
    assert len(probe) == 3 and all(0 < p < 100 for p in probe), probe
    held_out = record["final"]["held_out"]
    assert held_out["questions"] == 4 and held_out["selected_views"]["questions"] == 4
    assert "--view-selector" in record["command"] and "--vision-labels" in record["command"]
    # The probe is not part of the checkpoint: the folder holds the InternVL tensors only.
    from safetensors import safe_open
    with safe_open(str(tmp_path / "m" / "model.safetensors"), "pt") as f:
        assert not any("probe" in k for k in f.keys())


def test_training_step_keeps_every_tensor_on_the_model_device(synth_set, tmp_path):
    """The GPU path without a GPU: on torch's `meta` device (shapes only), a forward and backward
    through PackedLoss with pixels_for(..., device) and PackedBatch.to(device) runs, and leaving
    either input on the CPU is refused, as CUDA would refuse it."""
    frames, tok, cfg, model = _two_frames_tiny_float64_model(synth_set, tmp_path)
    enc = [[vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, qa) for qa in f.qa[:3]] for f in frames]
    batch = packing.pack([(0, enc[0]), (1, enc[1])], per_sample=True)
    cache = vlm_data.TileCache(frames, cfg.force_image_size)
    meta = torch.device("meta")
    model = model.float().to(meta)
    normalize = Normalizer(torch.float32, meta)
    loss = packing.PackedLoss(model)(vlm_data.pixels_for(cache, batch.frames, normalize, meta), batch.to(meta))
    loss.backward()
    assert loss.device == meta and all(p.grad is not None and p.grad.device == meta for p in model.parameters())
    with pytest.raises(RuntimeError, match="device"):
        packing.PackedLoss(model)(vlm_data.pixels_for(cache, batch.frames, normalize), batch.to(meta))
    with pytest.raises(RuntimeError, match="device"):
        packing.PackedLoss(model)(vlm_data.pixels_for(cache, batch.frames, normalize, meta), batch)


def test_bf16_autocast_loss_is_close_to_float32(synth_set, tmp_path):
    """The GPU trains under bf16 autocast with float32 weights; the same autocast on the CPU gives a
    loss within 2% of float32 (bf16 keeps 8 mantissa bits) and finite float32 gradients."""
    frames, tok, cfg, model = _two_frames_tiny_float64_model(synth_set, tmp_path)
    model = model.float()
    enc = [[vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, qa) for qa in f.qa[:3]] for f in frames]
    batch = packing.pack([(0, enc[0]), (1, enc[1])], per_sample=True)
    pixels = vlm_data.pixels_for(vlm_data.TileCache(frames, cfg.force_image_size), batch.frames,
                            Normalizer(torch.float32, torch.device("cpu")))
    exact = packing.PackedLoss(model)(pixels, batch)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = packing.PackedLoss(model)(pixels, batch)
    mixed.backward()
    assert mixed.dtype == torch.float32
    assert abs(mixed.item() - exact.item()) < 0.02 * exact.item(), (mixed.item(), exact.item())
    assert all(p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all() for p in model.parameters())


def test_decoding_all_frames_on_threads_equals_lazy_decoding(synth_set):
    frames = vlm_data.load_frames(synth_set / "train.json", synth_set)
    lazy = vlm_data.TileCache(frames, 112)
    ahead = vlm_data.TileCache(frames, 112)
    seen = []
    ahead.fill_all(3, lambda n, total: seen.append((n, total)))
    assert all(ahead.filled) and seen[-1] == (len(frames), len(frames))
    keys = list(range(len(frames))) + [(0, (1, 4))]
    assert torch.equal(lazy.batch(keys), ahead.batch(keys))


def test_learning_rate_over_a_time_budget_follows_the_step_schedule():
    total, warmup = 400, 20
    for step in (0, 10, 19, 20, 100, 250, 399):
        by_steps = schedule.learning_rate(step, total, 1e-3, warmup)
        by_time = schedule.learning_rate_at((step + 1) / total if step < warmup else step / total, 1e-3, warmup / total)
        assert abs(by_time - by_steps) < 0.01 * 1e-3, (step, by_time, by_steps)
    assert schedule.learning_rate_at(1.5, 1e-3, 0.05) == pytest.approx(1e-4)      # past the budget: the floor


def test_time_budget_run_stops_on_time_and_records_its_steps(synth_set, tmp_path):
    from litevlm_runtime.cli import build_parser

    args = build_parser().parse_args([
        "train", "vlm", "--data", str(synth_set / "train.json"), "--frames", str(synth_set),
        "--val", str(synth_set / "val.json"), "--out", str(tmp_path / "m"), "--preset", "tiny", "--vocab-size", "600",
        "--time-budget", "0.05", "--frames-per-step", "2", "--questions-per-frame", "4", "--log-every", "2",
        "--eval-every", "0", "--seed", "1", "--threads", "1", "--decode-threads", "2", "--device", "cpu"])
    record = vlm.train(args)
    assert record["steps"] >= 1 and record["device"] == "cpu" and record["precision"] == "float32"
    assert record["history"][-1]["step"] == record["steps"]
    # It stopped because the budget was spent (3 s), not before, and not long after one more step.
    assert record["final"]["train_seconds"] >= 3.0
    assert "--time-budget 0.05" in record["command"] and "--epochs" not in record["command"]
    assert (tmp_path / "m" / "model.safetensors").is_file()


@pytest.mark.parametrize("flags, message", [
    (["--selected-views", "1.5"], "--selected-views 1.5"),
    (["--tile-size", "126"], "--tile-size 126: must be a multiple of 28"),
    (["--precision", "bfloat16", "--device", "cpu"], "--precision bfloat16 is for GPUs"),
    (["--time-budget", "0"], "--time-budget 0"),
] + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "--device cuda: torch sees no CUDA GPU")]))
def test_flags_that_cannot_work_are_refused_before_anything_is_written(synth_set, tmp_path, flags, message):
    from litevlm_runtime.cli import build_parser
    from litevlm_runtime.errors import InputError

    args = build_parser().parse_args([
        "train", "vlm", "--data", str(synth_set / "train.json"), "--frames", str(synth_set),
        "--out", str(tmp_path / "m"), "--preset", "tiny", "--vocab-size", "600", "--steps", "1",
        "--threads", "1"] + flags)
    with pytest.raises(InputError, match=message):
        vlm.train(args)
    assert not (tmp_path / "m").exists()


def _continue_tiny_run(tiny_run, synth_set: Path, out: Path, *flags: str) -> dict:
    """Two steps of `train vlm --init <the tiny run>` with `flags`."""
    from litevlm_runtime.cli import build_parser

    args = build_parser().parse_args([
        "train", "vlm", "--data", str(synth_set / "train.json"), "--frames", str(synth_set),
        "--val", str(synth_set / "val.json"), "--out", str(out), "--preset", "tiny", "--init", str(tiny_run[0]),
        "--steps", "2", "--frames-per-step", "2", "--questions-per-frame", "4",
        "--eval-every", "0", "--seed", "1", "--threads", "1", *flags])
    return vlm.train(args)


def test_tile_size_fine_tune_interpolates_the_position_grid_and_runs_in_the_pipeline(tiny_run, synth_set, tmp_path):
    """--init a 112 px checkpoint with --tile-size 140: the vision tower keeps its 8x8 position grid
    (interpolated to 10x10 in every forward, as InternViT does), the saved config says tile 140,
    and the pipeline answers with 25 visual tokens per camera."""
    from litevlm_runtime.evaluation.data import load_frames
    from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
    from litevlm_runtime.weights.checkpoint import load_model

    out = tmp_path / "m140"
    record = _continue_tiny_run(tiny_run, synth_set, out, "--tile-size", "140")
    assert record["steps"] == 2
    model = load_model(out)
    assert model.cfg.force_image_size == 140 and model.cfg.vision.image_size == 112
    assert model.cfg.tokens_per_tile == 25
    assert model.vision_model.embeddings.position_embedding.shape[1] == 1 + 8 * 8
    frame = load_frames(synth_set / "val.json")[0]
    images = {cam: synth_set / p for cam, p in frame.image_paths.items()}
    answer = Pipeline.from_model(model, Tokenizer(out), PipelineOptions(max_new_tokens=4)).answer(
        images, frame.questions[0].question)
    assert answer.text is not None


def test_grown_decoder_computes_the_same_logits_then_trains_its_new_layers(synth_set, tmp_path):
    """grow_decoder 2 -> 5 layers (float64): the trained layers keep their order at the interleaved
    positions, the new ones start as identities, so the logits of the whole model (images and
    prompt) equal the original's to 1e-12; one optimizer step moves them (the new layers learn)."""
    frames, tok, cfg, model = _two_frames_tiny_float64_model(synth_set, tmp_path)
    e = vlm_data.encode_qa(tok, cfg.system_message, cfg.tokens_per_tile, frames[0].qa[0])
    pixels = torch.randn(len(CAMERAS), 3, cfg.force_image_size, cfg.force_image_size, dtype=torch.float64)
    batch = packing.pack([(0, [e])])

    def logits(m):
        lm = m.language_model
        visual = m.encode_images(pixels)
        embeds = lm.embed(batch.ids).index_copy(0, batch.visual_rows, visual.reshape(-1, visual.shape[-1]))
        hidden, _, _ = lm(embeds, batch.positions, batch.mask)     # a packed sequence on its own, as in training
        return lm.head(hidden)

    grown = surgery.grow_decoder(model, 5, seed=4)
    assert grown.cfg.llm.num_hidden_layers == 5 and grown.cfg.vision == model.cfg.vision
    assert surgery.grown_layer_positions(2, 5) == [0, 2] and surgery.grown_layer_positions(3, 12) == [0, 4, 8]
    old, new = model.language_model.layers, grown.language_model.layers
    for i, j in enumerate([0, 2]):
        assert all(torch.equal(a, b) for a, b in zip(old[i].state_dict().values(), new[j].state_dict().values()))
    for j in (1, 3, 4):
        assert not new[j].out_proj.weight.any() and not new[j].mlp_gate_up_down()[2].weight.any()
        assert new[j].qkv(torch.ones(1, cfg.llm.hidden_size, dtype=torch.float64))[0].abs().sum() > 0
    with torch.no_grad():
        before, after = logits(model), logits(grown)
    err = (after - before).abs().max() / before.abs().max()
    assert err < 1e-12, float(err)

    opt = torch.optim.SGD(grown.parameters(), lr=0.1)
    packing.PackedLoss(grown)(pixels, batch).backward()
    assert new[1].out_proj.weight.grad.abs().sum() > 0 and new[4].mlp_gate_up_down()[2].weight.grad.abs().sum() > 0
    opt.step()
    with torch.no_grad():
        assert (logits(grown) - before).abs().max() > 1e-6
    from litevlm_runtime.errors import InputError
    with pytest.raises(InputError, match="cannot remove trained ones"):
        surgery.grow_decoder(model, 1, seed=4)


def test_init_with_more_decoder_layers_grows_trains_and_saves_bf16(tiny_run, synth_set, tmp_path):
    """`train vlm --init DIR --decoder-layers 4 --save-dtype bfloat16` from the 2-layer tiny run: a
    4-layer checkpoint in bf16 safetensors, which loads as float32 and answers through the pipeline."""
    from safetensors import safe_open

    from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
    from litevlm_runtime.weights.checkpoint import load_model

    init, _ = tiny_run
    out = tmp_path / "deeper"
    record = _continue_tiny_run(tiny_run, synth_set, out, "--decoder-layers", "4", "--save-dtype", "bfloat16")
    assert record["steps"] == 2 and "--decoder-layers 4" in record["command"] and record["saved_dtype"] == "bfloat16"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = {name: f.get_tensor(name) for name in f.keys()}
    assert {t.dtype for t in stored.values()} == {torch.bfloat16}
    model = load_model(out)
    assert model.cfg.llm.num_hidden_layers == 4
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(t.float(), model.state_dict()[name]) for name, t in stored.items())
    original = load_model(init).language_model.layers
    # Layer 0 trained on (it moved), new layer 1 left the identity (its zeroed wo is no longer zero).
    assert not torch.equal(model.language_model.layers[0].attention.wqkv.weight, original[0].attention.wqkv.weight)
    assert model.language_model.layers[1].attention.wo.weight.abs().sum() > 0
    frame = vlm_data.load_frames(synth_set / "val.json", synth_set)[0]
    answer = Pipeline.from_pretrained(out, PipelineOptions(max_new_tokens=4)).answer(frame.images, frame.qa[0].question)
    assert answer.text is not None
