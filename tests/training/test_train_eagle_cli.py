"""`litevlm train eagle` as users run it: on one CPU, and unchanged under torchrun (DDP, gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(cmd, env_extra=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("ranks", [1, 2])
def test_train_eagle_cli(tiny_model, drivelm_dir, tmp_path, ranks):
    out = tmp_path / "eagle"
    args = ["-m", "litevlm_runtime.cli", "train", "eagle", "--model", str(tiny_model),
            "--data", str(drivelm_dir / "qa_scene_n008.json"), "--frames", str(drivelm_dir),
            "--samples", "8", "--holdout", "2", "--epochs", "1", "--max-new-tokens", "8", "--out", str(out),
            "--tree", "8,3,3"]
    if ranks == 1:
        proc = run([sys.executable, *args])
    else:
        proc = run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_port=29533", *args])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    record = json.loads((out / "config.json").read_text())
    assert record["world_size"] == ranks and record["samples"] == 8
    assert (out / "model.safetensors").is_file()
    assert "mean accepted length" in proc.stdout
