"""Model-folder integrity: the sha256 manifest written with every checkpoint, verified on load,
once per file version thanks to the digest cache; `litevlm checksum` for folders from elsewhere."""

import json
import logging
import os
import shutil

import pytest
import torch

from litevlm_runtime.bundled import DEFAULT_MODEL
from litevlm_runtime.cli import main
from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
from litevlm_runtime.weights import integrity
from litevlm_runtime.weights.checkpoint import load_model
from litevlm_runtime.weights.integrity import (
    MANIFEST_FILE,
    model_folders,
    verify_model_folder,
    write_manifest,
    write_manifests,
)

DIGEST = "[0-9a-f]{64}"


@pytest.fixture
def folder(tmp_path, tiny_model):
    return shutil.copytree(tiny_model, tmp_path / "model")


def xor_middle(path, n=4096):
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        block = f.read(n)
        f.seek(size // 2)
        f.write(bytes(b ^ 0xFF for b in block))


def count_hashing(monkeypatch) -> list:
    calls = []
    real = integrity.sha256_file
    monkeypatch.setattr(integrity, "sha256_file", lambda p: calls.append(os.path.basename(p)) or real(p))
    return calls


def test_checkpoints_carry_a_manifest_of_every_load_input(folder):
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    assert manifest["format"] == integrity.FORMAT
    assert sorted(manifest["files"]) == ["config.json", "generation_config.json", "model.safetensors",
                                         "tokenizer.json", "tokenizer_config.json"]
    for name, entry in manifest["files"].items():
        assert entry == {"sha256": integrity.sha256_file(folder / name), "size": (folder / name).stat().st_size}
    assert verify_model_folder(folder) is True


def test_xor_in_the_middle_of_the_weights_is_refused_naming_the_file(folder, monkeypatch):
    """Issue 14 item 3: 4 KiB XORed in the middle of model.safetensors was served. Here the first load
    caches the digests (racy window off), so the refusal also proves the cache notices the write."""
    monkeypatch.setattr(integrity, "RACY_WINDOW_NS", 0)
    load_model(folder)
    weights = folder / "model.safetensors"
    recorded = json.loads((folder / MANIFEST_FILE).read_text())["files"]["model.safetensors"]["sha256"]
    before = os.stat(weights)
    xor_middle(weights)
    assert (os.stat(weights).st_mtime_ns, os.stat(weights).st_ctime_ns) != (before.st_mtime_ns, before.st_ctime_ns)
    pattern = rf"{weights}: sha256 {DIGEST} does not match {recorded} recorded in .*{MANIFEST_FILE}"
    with pytest.raises(CheckpointError, match=pattern):
        load_model(folder)
    with pytest.raises(CheckpointError, match=pattern):     # the node's load path gets it too
        Pipeline.from_pretrained(folder, PipelineOptions())


def test_folder_without_manifest_loads_with_exactly_one_warning(folder, caplog):
    (folder / MANIFEST_FILE).unlink()
    with caplog.at_level(logging.WARNING):
        pipe = Pipeline.from_pretrained(folder, PipelineOptions(max_new_tokens=2))
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert warnings[0].name == "litevlm_runtime.weights.integrity"
    assert f"{folder}: no {MANIFEST_FILE}" in warnings[0].getMessage()
    assert f"litevlm checksum {folder}" in warnings[0].getMessage()
    assert pipe.rt.cfg.llm.hidden_size == 128


def test_manifest_refuses_missing_unlisted_and_truncated_files(folder):
    (folder / "tokenizer.model").write_bytes(b"a second tokenizer nobody hashed")
    with pytest.raises(CheckpointError, match=rf"{folder / 'tokenizer.model'}: not listed in .*{MANIFEST_FILE}"):
        verify_model_folder(folder)
    (folder / "tokenizer.model").unlink()
    (folder / "MODEL_CARD.md").write_text("not a load input: may change freely\n")
    assert verify_model_folder(folder)
    data = (folder / "tokenizer.json").read_bytes()
    (folder / "tokenizer.json").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=rf"tokenizer.json: {len(data) // 2} bytes, .* records {len(data)}"):
        verify_model_folder(folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match=r"tokenizer.json: missing \(listed in"):
        verify_model_folder(folder)
    (folder / MANIFEST_FILE).write_text('{"format": "litevlm-manifest/1", "files": {"../config.json": {}}}')
    with pytest.raises(CheckpointError, match=r"'../config.json' is not a file name in this folder"):
        verify_model_folder(folder)
    (folder / MANIFEST_FILE).write_text("{trunc")
    with pytest.raises(CheckpointError, match=rf"{MANIFEST_FILE}: unreadable manifest"):
        verify_model_folder(folder)


