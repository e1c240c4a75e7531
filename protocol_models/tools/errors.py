"""User-facing errors: reported as one ``error: ...`` line and a non-zero exit, no traceback."""

USER_ERROR_FILE_ENV = "PROTOCOL_MODELS_USER_ERROR_FILE"
"""Where a worker leaves its user error's line for ``protocol_models.launch`` (which then ends
the run instead of restarting it)."""


class UserError(Exception):
    """A problem with the run's input or state that the user can fix; ``str(e)`` is one line."""


class ConfigError(UserError, ValueError):
    """A bad TOML key, type or value (found before any worker starts)."""


class StartupError(UserError):
    """The pipeline stages disagree about something they must share (found at start-up)."""


class NonFiniteError(UserError):
    """A non-finite loss or gradient norm stopped the run (the last good checkpoint is kept)."""


class DataError(UserError):
    """The training data, as read: a shard without documents, a record without the text field,
    pipeline stages that trained on different token ids (found while training)."""


def require(ok: object, message: str) -> None:
    """Raise ``ConfigError(message)`` unless ``ok``."""
    if not ok:
        raise ConfigError(message)
