"""Worker entry point: ``torchrun ... -m protocol_models.train --toml FILE [--section.key value]``.

A CPU worker first binds TorchTitan to the CPU (``tools.cpu_shim.install``: the launch's explicit
opt-in, before any TorchTitan module that reads the device is imported). The config is checked
before anything else (one ``error:`` line and exit code 2 on bad input); then TorchTitan's real
Trainer runs, as ``torchtitan.train.main`` would run it. Every error,
user error or bug, is also recorded in torchelastic's per-worker error file, from which the
launcher (``protocol_models.launch``) reports the first failing rank even when its output is
hidden by the log filter.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import get_error_handler, record

from protocol_models.config.toml_tables import usage_asked
from protocol_models.tools import cpu_shim
from protocol_models.tools.errors import USER_ERROR_FILE_ENV, LinkFault, UserError


@record  # a bug's traceback goes to the error file (and is raised on)
def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 done, 2 a user error (config, start-up check, non-finite guard; left in
    ``PROTOCOL_MODELS_USER_ERROR_FILE`` when the launcher set it, so that it is not restarted),
    3 a silent or broken peer (``LinkFault``: one line, restarted by ``--max-restarts``)."""
    argv = sys.argv[1:] if argv is None else argv
    if usage_asked(argv, __doc__):
        return 0
    cpu_shim.install()
    from protocol_models.config.run_config import split_argv
    from protocol_models.training.stall_watch import end_worker

    try:
        run(*split_argv(argv))
    except LinkFault as e:  # a peer went silent or its connection broke: a restart recovers
        end_worker(e)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        get_error_handler().record_exception(e)  # a no-op outside torchelastic
        if os.environ.get(USER_ERROR_FILE_ENV):  # the launcher ends the run: no restart
            with open(os.environ[USER_ERROR_FILE_ENV], "w") as f:
                f.write(str(e))
        return 2
    return 0


def exit_now(code: int) -> None:
    """End the worker without interpreter finalization, once everything is flushed.

    A finished run has torn its process groups down on every rank together, but the trainer
    graph (pipeline stages and their point-to-point ``Work`` objects, the device mesh's groups,
    dataloader state) sits in reference cycles that Python frees only in its final garbage
    collection, while the interpreter is being torn down. A c10d object destroyed then, holding
    Python references or a joinable thread, aborts the process ("terminate called without an
    active exception", SIGABRT) after "Training completed" was printed: a finished job looks
    failed, and ``MAX_RESTARTS`` would restart it. Leaving with ``os._exit`` after flushing the
    logs and streams closes that window: no C++ destructor runs once the interpreter is half
    gone. (Every error path keeps the normal exit: tracebacks and error records are written.)
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run(toml_path: str | None, overrides: list[str]) -> None:
    """Check the config, build the trainer and train (or write the seed checkpoint)."""
    from torchtitan.tools.logging import init_logger, logger

    from protocol_models.cluster import fsdp_probe, gpu_check
    from protocol_models.config.run_config import load_config
    from protocol_models.training import console

    config = load_config(toml_path, overrides, worker=True)
    init_logger()
    console.quiet_misleading(logger)
    memory = gpu_check.DeviceMemoryProbe.from_env(config.dump_folder)  # gpu_check on CUDA only
    if memory is not None:
        memory.mark(gpu_check.PHASES[0])
    trainer = config.build()
    if memory is not None:
        memory.mark(gpu_check.PHASES[1])
        memory.after_first_step(trainer)
    try:
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise UserError("checkpoint.create_seed_checkpoint needs a single process")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
            if os.environ.get(fsdp_probe.FSDP_PROBE_ENV) == "1":  # scripts/gpu_check.sh
                fsdp_probe.measure(trainer)
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        # all ranks tear the process group down together: none may still have traffic in flight
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    exit_now(main())
