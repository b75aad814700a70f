"""The BAGS of `litevlm fleet eval`: bag folders, .mcap/.db3 files, or text files listing them, each
a local path or a URI (s3://bucket/drives/bag1, gs://..., file://...; storage.py).

A list file has one bag per line (blank lines and `#` comments skipped); a relative entry in it is
relative to the list file's folder (on object storage too: s3://b/release/bags.txt listing `bag1`
means s3://b/release/bag1), so a list kept beside the bags works from any machine. A bag that
does not exist stays in the plan: on a fleet of a thousand drives one missing bag is that bag's
failure ("no such bag"), not the run's. The driver only looks at the arguments themselves (is
this a list?); the bags' bytes are read by the workers (worker.py), never by the driver.

Every bag gets a key: its name plus 8 hex of its absolute path or URI. The key names its partition in
the run's dataset (`answers/bag=KEY/`) and is what `fleet compare` matches two runs on, so two
drives named `bag0` in different folders stay apart, and the same bag in two runs meets itself.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError
from .storage import is_uri, join, locate, parent, reason

STORAGE_SUFFIXES = (".mcap", ".db3")      # what bag.io reads as a bare file
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class BagRef:
    path: str       # a URI, or an absolute normalized local path (symlinks kept: the name a user gave)
    key: str        # partition name: <name>-<8 hex of the path>

    @property
    def name(self) -> str:
        return self.path.partition("?")[0].rstrip("/").rsplit("/", 1)[-1]

    @property
    def remote(self) -> bool:
        """On storage a worker reads through a filesystem client (fetched to its scratch first)."""
        return is_uri(self.path)


def bag_key(path: str | Path) -> str:
    name = str(path).partition("?")[0].rstrip("/").rsplit("/", 1)[-1]
    stem, dot, suffix = name.rpartition(".")
    if dot and f".{suffix}" in STORAGE_SUFFIXES:
        name = stem
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    return f"{_UNSAFE.sub('_', name).strip('._') or 'bag'}-{digest}"


def bag_ref(path: str | Path) -> BagRef:
    """file:// URIs and local paths become absolute normalized paths; other URIs are kept as given
    (less a trailing /)."""
    text = str(path)
    if is_uri(text) and not text.lower().startswith("file://"):
        base, sep, query = text.partition("?")
        uri = base.rstrip("/") + sep + query           # (no filesystem made: planning stays offline)
    else:
        uri = locate(text).uri
    return BagRef(uri, bag_key(uri))


def is_list_file(target: str) -> bool:
    """A plain file (or object) that is not a bag storage file: a list of bags."""
    loc = locate(target)
    return not loc.name.endswith(STORAGE_SUFFIXES) and loc.is_file()


def read_list(target: str) -> list[str]:
    loc = locate(target)
    try:
        text = loc.read_bytes().decode()
    except UnicodeDecodeError:
        raise InputError(f"{target}: neither a bag (.mcap, .db3, a rosbag2 folder) nor a text list of bags") from None
    except OSError as exc:
        raise InputError(f"{target}: cannot read the list ({reason(exc)})") from None
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(join(parent(loc.uri), line if is_uri(line) else str(Path(line).expanduser())))
    return out


def expand_bags(items: list[str | Path]) -> list[BagRef]:
    """BAGS arguments -> bags in the order given, each once (a bag named twice, by two lists or
    a list and the command line, is evaluated once)."""
    bags: list[BagRef] = []
    seen: set[str] = set()
    for item in items:
        item = str(item)
        for p in read_list(item) if is_list_file(item) else [item]:
            ref = bag_ref(p)
            if ref.path not in seen:
                seen.add(ref.path)
                bags.append(ref)
    if not bags:
        raise InputError("no bags given (the list files are empty)")
    keys: dict[str, str] = {}
    for b in bags:          # 8 hex of the path: a collision is a 1-in-4-billion event, but say so
        if keys.setdefault(b.key, b.path) != b.path:
            raise InputError(f"bags {keys[b.key]} and {b.path} have the same key {b.key}; rename one")
    return bags
