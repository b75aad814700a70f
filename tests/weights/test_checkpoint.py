"""Checkpoint folders: round trips (single and sharded) and errors that name the file, tensor and
config key (issue 14 item 5: truncated shards, truncated tokenizer files, wrong-typed config values).
Tests that alter a file on purpose rewrite (or drop) the folder's manifest so that the error under
test is reached rather than the manifest's refusal."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from litevlm_runtime.errors import CheckpointError
from litevlm_runtime.pipeline.pipeline import Pipeline, PipelineOptions
from litevlm_runtime.weights.checkpoint import load_model, read_config
from litevlm_runtime.weights.integrity import MANIFEST_FILE, write_manifest
from litevlm_runtime.weights.random_init import make_checkpoint
from litevlm_runtime.weights.tokenizer import IMG_CONTEXT, Tokenizer


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
    from litevlm_runtime.models.internvl import InternVL
    from litevlm_runtime.weights.checkpoint import write_checkpoint
    from litevlm_runtime.weights.presets import preset

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


def truncate(path, keep: float = 0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


def test_truncated_shard_is_named(tmp_path):
    ck = make_checkpoint(tmp_path / "s", "tiny", shard_bytes=300_000)
    victim = sorted(ck.glob("model-*.safetensors"))[1]
    truncate(victim)
    with pytest.raises(CheckpointError, match=f"{victim}: .* bytes, .*{MANIFEST_FILE} records"):
        load_model(ck)
    (ck / MANIFEST_FILE).unlink()       # a folder from elsewhere: safetensors' own error, named
    with pytest.raises(CheckpointError, match=f"{victim}: not a readable safetensors file .*incomplete metadata"):
        load_model(ck)
    (victim).write_bytes(b"\x08\x00")
    with pytest.raises(CheckpointError, match=f"{victim}: not a readable safetensors file"):
        load_model(ck)
    (ck / "model.safetensors.index.json").write_text('{"weight_map": {"a": ')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json: unreadable shard index"):
        load_model(ck)


def test_truncated_tokenizer_files_are_named(tmp_path, tiny_model):
    ck = copy(tiny_model, tmp_path / "tok")
    (ck / MANIFEST_FILE).unlink()
    truncate(ck / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a readable tokenizers file \(EOF while parsing"):
        Tokenizer(ck)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not a readable"):
        Pipeline.from_pretrained(ck, PipelineOptions())
    (ck / "tokenizer.json").unlink()
    (ck / "tokenizer.model").write_bytes(b"\x0a\x05trunc")
    with pytest.raises(CheckpointError, match=r"tokenizer\.model: not a readable sentencepiece model"):
        Tokenizer(ck)


def sentencepiece_folder(path):
    """A real (tiny) sentencepiece tokenizer.model with the InternVL special tokens in
    tokenizer_config.json, as InternVL2.5-2B ships them."""
    import sentencepiece as spm

    path.mkdir()
    text = path / "corpus.txt"
    text.write_text("\n".join(["the car is moving", "a pedestrian behind the ego car", "front left camera"] * 20))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(path / "tokenizer"), vocab_size=40,
                                   model_type="bpe", minloglevel=2)
    specials = ["<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"]
    config = {"added_tokens_decoder": {str(40 + i): {"content": t, "special": True} for i, t in enumerate(specials)}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def test_tokenizer_config_errors_are_named(tmp_path):
    folder = sentencepiece_folder(tmp_path / "sp")
    tok = Tokenizer(folder)
    assert tok.img_context_id == 44 and tok.encode("<IMG_CONTEXT>") == [44]
    config = folder / "tokenizer_config.json"
    config.write_text(config.read_text()[:-10])
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: unreadable tokenizer config"):
        Tokenizer(folder)
    config.write_text(json.dumps({"added_tokens_decoder": {"x": {"content": "<img>"}}}))
    with pytest.raises(
        CheckpointError, match=r"tokenizer_config\.json: added_tokens_decoder\['x'\] must map a token id"
    ):
        Tokenizer(folder)


def write_config(tmp_path, tiny_model, edit):
    ck = tmp_path / "cfg"
    ck.mkdir(exist_ok=True)
    cfg = json.loads((tiny_model / "config.json").read_text())
    edit(cfg)
    (ck / "config.json").write_text(json.dumps(cfg))
    return ck


def setter(section, key, value):
    def edit(cfg):
        target = cfg[section] if section else cfg
        if value is DELETE:
            del target[key]
        else:
            target[key] = value
    return edit


DELETE = object()


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("llm_config", "hidden_size", "2048", "llm_config.hidden_size must be an integer, got '2048'"),
        ("llm_config", "hidden_size", 128.0, "llm_config.hidden_size must be an integer, got 128.0"),
        ("llm_config", "num_hidden_layers", True, "llm_config.num_hidden_layers must be an integer, got True"),
        ("llm_config", "rope_theta", "1e6", "llm_config.rope_theta must be a number, got '1e6'"),
        ("llm_config", "rms_norm_eps", -1e-5, "llm_config.rms_norm_eps must be positive, got -1e-05"),
        (
            "llm_config",
            "tie_word_embeddings",
            "false",
            "llm_config.tie_word_embeddings must be true or false, got 'false'",
        ),
        ("llm_config", "vocab_size", 0, "llm_config.vocab_size must be positive, got 0"),
        ("llm_config", "vocab_size", DELETE, "llm_config.vocab_size missing"),
        (
            "llm_config",
            "num_attention_heads",
            5,
            "llm_config.hidden_size 128 is not a multiple of llm_config.num_attention_heads 5",
        ),
        (
            "llm_config",
            "num_key_value_heads",
            3,
            "llm_config.num_attention_heads 4 is not a multiple of llm_config.num_key_value_heads 3",
        ),
        ("llm_config", "architectures", "InternLM2ForCausalLM", "llm_config.architectures must be a list"),
        (
            "vision_config",
            "num_attention_heads",
            3,
            "vision_config.hidden_size 64 is not a multiple of vision_config.num_attention_heads 3",
        ),
        ("vision_config", "qkv_bias", 1, "vision_config.qkv_bias must be true or false, got 1"),
        ("vision_config", "patch_size", 15, "force_image_size 112 is not a multiple of vision_config.patch_size 15"),
        (
            "vision_config",
            "norm_type",
            "rms_norm",
            "vision_config.norm_type is 'rms_norm'; only 'layer_norm' is supported",
        ),
        ("vision_config", "hidden_size", DELETE, "vision_config.hidden_size missing"),
        ("", "template", 5, "template must be a string, got 5"),
        ("", "downsample_ratio", 0.3, "downsample_ratio 0.3 does not divide the 8 x 8 patch grid"),
        ("", "force_image_size", "112", "force_image_size must be an integer, got '112'"),
        ("", "ps_version", "v1", "ps_version is 'v1'; only 'v2' is supported"),
        ("", "llm_config", [], "llm_config must be an object, got []"),
    ],
)
def test_config_values_are_checked_with_their_key_path(tmp_path, tiny_model, section, key, value, message):
    ck = write_config(tmp_path, tiny_model, setter(section, key, value))
    with pytest.raises(CheckpointError) as err:
        read_config(ck)
    assert str(err.value).startswith(f"{ck / 'config.json'}: {message}"), str(err.value)


def test_string_hidden_size_no_longer_reaches_torch(tmp_path, tiny_model):
    """It used to be a TypeError from torch.empty deep in the model's constructor."""
    ck = copy(tiny_model, tmp_path / "str")
    cfg = json.loads((ck / "config.json").read_text())
    cfg["llm_config"]["hidden_size"] = "128"
    (ck / "config.json").write_text(json.dumps(cfg))
    write_manifest(ck)
    with pytest.raises(CheckpointError, match=r"config\.json: llm_config\.hidden_size must be an integer, got '128'"):
        Pipeline.from_pretrained(ck, PipelineOptions())
