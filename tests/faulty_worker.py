"""Worker entry for a test: ``protocol_models.train`` with one fault injected, chosen by the
environment variable ``FAULT`` (nothing on CPU fails on one rank only):

* ``device`` (default): global rank 0 fails at step 2 with a device error, as a GPU with a
  hardware fault would;
* ``data``: global rank 1 trains on shifted token ids, as a node with another copy of the data
  would.

    FAULT=... torchrun ... tests/faulty_worker.py --toml FILE [--section.key value ...]
"""

from __future__ import annotations

import os
import sys

FAULT = "CUDA error: an illegal memory access was encountered (simulated on rank 0)"


def main() -> int:
    from protocol_models import train
    from protocol_models.tools import cpu_shim

    cpu_shim.install()  # as train.main does, before the trainer is imported here
    from protocol_models.training.trainer import ProtocolTrainer

    if os.environ.get("FAULT", "device") == "data":
        post_dataloading_process = ProtocolTrainer.post_dataloading_process

        def other_data(self: ProtocolTrainer, input_dict, labels):
            if os.environ.get("RANK") == "1":
                input_dict["input"] = input_dict["input"].roll(1, dims=-1)
            return post_dataloading_process(self, input_dict, labels)

        ProtocolTrainer.post_dataloading_process = other_data
    else:
        train_step = ProtocolTrainer.train_step

        def faulty_train_step(self: ProtocolTrainer, data_iterator):
            if os.environ.get("RANK") == "0" and self.step == 2:
                raise RuntimeError(FAULT)
            return train_step(self, data_iterator)

        ProtocolTrainer.train_step = faulty_train_step
    return train.main()


if __name__ == "__main__":
    sys.exit(main())
