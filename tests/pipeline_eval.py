"""Worker entry for a test: build the run's trainer, load its checkpoint and validate once --
forward only, no training step -- then leave the validation loss in ``validation.jsonl``.

Flex attention's backward does not run on CPU (Inductor-CPU compiles its forward only), so this
is how a CPU test takes flex attention through the pipeline: the BlockMask built per microbatch
from the documents' positions reaches every stage as a kwarg through ``WirePipelineStage``, the
schedule's metadata inference included.

    torchrun ... tests/pipeline_eval.py --toml FILE [--section.key value ...]
"""

from __future__ import annotations

import sys

import torch.distributed as dist


def main() -> None:
    from protocol_models.tools import cpu_shim

    cpu_shim.install()  # as protocol_models.train does
    from protocol_models.config.run_config import load_config, split_argv

    config = load_config(*split_argv(sys.argv[1:]))
    trainer = config.build()
    try:
        trainer.checkpointer.load(step=config.checkpoint.load_step)
        trainer.validator.validate(trainer.model_parts, step=trainer.step)
    finally:
        trainer.close()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
