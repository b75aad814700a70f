"""File integrity of model folders: a manifest of sha256 per file, written beside the files and
checked before any weight is used.

`litevlm_manifest.json` = {"format": FORMAT, "files": {name: {"sha256": hex, "size": bytes}}}
lists every load input of ONE folder (config.json, safetensors shards and index, tokenizer
files; see LOAD_INPUTS). The module sub-folders (view_selector/, token_selector/, eagle/) carry
their own manifest rather than being listed in the top one, so retraining a module rewrites only
that module's manifest, and each loader verifies exactly the folder it reads.

Verifying costs one sha256 pass over the folder (about 600 MB/s on one core here: ~7 s for a
4 GB checkpoint), so it is done once per file version: digests are cached outside the model folder
($LITEVLM_CACHE, else $XDG_CACHE_HOME/litevlm, else ~/.cache/litevlm) keyed by the file's path and
its stat (device, inode, size, mtime_ns, ctime_ns). A restart then costs one stat and one lookup
per file; any write changes mtime/ctime and forces a rehash. The cache guards against accidental
change (a bad copy, a half-written file, an edited shard), not against someone who can also rewrite
the cache; `litevlm checksum DIR --verify` rehashes everything, ignoring the cache.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import logging
import os
import sqlite3
import time
from contextlib import closing
from pathlib import Path

from ..errors import CheckpointError, not_a_file, read_json

MANIFEST_FILE = "litevlm_manifest.json"
FORMAT = "litevlm-manifest/1"
# What a load reads from a folder (top level only: Hugging Face model folders are flat).
LOAD_INPUTS = ("config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
               "tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json",
               "added_tokens.json")
MODULE_FOLDERS = ("view_selector", "token_selector", "eagle", "motion")
# A digest is only cached for a file whose last change is older than this when hashing starts:
# filesystem timestamps are coarse (kernel clock ticks; 2 s on FAT), so a write landing in the same
# tick as our read would otherwise leave an unchanged stat beside a stale digest (git's "racy clean").
RACY_WINDOW_NS = 2_000_000_000

log = logging.getLogger(__name__)


def sha256_file(path: str | Path) -> str:
    """sha256 of a file's bytes, streamed (the one hashing helper; export bundles use it too)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# ------------------------------------------------------------------------------ digest cache
