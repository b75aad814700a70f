"""Every load refuses a floating tensor that is not finite, naming the file and the tensor, in a
folder without a manifest (with one, the changed bytes are refused by the manifest first)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.weights.checkpoint import load_model
from litevlm_runtime.weights.finite import check_finite
from litevlm_runtime.weights.integrity import MANIFEST_FILE, integrity_label, require_manifest_error


def unverified_copy(tiny_model, tmp_path, poison=None):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_model, folder)
    for m in folder.rglob(MANIFEST_FILE):
        m.unlink()
    if poison is not None:
        state = load_file(folder / "model.safetensors")
        name, value = poison
        state[name].view(-1)[3] = value
        save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_weight_is_refused_naming_the_tensor(tiny_model, tmp_path, value):
    name = "language_model.model.layers.1.feed_forward.w2.weight"
    folder = unverified_copy(tiny_model, tmp_path, (name, value))
    assert integrity_label(folder) == "unverified (no manifest)"
    with pytest.raises(CheckpointError, match=rf"model.safetensors: tensor '{name}' is not finite \(.*first at index"):
        load_model(folder)


def test_finite_check_edges():
    check_finite("x", "big", torch.full((1000,), 3e38))          # the float32 sum overflows: the exact check passes it
    check_finite("x", "ints", torch.tensor([2 ** 62, 2 ** 62]))  # not floating
    check_finite("x", "empty", torch.empty(0))
    t = torch.zeros(4, 5, dtype=torch.bfloat16)
    t[2, 1] = float("nan")
    with pytest.raises(
        CheckpointError, match=r"'w' is not finite \(1 NaN, 0 inf of 20 values; first at index \(2, 1\)"
    ):
        check_finite("x", "w", t)
    t = torch.zeros(3)
    t[0], t[1] = float("inf"), float("-inf")                     # +inf + -inf: a NaN sum, still caught
    with pytest.raises(CheckpointError, match="0 NaN, 2 inf"):
        check_finite("x", "w", t)


def test_integrity_labels_and_the_require_manifest_command(tiny_model, tmp_path):
    assert integrity_label(tiny_model) == "verified (manifest)" and require_manifest_error(tiny_model) is None
    folder = unverified_copy(tiny_model, tmp_path)
    assert require_manifest_error(folder).endswith(f"then write the manifests with: litevlm checksum {folder}")
