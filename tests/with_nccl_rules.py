"""Run a torch-only script on the emulated NCCL backend (``tools.nccl_rules``), as a worker of
``torchrun``: ``torchrun ... tests/with_nccl_rules.py SCRIPT [ARGS ...] --backend nccl_rules``
with ``PM_NCCL_RULES`` set: the backend is registered in torch's registry first, and the script
creates its groups on it. A broken rule is one ``error: NCCL rule ...`` line and exit code 2."""

from __future__ import annotations

import os
import runpy
import sys

from protocol_models.tools import nccl_rules

if __name__ == "__main__":
    nccl_rules.register()
    script, sys.argv = sys.argv[1], sys.argv[1:]
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except nccl_rules.NcclRuleBroken as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the rules' threads hold c10d objects: no interpreter teardown
