"""User-facing errors: reported as one ``error: ...`` line and a non-zero exit, no traceback."""

import re

import torch.distributed as dist

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


class LinkFault(Exception):
    """A peer went silent or its connection broke (``training.stall_watch``, ``wire.stage``);
    ``str(e)`` is one line. Not a ``UserError``: a restart from the last complete checkpoint
    recovers, so ``protocol_models.launch`` restarts the run (``--max-restarts``)."""


def as_link_fault(error: BaseException, what: str) -> LinkFault | None:
    """``error`` as a ``LinkFault`` about ``what`` ("step 21: a pipeline send"), when it is a
    communication failure -- a ``torch.distributed.DistError`` or gloo's ``RuntimeError`` (a
    connection closed, reset or timed out) -- else None (a bug: raised as it is)."""
    text = str(error).strip()
    if not (isinstance(error, dist.DistError) or "/gloo/" in text):
        return None
    line = text.splitlines()[0] if text else type(error).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", line).split(". This is typically")[0]  # gloo's prefix
    return LinkFault(f"{what} failed ({line[:200]}); restarting from the last complete checkpoint "
                     "(needs --max-restarts)")  # fmt: skip
