"""What the after-training commands (export, evaluate, generate) share: usage errors and user
errors as one ``error: ...`` line on stderr with exit code 2, never a traceback."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import NoReturn

from protocol_models.tools.errors import UserError


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are a UserError (one line), not usage + error."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)  # an override is never an abbreviation

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; usage: {self.usage}")


def run(body: Callable[[argparse.Namespace], None], parser: Parser, argv: list[str] | None) -> int:
    """Parse ``argv`` and run ``body``: 0 on success, 2 with one ``error:`` line on a
    UserError (bad arguments included). Arguments the parser does not know are the run
    config's ``--section.key value`` overrides (``args.overrides``), allowed with ``--toml``."""
    try:
        args, overrides = parser.parse_known_args(argv)
        if overrides and not getattr(args, "toml", None):
            parser.error(f"unrecognized arguments: {' '.join(overrides)}")
        args.overrides = overrides
        body(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
