"""What a run's manifest says about what was run: the model folder's checksum, the parameters, the
project's version, and the identity a resumed run must match.

The checksum covers every file under the model folder (weights, tokenizer, config, and the
add-on modules' sub-folders), each by its sha256 (integrity.file_digest: cached per file version,
so a second run over a multi-GB checkpoint costs a stat per file), combined over the sorted
relative paths. Two runs with the same checksum ran the same model bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

from .. import __version__
from ..bundled import DEFAULT_MODEL
from ..errors import InputError
from ..weights.integrity import DigestCache, file_digest


def model_dir_of(params: dict) -> Path:
    return Path(params.get("model_dir") or DEFAULT_MODEL).absolute()


def model_checksum(folder: Path) -> dict:
    if not folder.is_dir():
        raise InputError(f"model_dir {folder}: no such folder")
    cache = DigestCache()
    h = hashlib.sha256()
    files = sorted(p for p in folder.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    size = 0
    for p in files:
        rel = p.relative_to(folder).as_posix()
        h.update(f"{rel}\0{file_digest(p, cache)}\n".encode())
        size += p.stat().st_size
    return {"dir": str(folder), "sha256": h.hexdigest(), "files": len(files), "bytes": size}


def project_version() -> dict:
    """The package version, and the git commit of the checkout it runs from (dirty: uncommitted
    changes) where it is one; in an image built without .git, the commit it was built from
    (LITEVLM_GIT_COMMIT, set by deploy/Dockerfile)."""
    root = Path(__file__).resolve().parents[2]
    out = {"version": __version__, "git_commit": os.environ.get("LITEVLM_GIT_COMMIT") or None, "git_dirty": None}
    if out["git_commit"]:
        return out
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                timeout=10)
        if commit.returncode == 0:
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10)
            out["git_commit"], out["git_dirty"] = commit.stdout.strip(), bool(status.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return out


def jsonable(params: dict) -> dict:
    """Parameters as JSON has them (tuples become lists), so a manifest compares equal to itself."""
    return json.loads(json.dumps(params, sort_keys=True, default=str))


def identity(params: dict, model: dict, ground_truth: list[str]) -> dict:
    """What a resumed run must share with the run it adds to: the same model bytes, parameters
    and references (a run mixing two of them would compare as one)."""
    return {"model_sha256": model["sha256"], "params": jsonable(params),
            "ground_truth": sorted(str(Path(g).absolute()) for g in ground_truth)}


def check_resume(manifest: dict, ident: dict, run: Path) -> None:
    old = manifest.get("identity", {})
    if old == ident:
        return
    diffs = []
    if old.get("model_sha256") != ident["model_sha256"]:
        diffs.append("the model folder's checksum")
    old_p, new_p = old.get("params", {}), ident["params"]
    changed = sorted(k for k in set(old_p) | set(new_p) if old_p.get(k) != new_p.get(k))
    if changed:
        diffs.append("parameters " + ", ".join(f"{k} ({old_p.get(k)!r} -> {new_p.get(k)!r})" for k in changed[:6])
                     + (" ..." if len(changed) > 6 else ""))
    if old.get("ground_truth") != ident["ground_truth"]:
        diffs.append("--ground-truth folders")
    raise InputError(f"{run} was run with other settings ({'; '.join(diffs)}): resume it with the same ones, "
                     f"or give a new --out")


def now_iso(t: float | None = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() if t is None else t))
