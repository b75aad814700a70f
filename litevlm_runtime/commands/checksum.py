"""`litevlm checksum DIR`: write the litevlm_manifest.json of a model folder from elsewhere (and of
each module sub-folder it has); `--verify` checks a folder against its manifests by rehashing
everything; `--bench` measures what verification costs on a first load and on a restart."""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import CheckpointError
from ..report import table


def register(subparsers) -> None:
    p = subparsers.add_parser("checksum", help="write (or --verify) the sha256 manifest of a model folder")
    p.add_argument("folder", type=Path)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--verify", action="store_true",
                      help="check every file against the manifests, rehashing (ignores the digest cache)")
    mode.add_argument("--bench", action="store_true",
                      help="time a full sha256 pass (first load) against verification from the digest cache (restart)")
    p.set_defaults(func=run)


def run(args) -> int:
    from ..weights.integrity import MANIFEST_FILE, model_folders, verify_model_folder, write_manifests

    if args.verify:
        for f in model_folders(args.folder):
            t0 = time.perf_counter()
            checked = verify_model_folder(f, use_cache=False)
            print(f"{f}: {'ok' if checked else 'no manifest, not checked'} ({time.perf_counter() - t0:.2f} s)")
        return 0
    if args.bench:
        return bench(args.folder)
    t0 = time.perf_counter()
    written = write_manifests(args.folder)
    for f in written:
        print(f"wrote {f / MANIFEST_FILE}")
    print(f"{len(written)} manifest(s) in {time.perf_counter() - t0:.2f} s")
    return 0


def bench(folder: Path) -> int:
    """First load: one sha256 pass over every listed file (the page cache may hold them: this is
    the CPU cost, a cold disk adds its read time). Restart: verify_model_folder with the digest
    cache filled, the cost every later load pays."""
    from ..weights.integrity import model_folders, read_manifest, sha256_file, verify_model_folder

    rows, total_bytes, total_hash, total_cached = [], 0, 0.0, 0.0
    for f in model_folders(folder):
        files = read_manifest(f)
        if files is None:
            raise CheckpointError(f"{f}: no manifest to verify against (write one: litevlm checksum {folder})")
        size = sum(e["size"] for e in files.values())
        t0 = time.perf_counter()
        for name in files:
            sha256_file(f / name)
        hashed = time.perf_counter() - t0
        verify_model_folder(f)                       # fills the cache where the files are settled
        t0 = time.perf_counter()
        verify_model_folder(f)
        cached = time.perf_counter() - t0
        rows.append([str(f), len(files), size / 1e6, hashed, size / 1e6 / hashed, cached * 1e3, hashed / cached])
        total_bytes, total_hash, total_cached = total_bytes + size, total_hash + hashed, total_cached + cached
    rows.append(["total", sum(r[1] for r in rows), total_bytes / 1e6, total_hash, total_bytes / 1e6 / total_hash,
                 total_cached * 1e3, total_hash / total_cached])
    print(table(["folder", "files", "MB", "sha256 pass s", "MB/s", "cached verify ms", "ratio"], rows))
    print(
        f"at {total_bytes / 1e6 / total_hash:.0f} MB/s a 4 GB checkpoint costs "
        f"{4e3 / (total_bytes / 1e6 / total_hash):.1f} s "
        f"on its first load; later loads pay the cached verify (files changed in the last 2 s are rehashed)"
    )
    return 0
