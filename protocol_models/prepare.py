"""Prepare the data a config reads, before any worker starts (``scripts/train.sh`` runs it).

    python -m protocol_models.prepare                        # the bundled Shakespeare data
    python -m protocol_models.prepare --toml CONFIG [--section.key value ...]   # what CONFIG reads

The bundled corpus and tokenizer are prepared on first use; a map-style corpus
(``streaming = false``) is tokenized once into its cache (``protocol_models.data.loader``).
"""

from __future__ import annotations

import sys

from protocol_models.config.run_config import load_config, split_argv, usage_asked
from protocol_models.data import shakespeare
from protocol_models.data.loader import prepare
from protocol_models.tools.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    """Without ``--toml``: prepare the bundled data. With it: check the config (one ``error:``
    line and exit 2 on bad input), then prepare what it reads."""
    argv = sys.argv[1:] if argv is None else argv
    if usage_asked(argv, __doc__):
        return 0
    toml_path, overrides = split_argv(argv)
    if toml_path is None and not overrides:
        print(f"prepared {shakespeare.prepare(shakespeare.DEFAULT_CACHE)}")
        return 0
    try:
        config = load_config(toml_path, overrides)
        for line in prepare(config):
            print(line)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
