"""Error types. Every failure a user can cause has its own type and a message that names the culprit."""

import json
from pathlib import Path


class LiteVLMError(Exception):
    """Base class of every error the runtime raises on purpose."""

    code = "error"


class CheckpointError(LiteVLMError):
    """A model folder is missing, incomplete or inconsistent (message names the file and tensor)."""

    code = "bad_checkpoint"


class InputError(LiteVLMError):
    """A query's input cannot be served: bad image, empty or oversized question, unknown camera."""

    code = "bad_input"


def read_json(path: Path, what: str):
    """A model-folder JSON file's contents; CheckpointError naming the file when unreadable."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable {what} ({exc})") from None
