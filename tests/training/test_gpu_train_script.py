"""scripts/gpu_train.sh, the one-call GPU training run, kept working: here it runs on the CPU at
toy size (the same commands, --device auto falls back to the CPU) and leaves a loadable model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow      # renders and trains; run before a GPU session
def test_gpu_train_script_renders_trains_and_writes_a_loadable_model(tmp_path):
    from litevlm_runtime.weights.checkpoint import load_model

    env = dict(os.environ, PYTHON=sys.executable, SCENES="6", VAL_FRACTION="0.2", MINUTES="0.03", PRESET="tiny",
               DECODER_LAYERS="3", SIZES="160x90,224x126", FRAMES_PER_STEP="2", OUT_DIR=str(tmp_path / "out"),
               DATA=str(tmp_path / "data"), TRANSFER_DIR=str(tmp_path / "transfer"), OMP_NUM_THREADS="1")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_train.sh")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    record = json.loads((tmp_path / "out" / "model" / "training_record.json").read_text())
    assert record["settings"]["time_budget"] == 0.03 and record["steps"] >= 1
    assert record["data"]["generator"]["seed"] == 2027        # not the bundled model's evaluation seed
    assert record["data"]["generator"]["sizes"] == ["160x90", "224x126"]     # mixed resolutions
    assert "--vision-labels" in record["command"] and "--view-selector" in record["command"]
    assert "bundled/synthdrive-internvl2_5-v2/view_selector" in record["command"]
    model = load_model(tmp_path / "out" / "model")
    assert model.cfg.force_image_size == 112                  # the tiny preset, as asked ...
    assert model.cfg.llm.num_hidden_layers == 3               # ... at the depth asked
    assert "[gpu_train] done" in (tmp_path / "out" / "train.log").read_text()
    # What a device call brings back: tar parts of at most 15 MiB that unpack to the same folder.
    parts = sorted((tmp_path / "transfer").glob("model.tar.part-*"))
    assert parts and all(p.stat().st_size <= 15 * 2**20 for p in parts)
    (tmp_path / "back").mkdir()
    subprocess.run(f"cat {' '.join(map(str, parts))} | tar -xf - -C {tmp_path / 'back'}", shell=True, check=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "training_record.json"):
        assert (tmp_path / "back" / "model" / name).read_bytes() == (tmp_path / "out" / "model" / name).read_bytes()
