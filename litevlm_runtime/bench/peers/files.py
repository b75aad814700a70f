"""The peers' model files, written apart from timing them and kept in a cache folder keyed by the
weights' digest, so that a second run (or the lead's rerun on a quiet machine) only times.

    <cache>/<digest>/llama.cpp/model-f16.gguf, model-q8_0.gguf, model-q4_0.gguf, mmproj-f16.gguf
    <cache>/<digest>/openvino/...                  (run_openvino.py's exports)

<digest>: the first 16 hex digits of the sha256 of the peer-form folder's litevlm_manifest.json
(which holds the sha256 of every file the folder loads from): other weights, other files. Each
file is written by llama.cpp's or optimum's own tools in its own process (peers/env.py's clean
environment), into a temporary name renamed when complete, so an interrupted run leaves nothing
that a later run would take for finished.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

from ...errors import InputError
from ...weights.checkpoint import read_config
from ...weights.integrity import write_manifest
from . import env

GGUF_FORMS = ("f16", "q8_0", "q4_0")


def weights_digest(folder: Path) -> str:
    manifest = Path(folder) / "litevlm_manifest.json"
    if not manifest.is_file():
        write_manifest(folder)
    return hashlib.sha256(manifest.read_bytes()).hexdigest()[:16]


def cache_dir(cache: Path, folder: Path) -> Path:
    out = Path(cache) / weights_digest(folder)
    out.mkdir(parents=True, exist_ok=True)
    (out / "source.txt").write_text(f"{Path(folder).resolve()}\n")
    return out


def _write(path: Path, make, progress, what: str) -> Path:
    if path.is_file():
        return path
    tmp = path.with_name(path.name + ".partial")
    tmp.unlink(missing_ok=True)
    progress(f"writing {what} -> {path}")
    t0 = time.perf_counter()
    make(tmp)
    tmp.rename(path)
    progress(f"  {what}: {time.perf_counter() - t0:.0f} s, {path.stat().st_size / 1e9:.2f} GB")
    return path


def llama_files(folder: Path, cache: Path, forms, progress=print) -> dict[str, Path]:
    """{form: text model GGUF} for each of `forms` and {"mmproj": the vision GGUF (F16)}: upstream's
    converter (text at F16, `--mmproj` at F16), then llama_model_quantize from the F16 file."""
    layers = read_config(folder).vision.num_hidden_layers
    if layers < 4:
        # convert_hf_to_gguf maps `mlp1.{bid}` (the projector's 0, 1, 3) through the vision tower's
        # per-block table, which has one entry per vision layer: fewer than 4 leave mlp1.3 unmapped.
        raise InputError(f"{folder}: a vision tower of {layers} layers; llama.cpp's converter maps the projector "
                         f"mlp1.3 only for 4 or more (e.g. --preset small; InternViT-300M has 24)")
    out = cache_dir(cache, folder) / "llama.cpp"
    out.mkdir(exist_ok=True)
    log = out / "convert.log"
    script = env.HERE / "convert_gguf.py"
    src = str(env.llama_src())
    python = __import__("sys").executable
    files = {"mmproj": _write(out / "mmproj-f16.gguf", lambda tmp: env.run_script(
        python, script, ["convert", src, str(folder), str(tmp), "f16", "--mmproj"], log), progress, "mmproj F16")}
    f16 = out / "model-f16.gguf"
    if "f16" in forms or any(f != "f16" for f in forms):
        files["f16"] = _write(f16, lambda tmp: env.run_script(
            python, script, ["convert", src, str(folder), str(tmp), "f16"], log), progress, "text model F16")
    for form in forms:
        if form != "f16":
            files[form] = _write(out / f"model-{form}.gguf", lambda tmp, form=form: env.run_script(
                python, script, ["quantize", str(f16), str(tmp), form], log), progress, f"text model {form.upper()}")
    return files
