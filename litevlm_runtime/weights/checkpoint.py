"""Read and write InternVL2.5 Hugging Face folders: config.json, safetensors (single file or
sharded with model.safetensors.index.json), tokenizer files.

Every inconsistency is reported with the file and the tensor it concerns, before any weight is
used: a half-loaded model is worse than none. A folder's files are checked against its
litevlm_manifest.json first (integrity.py), so a corrupt shard is refused by name, not served.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import CheckpointError, not_a_file, read_json
from ..models.config import ModelConfig
from ..models.internvl import InternVL
from ..models.motion import MOTION_FEATURES, MotionTokens
from .finite import check_finite
from .hf_layout import check_image_seq_length, is_hf_layout, rename_in_error, tensor_sources, to_remote_config
from .integrity import verify_model_folder, write_manifest
from .tokenizer import SPECIAL_TOKENS, Tokenizer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_config(folder: str | Path) -> ModelConfig:
    folder = Path(folder)
    path = folder / "config.json"
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path}: {not_a_file(path)} (not a Hugging Face model folder)")
    data = read_json(path, "model config")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(data).__name__}")
    if not is_hf_layout(data):
        return ModelConfig.from_dict(data, source=str(path))
    remote, names = to_remote_config(data, str(path))
    try:
        cfg = ModelConfig.from_dict(remote, source=str(path))
    except CheckpointError as exc:
        raise rename_in_error(exc, str(path), names) from None
    check_image_seq_length(data, cfg.tokens_per_tile, str(path))
    cfg.weights_layout = "hf"
    return cfg


@contextmanager
def open_safetensors(path: Path):
    """safe_open with its errors (a truncated file's "incomplete metadata, file not fully covered",
    a bad header) turned into CheckpointError naming the file."""
    try:
        f = safe_open(str(path), "pt")
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    with f:
        yield f


def get_tensor(f, path: Path, name: str) -> torch.Tensor:
    """One tensor of an open file, refused by name when unreadable or not finite (finite.py)."""
    try:
        t = f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: tensor {name!r} unreadable ({exc})") from None
    check_finite(path, name, t)
    return t


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of one file (the add-on modules' weights), errors naming the file."""
    path = Path(path)
    with open_safetensors(path) as f:
        return {name: get_tensor(f, path, name) for name in f.keys()}


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it (from the index, or the single file)."""
    index = folder / INDEX_FILE
    if index.is_file():
        data = read_json(index, "shard index")
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not weight_map or not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no weight_map")
        bad = next((n for n, f in weight_map.items() if not isinstance(f, str) or Path(f).name != f), None)
        if bad is not None:
            raise CheckpointError(f"{index}: weight_map[{bad!r}] must be a shard file name, got {weight_map[bad]!r}")
        files = {name: folder / fname for name, fname in weight_map.items()}
        for name, path in files.items():
            if not path.is_file():
                raise CheckpointError(f"{path}: shard {not_a_file(path)} (listed in {INDEX_FILE} for tensor {name!r})")
        return files
    single = folder / SINGLE_FILE
    if not single.is_file():
        why = not_a_file(single)
        raise CheckpointError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}" if why == "missing"
                              else f"{single}: {why}")
    with open_safetensors(single) as f:
        return {name: single for name in f.keys()}


def check_state_dict(source: str | Path, state: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                     prefix: str = "") -> None:
    """A small module's safetensors state against the module's own state_dict: every tensor there,
    each of the expected shape, nothing else. `prefix` is how the file names the tensors."""
    for name, t in expected.items():
        if name not in state:
            raise CheckpointError(f"{source}: tensor {prefix + name!r} missing")
        if state[name].shape != t.shape:
            raise CheckpointError(f"{source}: tensor {prefix + name!r} has shape {tuple(state[name].shape)}, "
                                  f"expected {tuple(t.shape)}")
    extra = set(state) - set(expected)
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor {prefix + sorted(extra)[0]!r}")


def load_state_dict(folder: str | Path, expected: dict[str, torch.Size], dtype: torch.dtype,
                    sources: dict[str, tuple[str, ...]] | None = None,
                    unread: set[str] = frozenset(), combine: dict | None = None) -> dict[str, torch.Tensor]:
    """Load exactly the expected tensors, checking names and shapes against `expected`.

    `sources` names, per expected tensor, the folder's tensor(s) it is made of (default: itself);
    several are concatenated along rows (the -hf layout's q/k/v for InternViT's fused qkv) or joined
    by `combine[name]` (InternLM2's packed wqkv); `unread` are names the folder may hold that are
    not read (a tied head's copy)."""
    combine = combine or {}
    folder = Path(folder)
    files = weight_files(folder)
    sources = sources or {name: (name,) for name in expected}
    tied_head = "language_model.lm_head.weight"
    for name in expected:
        for source in sources[name]:
            if source not in files and name != tied_head:
                raise CheckpointError(f"{folder}: tensor {source!r} missing from the checkpoint")
    used = {source for name in expected for source in sources[name]}
    unexpected = sorted(set(files) - used - set(unread))
    if unexpected:
        raise CheckpointError(f"{files[unexpected[0]]}: unexpected tensor {unexpected[0]!r} "
                              f"({len(unexpected)} in all) for this config")
    parts: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for source in sorted(used & set(files)):
        by_file.setdefault(files[source], []).append(source)
    for path, names in by_file.items():
        with open_safetensors(path) as f:
            present = set(f.keys())
            for source in names:
                if source not in present:
                    raise CheckpointError(f"{path}: tensor {source!r} listed in the index but not in the file")
                parts[source] = get_tensor(f, path, source)
    state: dict[str, torch.Tensor] = {}
    for name in expected:
        if not all(s in parts for s in sources[name]):
            continue                                   # the tied head, absent by design
        pieces = [parts[s] for s in sources[name]]
        t = combine[name](*pieces) if name in combine else torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        if t.shape != expected[name]:
            what = " + ".join(repr(s) for s in sources[name])
            raise CheckpointError(f"{files[sources[name][0]]}: tensor {what} has shape {tuple(t.shape)}, "
                                  f"config expects {tuple(expected[name])}")
        state[name] = t.to(dtype)
    return state


def load_model(folder: str | Path, dtype: torch.dtype = torch.float32, max_len: int | None = None) -> InternVL:
    """The model of `folder`, its files verified against the folder's manifest first. `max_len` is
    the RoPE table's length (default 4096, within max_position_embeddings); the pipeline passes its
    arena's max_len, so the table is made once."""
    verify_model_folder(folder)
    cfg = read_config(folder)
    max_len = max_len or min(4096, cfg.llm.max_position_embeddings)
    with torch.device("meta"):
        model = InternVL(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if cfg.llm.tie_word_embeddings:
        expected.pop("language_model.lm_head.weight", None)
    sources, combine, unread = None, None, set()
    if cfg.weights_layout == "hf":
        sources, combine, unread = tensor_sources(list(expected), cfg.llm, weight_files(Path(folder)))
    state = load_state_dict(folder, expected, dtype, sources, unread, combine)
    # Built on the meta device so that no time goes into random init of weights about to be
    # replaced; the loaded tensors are assigned in place and the RoPE tables made for real.
    model.load_state_dict(state, strict=True, assign=True)
    model.language_model.init_rope(max_len)
    if (Path(folder) / "motion").is_dir():
        verify_model_folder(Path(folder) / "motion")
        model.motion = load_motion(Path(folder) / "motion", cfg.llm.hidden_size).to(dtype)
    return model.eval()


def write_checkpoint(folder: str | Path, model: InternVL, tokenizer_file: Path | None = None,
                     shard_bytes: int | None = None, dtype: torch.dtype = torch.float32) -> None:
    """Write `model` as an InternVL2.5 folder (config.json, safetensors, tokenizer files), then
    its litevlm_manifest.json over what the folder now holds."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(model.cfg.to_dict(), indent=2, ensure_ascii=False) + "\n")
    state = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.checkpoint_state().items()}
    if model.motion is not None:
        save_motion(model.motion, folder / "motion")
        write_manifest(folder / "motion")
    if shard_bytes is None:
        save_file(state, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    else:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, t in state.items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t
            size += nbytes
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(folder / fname), metadata={"format": "pt"})
            weight_map.update({name: fname for name in shard})
        total = sum(t.numel() * t.element_size() for t in state.values())
        (folder / INDEX_FILE).write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if tokenizer_file is not None:
        (folder / "tokenizer.json").write_bytes(Path(tokenizer_file).read_bytes())

        tok = Tokenizer(folder)
        (folder / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template_name": model.cfg.template,
            "eos_token": "<|im_end|>",
            "added_tokens_decoder": {str(tok._vocab[t]): {"content": t, "special": True} for t in SPECIAL_TOKENS},
        }, indent=2) + "\n")
        (folder / "generation_config.json").write_text(
            json.dumps({"eos_token_id": sorted(tok.eos_ids), "do_sample": False}) + "\n")
    write_manifest(folder)


MOTION_ARCHITECTURE = "litevlm-motion-tokens"
MOTION_CONFIG = "config.json"


def save_motion(module: MotionTokens, folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(folder / SINGLE_FILE), metadata={"format": "pt"})
    config = {"architecture": MOTION_ARCHITECTURE, "features": MOTION_FEATURES, "hidden": module.net[0].out_features,
              "out_features": module.net[2].out_features, "features_from": "stages/motion.py"}
    (folder / MOTION_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def load_motion(folder: str | Path, out_features: int) -> MotionTokens:
    """The motion network of a model folder's `motion/` (save_motion), for a decoder of width `out_features`."""
    folder = Path(folder)
    config_path = folder / MOTION_CONFIG
    config = read_json(config_path, "motion network config")
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a motion network config (a JSON object)")
    if config.get("architecture") != MOTION_ARCHITECTURE or config.get("features") != MOTION_FEATURES:
        raise CheckpointError(f"{config_path}: not this runtime's motion network (architecture "
                              f"{config.get('architecture')!r}, {config.get('features')} features per cell)")
    if config.get("out_features") != out_features:
        raise CheckpointError(f"{config_path}: made for a decoder of width {config.get('out_features')}, "
                              f"this one's is {out_features}")
    module = MotionTokens(int(config["hidden"]), out_features)
    weights = folder / SINGLE_FILE
    state = read_safetensors(weights)
    check_state_dict(weights, state, module.state_dict())
    module.load_state_dict(state)
    return module.eval()
