"""Run by ``test_private_api.py`` in a fresh interpreter: import every module of the package and
print, one per line, each attribute of an already imported torch or TorchTitan module that the
imports rebound or deleted (nothing: importing the plugin changes nothing in them).

    python tests/import_purity.py [--plant]
    PM_NCCL_RULES=1 torchrun --nproc-per-node 2 tests/import_purity.py --emulate [--plant]

``--plant`` then replaces ``torchtitan.distributed.utils.clip_grad_norm_``, as the plugin once
did for each step: the check must see that. ``--emulate`` (``test_nccl_rules.py``) checks the
NCCL emulation instead: after the CPU binding (``cpu_shim.install``, as a worker does first), it
creates the world group on the emulated backend (plain gloo without ``PM_NCCL_RULES``: torch's
own set-up rebinds a few of its globals either way) and runs collectives, single and batched
point-to-point ops and TorchTitan's device-wide waits; rank 0 prints the backends torch's
registry gained (``registry: NAME``) and what was rebound. There ``--plant`` replaces
``torch.distributed.batch_isend_irecv``, as the emulation once did.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import types


def snapshot() -> dict[str, dict[str, int]]:
    """The identity of every attribute of every imported torch and TorchTitan module."""
    return {
        name: {key: id(value) for key, value in list(vars(module).items())}
        for name, module in list(sys.modules.items())
        if name.split(".")[0] in ("torch", "torchtitan") and isinstance(module, types.ModuleType)
    }


def import_dependencies() -> None:
    """Every module of torch and TorchTitan the plugin relies on."""
    from protocol_models.tools import private_api

    for dependency in private_api.DEPENDENCIES:
        importlib.import_module(dependency.symbol.partition(":")[0])


def import_plugin() -> None:
    """Every module of the plugin."""
    import protocol_models

    for info in pkgutil.walk_packages(protocol_models.__path__, "protocol_models."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)


def emulate() -> None:
    """Traffic of every kind on the emulated NCCL backend, or gloo (2 ranks)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torchtitan.tools.utils as titan_utils

    from protocol_models.tools import nccl_rules

    if nccl_rules.enabled():
        nccl_rules.init_process_group(timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    group, peer = dist.new_group([0, 1]), 1 - dist.get_rank()
    x, y = torch.ones(4), torch.zeros(4)
    dist.all_reduce(x)
    dist.all_gather_object([None, None], dist.get_rank())
    (dist.isend(x, peer, group) if dist.get_rank() == 0 else dist.irecv(y, peer, group)).wait()
    for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, group),
                                        dist.P2POp(dist.irecv, y, peer, group)]):  # fmt: skip
        work.wait()
    titan_utils.device_module.synchronize()
    titan_utils.device_module.empty_cache()
    dist.barrier()


def main() -> None:
    import torch.distributed as dist

    if "--emulate" in sys.argv:
        from protocol_models.tools import cpu_shim

        cpu_shim.install()
        import_dependencies()
        import_plugin()
        backends = set(dist.Backend.backend_list)
        before = snapshot()
        emulate()
        if dist.get_rank() == 0:
            print("".join(f"registry: {name}\n" for name in dist.Backend.backend_list
                          if name not in backends), end="")  # fmt: skip
        if "--plant" in sys.argv:
            dist.batch_isend_irecv = lambda ops: []
    else:
        import_dependencies()
        before = snapshot()
        import_plugin()
        if "--plant" in sys.argv:
            from torchtitan.distributed import utils

            utils.clip_grad_norm_ = lambda *args, **kwargs: None
    after = snapshot()
    if "--emulate" in sys.argv and dist.get_rank() != 0:
        return
    for module, attributes in before.items():
        for key, identity in attributes.items():
            if key not in after[module]:
                print(f"{module}.{key} deleted")
            elif after[module][key] != identity:
                print(f"{module}.{key} rebound")


if __name__ == "__main__":
    main()
    if "--emulate" in sys.argv:  # the emulation's threads hold c10d objects: no teardown
        import os

        sys.stdout.flush()
        os._exit(0)
