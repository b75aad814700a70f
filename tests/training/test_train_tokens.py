"""`litevlm train tokens` on a small SynthDrive set: the loss falls, the trained selector ranks the
held-out visual tokens closer to the teacher than the untrained layer-0 copy, what it writes loads
into the pipeline; and the same command runs unchanged under torchrun with 2 gloo ranks (about 30 s)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import make_tiny_checkpoint, random_frames

from litevlm_runtime.cli import main
from litevlm_runtime.options import Tokens
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
from litevlm_runtime.stages.token_selector import kept_count, load_token_selector
from litevlm_runtime.weights.checkpoint import load_model, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    from litevlm_runtime.synth.generate import SynthSpec, generate

    out = tmp_path_factory.mktemp("synth_tokens")
    generate(out, SynthSpec(scenes=6, seed=3, width=160, height=90, val_fraction=0.0), workers=1, progress=False)
    return out


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    """The tiny checkpoint with its attention projections scaled up, so that every layer attends
    selectively (a random tiny model attends almost uniformly: nothing to rank)."""
    base = make_tiny_checkpoint(tmp_path_factory.mktemp("base") / "tiny")
    model = load_model(base)
    with torch.no_grad():
        for layer in model.language_model.layers:
            layer.attention.wqkv.weight.mul_(5.0)
    out = tmp_path_factory.mktemp("teacher") / "tiny-selective"
    write_checkpoint(out, model, base / "tokenizer.json")
    return out


def args_for(model: Path, synth: Path, out: Path, steps: int = 30) -> list[str]:
    return ["train", "tokens", "--model", str(model), "--data", str(synth / "train.json"), "--frames", str(synth),
            "--out", str(out), "--steps", str(steps), "--batch", "2", "--lr", "3e-3", "--max-samples", "16",
            "--eval-samples", "8", "--eval-questions", "2", "--max-new-tokens", "4", "--log-every", "5",
            "--threads", "1"]


def test_training_lowers_loss_and_beats_the_untrained_copy(teacher, synth, tmp_path, capsys):
    out = tmp_path / "token_selector"
    threads = torch.get_num_threads()
    try:
        assert main(args_for(teacher, synth, out)) == 0
    finally:
        torch.set_num_threads(threads)     # --threads 1 is process-wide; later tests get theirs back
    record = json.loads((out / "config.json").read_text())
    assert record["architecture"] == "litevlm_token_selector" and record["settings"]["steps"] == 30
    losses = [h["loss"] for h in record["history"]]
    assert losses[-1] < 0.7 * losses[0], losses
    before, after = record["metrics"]["untrained"], record["metrics"]["trained"]
    assert after["kl"] < before["kl"]
    assert after["recall@0.8"] > before["recall@0.8"]
    pipeline = record["metrics"]["pipeline"]
    assert pipeline["questions"] == 2 and 0 <= pipeline["trained"]["identical_answers"] <= 1
    assert "trained: held-out KL" in capsys.readouterr().out

    # What it wrote is a selector the pipeline loads and runs, and it differs from layer 0.
    p = Pipeline.from_pretrained(teacher, PipelineOptions(
        max_new_tokens=3, tokens=Tokens(mode="selector", keep_ratio=0.8, selector_dir=str(out))))
    rt = p.rt
    assert not torch.equal(rt.token_selector.layer.attention.wqkv.weight, rt.lm.layers[0].attention.wqkv.weight)
    ans = p.answer(random_frames(2), "What is behind the ego car?")
    assert ans.kept_tokens == 6 * kept_count(rt.tokens_per_camera, 0.8)
    assert load_token_selector(out, rt.lm).reduce == "max"


def test_bad_selector_folder_is_a_named_error(teacher, tmp_path):
    from litevlm_runtime.errors import InputError

    with pytest.raises(InputError, match="tokens.mode selector: no model.safetensors in"):
        Pipeline.from_pretrained(teacher, PipelineOptions(tokens=Tokens(mode="selector", keep_ratio=0.5,
                                                                        selector_dir=str(tmp_path))))


def test_torchrun_two_ranks(teacher, synth, tmp_path):
    """The same command under torchrun (gloo on the CPU, 2 processes)."""
    out = tmp_path / "ddp_selector"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "litevlm_runtime.cli"] + args_for(teacher, synth, out, steps=10)
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    record = json.loads((out / "config.json").read_text())
    assert record["world_size"] == 2
    assert record["history"] and all(h["loss"] > 0 for h in record["history"])
    assert "world size 2" in run.stdout