def cache_dir() -> Path:
    if os.environ.get("LITEVLM_CACHE"):
        return Path(os.environ["LITEVLM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "litevlm"


def _stat_key(st: os.stat_result) -> tuple[int, int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class DigestCache:
    """sha256 per file version in a small SQLite table (stdlib, and it serialises concurrent
    writers such as torchrun ranks loading at once). Any database error degrades to hashing."""

    def __init__(self, folder: Path | None = None):
        self.path = (folder or cache_dir()) / "file_digests.sqlite3"

    def _connect(self) -> sqlite3.Connection:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(self.path, timeout=30)
        db.execute("CREATE TABLE IF NOT EXISTS digests (path TEXT PRIMARY KEY, dev INT, ino INT, size INT, "
                   "mtime_ns INT, ctime_ns INT, sha256 TEXT)")
        return db

    def lookup(self, path: str, st: os.stat_result) -> str | None:
        try:
            with closing(self._connect()) as db:
                row = db.execute("SELECT dev, ino, size, mtime_ns, ctime_ns, sha256 FROM digests WHERE path = ?",
                                 (path,)).fetchone()
        except (sqlite3.Error, OSError):
            return None
        return row[5] if row is not None and tuple(row[:5]) == _stat_key(st) else None

    def store(self, path: str, st: os.stat_result, digest: str) -> None:
        try:
            with closing(self._connect()) as db, db:
                db.execute(
                    "INSERT OR REPLACE INTO digests VALUES (?, ?, ?, ?, ?, ?, ?)", (path, *_stat_key(st), digest)
                )
        except (sqlite3.Error, OSError) as exc:
            log.debug("digest cache %s not written: %s", self.path, exc)


def file_digest(path: str | Path, cache: DigestCache | None = None) -> str:
    """sha256 of `path`, from the cache when this exact file version was hashed before."""
    real = os.path.realpath(path)
    cache = cache or DigestCache()
    st = os.stat(real)
    cached = cache.lookup(real, st)
    if cached is not None:
        return cached
    started = time.time_ns()
    digest = sha256_file(real)
    after = os.stat(real)
    if _stat_key(after) == _stat_key(st) and max(st.st_mtime_ns, st.st_ctime_ns) < started - RACY_WINDOW_NS:
        cache.store(real, st, digest)
    return digest


# ------------------------------------------------------------------------------ manifests
def load_inputs(folder: Path) -> list[str]:
    """Names of the files in `folder` (not below it) that a load may read."""
    return sorted(p.name for p in folder.iterdir()
                  if p.is_file() and any(fnmatch.fnmatchcase(p.name, pat) for pat in LOAD_INPUTS))


def write_manifest(folder: str | Path, cache: DigestCache | None = None) -> dict:
    """Hash every load input of `folder` and write its manifest (atomically); return it."""
    folder = Path(folder)
    files = {}
    for name in load_inputs(folder):
        path = folder / name
        files[name] = {"sha256": file_digest(path, cache), "size": path.stat().st_size}
    manifest = {"format": FORMAT, "files": files}
    tmp = folder / (MANIFEST_FILE + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(folder / MANIFEST_FILE)
    return manifest


def model_folders(folder: str | Path) -> list[Path]:
    """`folder` and each module sub-folder it has: the folders that carry a manifest each."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder does not exist")
    return [folder] + [folder / m for m in MODULE_FOLDERS if (folder / m).is_dir()]


def write_manifests(folder: str | Path, cache: DigestCache | None = None) -> list[Path]:
    """The manifest of `folder` and of each module sub-folder it has; returns the folders written."""
    done = model_folders(folder)
    for f in done:
        write_manifest(f, cache)
    return done


def read_manifest(folder: Path) -> dict[str, dict] | None:
    """The manifest's file table, None where the folder has no manifest."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    manifest = read_json(path, "manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CheckpointError(f"{path}: manifest format {got!r}, this runtime reads {FORMAT!r}")
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CheckpointError(f"{path}: 'files' must be an object of name -> {{sha256, size}}")
    for name, entry in files.items():
        if Path(name).name != name or name in (".", ".."):
            raise CheckpointError(f"{path}: entry {name!r} is not a file name in this folder")
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and isinstance(entry.get("size"), int) and not isinstance(entry.get("size"), bool)):
            raise CheckpointError(f"{path}: entry {name!r} must be {{\"sha256\": hex, \"size\": bytes}}, got {entry!r}")
    return files


def verify_model_folder(folder: str | Path, cache: DigestCache | None = None, use_cache: bool = True) -> bool:
    """Check `folder`'s load inputs against its manifest; CheckpointError naming the file on any
    mismatch. A folder without a manifest logs one warning and passes (returns False)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: model folder does not exist")
    manifest_path = folder / MANIFEST_FILE
    files = read_manifest(folder)
    if files is None:
        log.warning("%s: no %s, file integrity not verified (write one: litevlm checksum %s)",
                    folder, MANIFEST_FILE, folder)
        return False
    unlisted = sorted(set(load_inputs(folder)) - set(files))
    if unlisted:
        raise CheckpointError(f"{folder / unlisted[0]}: not listed in {manifest_path} (added after the manifest "
                              f"was written; if intended: litevlm checksum {folder})")
    cache = cache or DigestCache()
    for name, entry in sorted(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{path}: {not_a_file(path)} (listed in {manifest_path})")
        size = path.stat().st_size
        if size != entry["size"]:
            raise CheckpointError(f"{path}: {size} bytes, {manifest_path} records {entry['size']} "
                                  f"(truncated or replaced)")
        digest = file_digest(path, cache) if use_cache else sha256_file(path)
        if digest != entry["sha256"]:
            raise CheckpointError(f"{path}: sha256 {digest} does not match {entry['sha256']} recorded in "
                                  f"{manifest_path} (modified or corrupt; if intended: litevlm checksum {folder})")
    return True


def folders_without_manifest(folder: str | Path) -> list[Path]:
    """The folders of a model (itself and each module sub-folder) that carry no manifest."""
    return [f for f in model_folders(folder) if not (f / MANIFEST_FILE).is_file()]


def integrity_label(folder: str | Path) -> str:
    """What the node reports after a load: 'verified (manifest)' when every folder of the model
    has a manifest (a load verifies what it reads, and refuses a mismatch), else 'unverified (no
    manifest)', naming the module folders without one when the top folder has its own."""
    missing = folders_without_manifest(folder)
    if not missing:
        return "verified (manifest)"
    top = Path(folder)
    if top in missing:
        return "unverified (no manifest)"
    return f"unverified (no manifest in {', '.join(f.name + '/' for f in missing)})"


def require_manifest_error(folder: str | Path) -> str | None:
    """Why a node with require_manifest on refuses `folder` (None: every folder has a manifest),
    with the exact command that writes them (after checking the files are the intended ones)."""
    missing = folders_without_manifest(folder)
    if not missing:
        return None
    names = ", ".join(str(f) for f in missing)
    return (f"require_manifest: no {MANIFEST_FILE} in {names}; check that the files are the ones to serve, "
            f"then write the manifests with: litevlm checksum {folder}")
