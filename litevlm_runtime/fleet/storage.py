"""Where bags, runs and reports live: a local path, or a URI that pyarrow.fs resolves (s3://, gs://,
abfs://, hdfs://, file://) or, failing that, fsspec (whatever protocol an installed fsspec
implementation registers: http://, sftp://, ...), behind one pyarrow FileSystem either way.

Why pyarrow.fs first: the run is a Parquet dataset, and pyarrow writes it, reads it back
(`pyarrow.dataset`) and talks to object stores with the cloud SDKs' own clients (credentials and
endpoints from the environment as the AWS/GCP/Azure tools read them: AWS_ACCESS_KEY_ID,
AWS_ENDPOINT_URL, GOOGLE_APPLICATION_CREDENTIALS ...), so the fleet adds no client of its own.
fsspec (via pyarrow's FSSpecHandler) covers the protocols pyarrow has no native filesystem for.

What a URI run folder relies on, and why it keeps the guarantees of a local one:
- an object appears whole when its upload completes, or not at all (S3, GCS, Azure blobs: a PUT
  or a completed multipart upload is atomic), so a bag's Parquet file written straight to its
  final key is as atomic as the local write-to-temporary-then-rename;
- a local path keeps the rename and fsync (a local file being written is visible half-written).

Bags are fetched, not streamed: rosbags reads a bag by file path (seeks in MCAP summaries and
sqlite3 pages), so a worker copies the bag's objects to its own scratch folder, evaluates the
copy and deletes it (fetch_bag).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pyarrow.fs as pafs

from ..errors import InputError

# fsspec and pyarrow's FSSpecHandler are imported where an fsspec URL is opened: S3 and local paths need
# neither.

URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
CHUNK = 8 << 20                     # bytes per read while fetching (8 MiB: few calls, modest memory)
_FILESYSTEMS: dict[tuple, pafs.FileSystem] = {}
CREDENTIAL_ENV = ("AWS_ACCESS_KEY_ID", "AWS_PROFILE", "AWS_ENDPOINT_URL", "GOOGLE_APPLICATION_CREDENTIALS")


def is_uri(target: str | Path) -> bool:
    return isinstance(target, str) and bool(URI.match(target))


def _split(uri: str) -> tuple[str, str]:
    """(the URI without its query, '?query' or '') - the query carries filesystem options
    (s3://b/k?endpoint_override=...) that every URI derived from it must keep."""
    base, sep, query = uri.partition("?")
    return base, (sep + query if sep else "")


def reason(exc: BaseException) -> str:
    """One line of a filesystem error (pyarrow's S3 errors run over several)."""
    text = " ".join(str(exc).split())
    return text[:400] if text else type(exc).__name__


@dataclass(frozen=True)
class Location:
    """A file or folder: `uri` as a person reads it (a URI, or an absolute local path), the
    filesystem, and the path in that filesystem's own terms ('bucket/key' for S3)."""

    uri: str
    fs: pafs.FileSystem
    path: str
    local: bool
    query: str = ""

    def __str__(self) -> str:
        return self.uri

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    def child(self, *parts: str) -> "Location":
        path = "/".join([self.path.rstrip("/"), *parts])
        if self.local:
            return Location(path, self.fs, path, True)
        base, _ = _split(self.uri)
        return Location("/".join([base.rstrip("/"), *parts]) + self.query, self.fs, path, False, self.query)

    def info(self) -> pafs.FileInfo:
        try:
            return self.fs.get_file_info(self.path)
        except OSError as exc:
            raise InputError(f"{self.uri}: cannot look it up ({reason(exc)})") from None

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self.info().type == pafs.FileType.File

    def files(self) -> list[pafs.FileInfo]:
        """Every file under this folder (none when it does not exist)."""
        try:
            return [i for i in self.fs.get_file_info(pafs.FileSelector(self.path, recursive=True,
                                                                          allow_not_found=True))
                    if i.type == pafs.FileType.File]
        except OSError as exc:
            raise InputError(f"{self.uri}: cannot list it ({reason(exc)})") from None

    def read_bytes(self) -> bytes:
        with self.fs.open_input_stream(self.path) as fh:
            return fh.read()

    def write_bytes(self, data: bytes) -> None:
        """Written whole or not at all (module docstring); raises OSError as the filesystem does."""
        if self.local:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(self.path).with_name(f".{Path(self.path).name}.{uuid.uuid4().hex[:8]}.tmp")
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.path)
        else:
            with self.fs.open_output_stream(self.path) as fh:      # visible once the upload completes
                fh.write(data)

    def delete(self) -> None:
        try:
            self.fs.delete_file(self.path)
        except FileNotFoundError:
            pass

    def local_path(self) -> Path:
        if not self.local:
            raise ValueError(f"{self.uri} is not on a local filesystem")
        return Path(self.path)


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, its path for uri). An object store's filesystem is kept per bucket and options:
    making one resolves credentials (on a cloud VM, a call to the instance metadata service)."""
    base, query = _split(uri)
    parts = urlsplit(base)
    # (the credentials' names are part of the key: a process that changes them gets a new client)
    key = (parts.scheme.lower(), parts.netloc, query, *(os.environ.get(v, "") for v in CREDENTIAL_ENV))
    cacheable = key[0] in ("s3", "gs", "gcs")
    if cacheable and key in _FILESYSTEMS:
        return _FILESYSTEMS[key], parts.netloc + unquote(parts.path)
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (ValueError, OSError) as arrow_exc:       # ArrowInvalid is a ValueError; hdfs without a JVM an OSError
        try:
            import fsspec
            from pyarrow.fs import FSSpecHandler, PyFileSystem

            spec_fs, path = fsspec.core.url_to_fs(uri)
            fs = PyFileSystem(FSSpecHandler(spec_fs))
        except (ImportError, ValueError, OSError) as spec_exc:
            raise InputError(f"{uri}: no filesystem for {parts.scheme}:// (pyarrow.fs: {reason(arrow_exc)}; "
                             f"fsspec: {reason(spec_exc)})") from None
    if cacheable:
        _FILESYSTEMS[key] = fs
    return fs, path


def locate(target: str | Path) -> Location:
    """A local path or a URI -> Location. file:// URIs are local paths."""
    text = str(target)
    if is_uri(text) and URI.match(text).group(1).lower() != "file":
        fs, path = _filesystem(text)
        base, query = _split(text)
        return Location(base.rstrip("/") + query, fs, path.rstrip("/"), False, query)
    if is_uri(text):
        text = unquote(urlsplit(text).path)
    path = os.path.normpath(Path(text).expanduser().absolute())         # x/../y -> y; symlinks kept
    return Location(path, pafs.LocalFileSystem(), path, True)


