"""The BAGS of `litevlm fleet eval`: bag folders, .mcap/.db3 files, or text files listing them.

A list file has one bag per line (blank lines and `#` comments skipped); a relative path in it is
relative to the list file's folder, so a list kept beside the bags on shared storage works from
any machine that mounts it. A path that does not exist stays in the plan: on a fleet of a
thousand drives one missing bag is that bag's failure ("no such bag"), not the run's.

Every bag gets a key: its name plus 8 hex of its absolute path. The key names its partition in
the run's dataset (`answers/bag=KEY/`) and is what `fleet compare` matches two runs on, so two
drives named `bag0` in different folders stay apart, and the same bag in two runs meets itself.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import InputError

STORAGE_SUFFIXES = (".mcap", ".db3")      # what bag.io reads as a bare file
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


@dataclass(frozen=True)
class BagRef:
    path: str       # absolute, normalized (not resolved through symlinks: the name a user gave is kept)
    key: str        # partition name: <name>-<8 hex of the path>

    @property
    def name(self) -> str:
        return Path(self.path).name


def bag_key(path: str | Path) -> str:
    p = Path(path)
    name = p.stem if p.suffix in STORAGE_SUFFIXES else p.name
    digest = hashlib.sha1(str(p).encode()).hexdigest()[:8]
    return f"{_UNSAFE.sub('_', name).strip('._') or 'bag'}-{digest}"


def bag_ref(path: str | Path) -> BagRef:
    p = Path(os.path.normpath(Path(path).expanduser().absolute()))     # x/../y -> y; symlinks kept
    return BagRef(str(p), bag_key(p))


def is_list_file(path: Path) -> bool:
    """A plain file that is not a bag storage file: a list of bags."""
    return path.is_file() and path.suffix not in STORAGE_SUFFIXES


def read_list(path: Path) -> list[Path]:
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise InputError(f"{path}: neither a bag (.mcap, .db3, a rosbag2 folder) nor a text list of bags") from None
    out = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            p = Path(line).expanduser()
            out.append(p if p.is_absolute() else path.parent / p)
    return out


def expand_bags(items: list[str | Path]) -> list[BagRef]:
    """BAGS arguments -> bags in the order given, each once (a bag named twice, by two lists or
    a list and the command line, is evaluated once)."""
    bags: list[BagRef] = []
    seen: set[str] = set()
    for item in items:
        path = Path(item).expanduser()
        for p in read_list(path) if is_list_file(path) else [path]:
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
