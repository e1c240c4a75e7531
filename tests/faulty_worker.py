"""Worker entry for a test: ``protocol_models.train``, except that global rank 0 fails at step 2
with a device error, as a GPU with a hardware fault would (nothing on CPU fails on one rank only).

    torchrun ... tests/faulty_worker.py --toml FILE [--section.key value ...]
"""

from __future__ import annotations

import os
import sys

FAULT = "CUDA error: an illegal memory access was encountered (simulated on rank 0)"


def main() -> int:
    from protocol_models import train
    from protocol_models.trainer import ProtocolTrainer

    train_step = ProtocolTrainer.train_step

    def faulty_train_step(self: ProtocolTrainer, data_iterator):
        if os.environ.get("RANK") == "0" and self.step == 2:
            raise RuntimeError(FAULT)
        return train_step(self, data_iterator)

    ProtocolTrainer.train_step = faulty_train_step
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