def join(base: str, relative: str) -> str:
    """`relative` (a line of a list file) against the URI or path of the folder that holds it."""
    if is_uri(relative) or Path(relative).expanduser().is_absolute():
        return relative
    if is_uri(base):
        b, query = _split(base)
        return f"{b.rstrip('/')}/{relative}{query}"
    return str(Path(base) / relative)


def parent(target: str) -> str:
    if is_uri(target):
        b, query = _split(target)
        return b.rstrip("/").rsplit("/", 1)[0] + query
    return str(Path(target).parent)


@dataclass
class Fetched:
    path: Path          # the bag's local copy (a folder or a storage file)
    bytes: int
    seconds: float
    files: int


def fetch_bag(uri: str, scratch: Path) -> Fetched:
    """Copy the bag at `uri` (a .mcap/.db3 object, or a folder of a rosbag2 bag) into `scratch`.
    InputError naming the URI when nothing is there or a read fails (deleted while read ...)."""
    loc = locate(uri)
    t0 = time.perf_counter()
    info = loc.info()
    if info.type == pafs.FileType.File:
        listing = [info]
    elif info.type == pafs.FileType.Directory:
        listing = loc.files()
        if not listing:
            raise InputError(f"{uri}: no such bag (an empty folder)")
    else:
        raise InputError(f"{uri}: no such bag (nothing at that URI)")
    dest = scratch / loc.name
    if info.type == pafs.FileType.Directory:      # copy_files makes no folders on the local side
        for item in listing:
            (dest / item.path[len(loc.path):].lstrip("/")).parent.mkdir(parents=True, exist_ok=True)
    try:     # a file, or a folder's files to the same relative paths (on threads: many small files)
        pafs.copy_files(loc.path, str(dest), source_filesystem=loc.fs, destination_filesystem=pafs.LocalFileSystem(),
                        chunk_size=CHUNK, use_threads=True)
    except OSError as exc:             # FileNotFoundError included: deleted while being read
        raise InputError(f"{uri}: reading the bag failed ({reason(exc)})") from None
    total = sum(i.size for i in listing)
    return Fetched(dest, total, time.perf_counter() - t0, len(listing))


def scratch_folder() -> Path:
    """A fresh folder on this machine for one bag's copy (LITEVLM_SCRATCH, or the temp folder)."""
    root = os.environ.get("LITEVLM_SCRATCH") or tempfile.gettempdir()
    Path(root).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="litevlm-bag-", dir=root))


def remove_scratch(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def upload_tree(folder: Path, target: Location) -> None:
    """Every file under a local folder to the same relative paths under `target` (a report)."""
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            try:
                target.child(*p.relative_to(folder).parts).write_bytes(p.read_bytes())
            except OSError as exc:
                raise InputError(f"{target.uri}: writing {p.relative_to(folder)} was refused ({reason(exc)})") from None
