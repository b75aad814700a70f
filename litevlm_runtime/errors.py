"""Error types. Every failure a user can cause has its own type and a message that names the culprit."""

import errno
import json
import os
from pathlib import Path


class LiteVLMError(Exception):
    """Base class of every error the runtime raises on purpose."""

    code = "error"


class CheckpointError(LiteVLMError):
    """A model folder is missing, incomplete or inconsistent (message names the file and tensor)."""

    code = "bad_checkpoint"


class InputError(LiteVLMError):
    """Input that cannot be served: bad image, empty or oversized question, unknown camera, a bad
    file or setting. `about` says what it is about, so that callers need not parse the message:
    "image" (with `camera`), "question", "file" (with `path`), or "" (the caller's context says)."""

    code = "bad_input"

    def __init__(self, message: str = "", *, about: str = "", camera: str = "", path=None):
        super().__init__(message)
        self.camera = camera
        self.path = path
        self.about = about or ("image" if camera else "file" if path is not None else "")


def not_a_file(path: Path) -> str:
    """Why `path` is no readable file, in words ("" when it is one): missing, a symlink loop, a
    broken symlink, a folder. Path.is_file() says False to all of them alike, and a symlink loop in a
    model folder was reported as "missing"."""
    path = Path(path)
    try:
        if path.is_file():
            return ""
        os.stat(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            first = os.readlink(path) if path.is_symlink() else "..."
            return f"a symlink loop ({path.name} -> {first} -> ... never reaches a file)"
        if path.is_symlink():
            return f"a broken symlink (to {os.readlink(path)}, which does not exist)"
        if exc.errno == errno.ENOENT:
            return "missing"
        return f"unreadable ({exc.strerror})"
    return "a folder, not a file" if path.is_dir() else "not a regular file"


def read_json(path: Path, what: str):
    """A model-folder JSON file's contents; CheckpointError naming the file when unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable {what} ({exc})") from None
