"""``torchrun`` for this plugin: ``python -m protocol_models.launch [torchrun args]``.

Same arguments as ``torchrun``; two differences. Restarts (``--max-restarts``) get a fresh
rendezvous store per attempt (see ``main``), and a failed job ends with one summary line rather
than the launcher's own Python traceback.

Workers report their own errors (one ``error:`` line for user errors, a full traceback for bugs).
When a worker fails, torchrun itself raises ``ChildFailedError`` and prints a Python traceback of
the launcher; this wrapper prints one summary line instead and exits with the worker's code.
"""

from __future__ import annotations

import os
import sys
import tempfile

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import main as torchrun_main


def main(argv: list[str] | None = None) -> int:
    # A restarted worker group must not reuse the rendezvous' shared TCPStore: its keys from the
    # previous attempt (e.g. gloo peer addresses) are still there and race with the new ones,
    # so a restart after a killed worker can fail to connect. Without sharing, every attempt
    # gets a fresh store on a fresh port.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # where torchelastic copies a failed worker's error record (else it logs that it has none)
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(tempfile.mkdtemp(), "error.json"))
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        print(
            f"error: worker rank {rank} exited with code {failure.exitcode} "
            f"(its messages are above)",
            file=sys.stderr,
        )
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
