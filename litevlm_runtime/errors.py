"""Error types. Every failure a user can cause has its own type and a message that names the culprit."""


class LiteVLMError(Exception):
    """Base class of every error the runtime raises on purpose."""

    code = "error"


class CheckpointError(LiteVLMError):
    """A model folder is missing, incomplete or inconsistent (message names the file and tensor)."""

    code = "bad_checkpoint"


class InputError(LiteVLMError):
    """A query's input cannot be served: bad image, empty or oversized question, unknown camera."""

    code = "bad_input"
