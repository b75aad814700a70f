"""Checkpoint folders: round trips (single and sharded) and errors that name the file and tensor."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from litevlm_runtime.checkpoint import load_model, read_config
from litevlm_runtime.commands.make_checkpoint import make_checkpoint
from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.integrity import MANIFEST_FILE, write_manifest
from litevlm_runtime.tokenizer import IMG_CONTEXT, Tokenizer


def test_round_trip_single_and_sharded(tmp_path, tiny_model):
    sharded = make_checkpoint(tmp_path / "sharded", "tiny", seed=0, shard_bytes=300_000)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*-of-*.safetensors"))) > 2
    a, b = load_model(tiny_model), load_model(sharded)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    # upstream names, exactly
    names = set(load_file(tiny_model / "model.safetensors"))
    for n in ("vision_model.embeddings.class_embedding", "vision_model.encoder.layers.0.attn.qkv.weight",
              "vision_model.encoder.layers.1.ls2", "mlp1.0.weight", "mlp1.3.bias",
              "language_model.model.tok_embeddings.weight", "language_model.model.layers.1.attention.wqkv.weight",
              "language_model.model.layers.0.feed_forward.w3.weight", "language_model.output.weight"):
        assert n in names, n


def test_qwen2_checkpoint_loads(tmp_path):
    from litevlm_runtime.checkpoint import write_checkpoint
    from litevlm_runtime.models.internvl import InternVL
    from litevlm_runtime.presets import preset

    cfg = preset("tiny", vocab_size=300)
    cfg.llm.architecture = "qwen2"
    write_checkpoint(tmp_path / "q", InternVL(cfg))
    m = load_model(tmp_path / "q")
    assert "language_model.model.layers.0.self_attn.q_proj.bias" in m.state_dict()
    assert read_config(tmp_path / "q").llm.architecture == "qwen2"


def test_tokenizer_specials(tiny_model):
    tok = Tokenizer(tiny_model)
    assert tok.encode(IMG_CONTEXT) == [tok.img_context_id]
    assert tok.decode(tok.encode("the car is moving")) == "the car is moving"


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_shard_is_named(tmp_path):
    ck = make_checkpoint(tmp_path / "s", "tiny", shard_bytes=300_000)
    victim = sorted(ck.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"{victim.name}: missing \\(listed in .*{MANIFEST_FILE}"):
        load_model(ck)
    write_manifest(ck)
    with pytest.raises(CheckpointError, match=f"{victim.name}.*shard missing.*tensor"):
        load_model(ck)


def test_shape_mismatch_is_named(tmp_path, tiny_model):
    ck = copy(tiny_model, tmp_path / "bad")
    state = load_file(ck / "model.safetensors")
    state["mlp1.1.weight"] = state["mlp1.1.weight"][:, :-1].contiguous()
    save_file(state, ck / "model.safetensors")
    write_manifest(ck)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'mlp1\.1\.weight' has shape"):
        load_model(ck)


def test_missing_tensor_and_unknown_architecture(tmp_path, tiny_model):
    ck = copy(tiny_model, tmp_path / "missing")
    state = load_file(ck / "model.safetensors")
    del state["language_model.model.norm.weight"]
    save_file(state, ck / "model.safetensors")
    write_manifest(ck)
    with pytest.raises(CheckpointError, match="language_model.model.norm.weight"):
        load_model(ck)

    ck2 = copy(tiny_model, tmp_path / "arch")
    cfg = json.loads((ck2 / "config.json").read_text())
    cfg["llm_config"]["architectures"] = ["MistralForCausalLM"]
    (ck2 / "config.json").write_text(json.dumps(cfg))
    write_manifest(ck2)
    with pytest.raises(CheckpointError, match="config.json: unknown llm_config architecture 'MistralForCausalLM'"):
        load_model(ck2)

    with pytest.raises(CheckpointError, match="does not exist"):
        load_model(tmp_path / "nowhere")
