"""Run by ``test_private_api.py`` in a fresh interpreter: import every module of the package and
print, one per line, each attribute of an already imported torch or TorchTitan module that the
imports rebound or deleted (nothing: importing the plugin changes nothing in them).

    python tests/import_purity.py [--plant]

``--plant`` then replaces ``torchtitan.distributed.utils.clip_grad_norm_``, as the plugin once
did for each step: the check must see that.
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


def main() -> None:
    import torch.distributed  # noqa: F401

    import protocol_models
    from protocol_models.tools import private_api

    for dependency in private_api.DEPENDENCIES:  # every module the plugin relies on, first
        importlib.import_module(dependency.symbol.partition(":")[0])
    before = snapshot()
    for info in pkgutil.walk_packages(protocol_models.__path__, "protocol_models."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    if "--plant" in sys.argv:
        from torchtitan.distributed import utils

        utils.clip_grad_norm_ = lambda *args, **kwargs: None
    after = snapshot()
    for module, attributes in before.items():
        for key, identity in attributes.items():
            if key not in after[module]:
                print(f"{module}.{key} deleted")
            elif after[module][key] != identity:
                print(f"{module}.{key} rebound")


if __name__ == "__main__":
    main()
