"""Run TorchTitan's real Trainer on a machine without an accelerator.

TorchTitan 0.3.0 resolves ``device_type``/``device_module`` once, at import time of
``torchtitan.tools.utils``, and falls back to ``"cuda"`` when no accelerator exists. About eight
modules then re-export those names. This shim must therefore run before any other torchtitan
import: it imports ``torchtitan.tools.utils`` alone, and if no accelerator is present rebinds the
two names to ``"cpu"`` and a small stand-in for ``torch.cuda``'s device-module interface. With an
accelerator present it does nothing.
"""

from __future__ import annotations

import os
import resource
import sys
import types

import torch

_PATCHED_AFTER = "torchtitan.trainer"


def _peak_rss_stats(device=None) -> dict[str, int]:
    """Peak resident memory of this process, reported where TorchTitan reads peak device memory."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}


def _cpu_device_module() -> types.SimpleNamespace:
    """The subset of a ``torch.cuda``-like module that TorchTitan calls."""
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        is_available=lambda: True,
        synchronize=lambda device=None: None,
        empty_cache=lambda: None,
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=total_memory),
        memory_stats=_peak_rss_stats,
        reset_peak_memory_stats=lambda device=None: None,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )


def install() -> str:
    """Make TorchTitan target the CPU when no accelerator exists; return the device type.

    Raises if TorchTitan modules that captured the old device binding are already imported.
    """
    if torch.accelerator.is_available():
        return torch.accelerator.current_accelerator().type
    if _PATCHED_AFTER in sys.modules:
        raise RuntimeError(
            "protocol_models.cpu_shim.install() must run before torchtitan.trainer is imported"
        )
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = _cpu_device_module()
    return "cpu"
