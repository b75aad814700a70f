"""The export bundle's format: manifest.json (what each graph is, what it was made from, how to
bind it), its checks against the runtime loading it, and the checkpoint hash it records. Read by
every bundle backend (ONNX Runtime, TensorRT) and written by the exporter and the calibrator."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..errors import LiteVLMError
from ..weights.integrity import file_digest, sha256_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


def checkpoint_hash(model_dir: Path) -> str:
    """sha256 over config.json and every *.safetensors file (names and contents, sorted)."""
    h = hashlib.sha256()
    files = [model_dir / "config.json"] + sorted(model_dir.glob("*.safetensors"))
    for f in files:
        if f.is_file():
            h.update(f.name.encode())
            h.update(file_digest(f).encode())   # cached per file version: a bundle load does not rehash 4 GB
    return h.hexdigest()


def write_manifest(bundle: Path, manifest: dict) -> None:
    tmp = Path(bundle) / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(Path(bundle) / MANIFEST)


def read_manifest(bundle: Path) -> dict:
    path = Path(bundle) / MANIFEST
    if not path.is_file():
        raise LiteVLMError(f"{bundle}: no {MANIFEST} (not an export bundle; run `litevlm export` first)")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise LiteVLMError(f"{path}: not valid JSON ({exc})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise LiteVLMError(f"{path}: bundle format {manifest.get('format')!r}, this runtime reads {FORMAT_VERSION}")
    return manifest


def check_bundle_matches(manifest: dict, rt, bundle: Path) -> None:
    """The bundle must have been exported for this runtime's arena, dtype and checkpoint."""
    a = rt.arena
    want = {"max_len": a.max_len, "max_tiles": a.limits.max_tiles(), "max_query": a.max_query}
    have = manifest["arena"]
    for key, value in want.items():
        if have.get(key) != value:
            raise LiteVLMError(f"{bundle}: exported for arena {key}={have.get(key)}, this pipeline has {value} "
                               f"(re-export with the same --tiles-per-camera/--max-new-tokens)")
    kv = have.get("kv_dtype", "float")           # (bundles exported before quantized caches: float)
    if kv != a.limits.kv_dtype:
        raise LiteVLMError(f"{bundle}: exported for arena.kv_dtype {kv}, this pipeline has {a.limits.kv_dtype} "
                           f"(its step graphs take the cache in that form: re-export with --arena.kv_dtype "
                           f"{a.limits.kv_dtype})")
    if manifest["dtype"] != rt.options.dtype:
        raise LiteVLMError(f"{bundle}: exported in {manifest['dtype']}, pipeline runs {rt.options.dtype}")
    model_dir = rt.model_dir
    ck = manifest["model"].get("checkpoint_sha256")
    if model_dir is not None and ck and checkpoint_hash(Path(model_dir)) != ck:
        raise LiteVLMError(f"{bundle}: exported from a different checkpoint than {model_dir} (hash mismatch)")


def verify_files(manifest: dict, bundle: Path) -> None:
    """Every graph and weights file listed must be there with the recorded sha256."""
    files = {g["file"]: g["sha256"] for g in manifest["graphs"]} | dict(manifest["weights"])
    for name, digest in files.items():
        path = Path(bundle) / name
        if not path.is_file():
            raise LiteVLMError(f"{bundle}: missing {name}")
        if sha256_file(path) != digest:
            raise LiteVLMError(f"{bundle}: {name} does not match its sha256 in {MANIFEST} (modified or corrupt)")


def graphs_of(manifest: dict, stage: str) -> dict[int, dict]:
    return {g["bucket"]: g for g in manifest["graphs"] if g["stage"] == stage}
