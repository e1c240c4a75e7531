"""Worker entry point: ``torchrun ... -m protocol_models.train --toml FILE [--section.key value]``.

The config is checked before anything else (one ``error:`` line and exit code 2 on bad input);
then TorchTitan's real Trainer runs, as ``torchtitan.train.main`` would run it.
"""

from __future__ import annotations

import os
import sys

import torch

from protocol_models import data
from protocol_models.config import load_config, split_argv
from protocol_models.errors import UserError


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 a user error (config, start-up check, non-finite guard)."""
    try:
        run(*split_argv(sys.argv[1:] if argv is None else argv))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run(toml_path: str | None, overrides: list[str]) -> None:
    config = load_config(toml_path, overrides)

    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    data.register_datasets()
    trainer = config.build()
    try:
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise UserError("checkpoint.create_seed_checkpoint needs a single process")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        # all ranks tear the process group down together: none may still have traffic in flight
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