def test_digest_cache_verifies_once_per_file_version(folder, monkeypatch, tmp_path):
    monkeypatch.setenv("LITEVLM_CACHE", str(tmp_path / "cache"))
    calls = count_hashing(monkeypatch)
    # Files changed within the racy window are never cached: a write in the same timestamp tick
    # would otherwise hide behind an unchanged stat.
    monkeypatch.setattr(integrity, "RACY_WINDOW_NS", 10**18)
    verify_model_folder(folder)
    verify_model_folder(folder)
    assert calls.count("model.safetensors") == 2
    monkeypatch.setattr(integrity, "RACY_WINDOW_NS", 0)
    calls.clear()
    verify_model_folder(folder)
    assert len(calls) == 5 and (tmp_path / "cache" / "file_digests.sqlite3").is_file()
    calls.clear()
    verify_model_folder(folder)                      # a restart: stat + lookup, no hashing
    assert calls == []
    os.utime(folder / "config.json")                 # a new version of one file: only it is rehashed
    verify_model_folder(folder)
    assert calls == ["config.json"]
    calls.clear()
    verify_model_folder(folder, use_cache=False)     # `checksum --verify`: everything
    assert len(calls) == 5


def test_checksum_command_writes_manifests_that_verify(folder, capsys):
    from litevlm_runtime.models.eagle import DraftHead
    from litevlm_runtime.weights.draft_head import save_draft_head

    (folder / MANIFEST_FILE).unlink()
    save_draft_head(DraftHead(load_model(folder).cfg.llm, 64), folder / "eagle", {"test": True})
    assert main(["checksum", str(folder)]) == 0
    assert f"wrote {folder / 'eagle' / MANIFEST_FILE}" in capsys.readouterr().out
    assert [verify_model_folder(f) for f in model_folders(folder)] == [True, True]
    assert main(["checksum", str(folder), "--verify"]) == 0
    # Retraining a module rewrites its own manifest only.
    top = (folder / MANIFEST_FILE).read_bytes()
    save_draft_head(DraftHead(load_model(folder).cfg.llm, 64), folder / "eagle", {"test": "again"})
    with pytest.raises(CheckpointError, match=r"eagle/config.json: .*(bytes|sha256)"):
        verify_model_folder(folder / "eagle")
    write_manifest(folder / "eagle")
    assert (folder / MANIFEST_FILE).read_bytes() == top and verify_model_folder(folder / "eagle")
    xor_middle(folder / "eagle" / "model.safetensors")
    capsys.readouterr()
    assert main(["checksum", str(folder), "--verify"]) == 2
    assert f"{folder / 'eagle' / 'model.safetensors'}: sha256" in capsys.readouterr().err


def test_module_loaders_verify_their_folder(folder):
    from litevlm_runtime.models.eagle import DraftHead
    from litevlm_runtime.weights.draft_head import load_draft_head, save_draft_head

    cfg = load_model(folder).cfg.llm
    save_draft_head(DraftHead(cfg, 64), folder / "eagle", {})
    write_manifests(folder)
    assert isinstance(load_draft_head(folder / "eagle", cfg, 64, torch.float32), DraftHead)
    xor_middle(folder / "eagle" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"eagle/model.safetensors: sha256"):
        load_draft_head(folder / "eagle", cfg, 64, torch.float32)


def test_bundled_model_manifests_are_current():
    """Whoever retrains the bundled model reruns `litevlm checksum litevlm_runtime/bundled/<name>`."""
    folders = model_folders(DEFAULT_MODEL)
    assert [f.name for f in folders[1:]] == ["view_selector", "token_selector", "eagle"]
    assert all(verify_model_folder(f, use_cache=False) for f in folders)


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no_manifest"])
def test_a_symlink_loop_or_a_broken_link_is_said_not_called_missing(folder, manifest):
    """Issue 42: a symlink loop in a model folder was reported as "missing" (Path.is_file() is False for
    both); now the error names the loop, or the broken link and its target."""
    if not manifest:
        (folder / MANIFEST_FILE).unlink()
    shard = folder / "model.safetensors"
    shard.unlink()
    shard.symlink_to("model.safetensors.a")
    (folder / "model.safetensors.a").symlink_to("model.safetensors")
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert "model.safetensors: a symlink loop (model.safetensors -> model.safetensors.a" in str(e.value), str(e.value)
    (folder / "model.safetensors.a").unlink()
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert "a broken symlink (to model.safetensors.a, which does not exist)" in str(e.value), str(e.value)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to("config.json")
    with pytest.raises(CheckpointError) as e:
        load_model(folder)
    assert "config.json: a symlink loop" in str(e.value) and "missing" not in str(e.value), str(e.value)
