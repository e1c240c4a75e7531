"""Run TorchTitan's real Trainer on a machine without an accelerator: an explicit opt-in at
launch, never an import side effect.

TorchTitan 0.3.0 resolves ``device_type``/``device_module`` once, at import time of
``torchtitan.tools.utils``, and falls back to ``"cuda"`` when no accelerator exists. About eight
modules then re-export those names, and TorchTitan offers no setting for the device. So a CPU
worker calls ``install`` first thing (``protocol_models.train`` does, before it imports the
trainer): it imports ``torchtitan.tools.utils`` alone and, when the launch asks for the CPU
(``PROTOCOL_MODELS_DEVICE=cpu``, which ``scripts/train.sh`` sets for ``[hardware] device =
"cpu"``) or no accelerator exists, rebinds the two names to ``"cpu"`` and a small stand-in for
``torch.cuda``'s device-module interface. It is the one assignment to another package's
attribute; the tests pin it.

Binding is not permission: ``check_device`` (run by the config check, before any worker, and in
every worker) refuses to train on the CPU unless the config says ``[hardware] device = "cpu"``,
so a GPU node whose CUDA is broken stops with the driver's own reason instead of quietly
training on CPU.
"""

from __future__ import annotations

import os
import resource
import sys
import types

import torch

from protocol_models.tools import nccl_rules
from protocol_models.tools.errors import ConfigError

_PATCHED_AFTER = "torchtitan.trainer"
DEVICE_ENV = "PROTOCOL_MODELS_DEVICE"


def _peak_rss_stats(device=None) -> dict[str, int]:
    """Peak resident memory of this process, reported where TorchTitan reads peak device memory."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak}


def _cpu_device_module() -> types.SimpleNamespace:
    """The subset of a ``torch.cuda``-like module that TorchTitan calls. Its device-wide waits
    (``synchronize``, ``empty_cache``) wait for nothing on the CPU, except under the NCCL
    emulation (``tools.nccl_rules``, rule R6): for every point-to-point op still pending."""
    total_memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return types.SimpleNamespace(
        set_device=lambda device: None,
        current_device=lambda: 0,
        device_count=lambda: 1,
        is_available=lambda: True,
        synchronize=lambda device=None: nccl_rules.device_wide_wait(),
        empty_cache=nccl_rules.device_wide_wait,  # CUDA's frees cached blocks: a device sync
        get_device_name=lambda device=None: "cpu",
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=total_memory),
        memory_stats=_peak_rss_stats,
        reset_peak_memory_stats=lambda device=None: None,
        manual_seed=torch.manual_seed,
        manual_seed_all=torch.manual_seed,
    )


def bound_device() -> str:
    """The device type TorchTitan is bound to in this process (``cpu`` after ``install``)."""
    import torchtitan.tools.utils as titan_utils

    return titan_utils.device_type


def launch_device() -> str:
    """The device type a worker launched in this environment binds TorchTitan to: ``cpu`` when
    the launch asks for it (``PROTOCOL_MODELS_DEVICE=cpu``) or no accelerator exists, else the
    accelerator's. The config check compares ``[hardware] device`` with it before any worker
    starts."""
    if torch.accelerator.is_available() and os.environ.get(DEVICE_ENV) != "cpu":
        return torch.accelerator.current_accelerator().type
    return "cpu"


def install() -> str:
    """Bind TorchTitan to the CPU when ``launch_device`` says so (a no-op otherwise); return the
    device type. Whether the run may use it is ``check_device``'s call.

    Raises if TorchTitan modules that captured the old device binding are already imported (a
    second call once bound is a no-op).
    """
    device = launch_device()
    if device != "cpu" or bound_device() == "cpu":  # nothing to bind, or bound already
        return device
    if _PATCHED_AFTER in sys.modules:
        raise RuntimeError(
            "protocol_models.tools.cpu_shim.install() must run before torchtitan.trainer is "
            "imported"
        )
    import torchtitan.tools.utils as titan_utils

    titan_utils.device_type = "cpu"
    titan_utils.device_module = _cpu_device_module()
    return "cpu"


def gloo_fsdp_reductions(model: torch.nn.Module) -> None:
    """On CPU, FSDP's gradient reduce-scatters run on gloo, which has no ``PREMUL_SUM``; FSDP uses
    it for a gradient divide factor (TorchTitan sets one) in fp32/bf16. Every FSDP module of
    ``model`` then reduces with ``SUM`` and divides before and after (FSDP's own fp16 form: the
    same mean). A GPU run (NCCL) keeps FSDP's default."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def check_device(requested: str, bound: str) -> None:
    """Refuse a run whose ``[hardware] device`` (``requested``) is not the device TorchTitan
    was bound to at import (``bound``), with one line naming the cause and the fix. A CPU config
    checked on a GPU machine outside a worker (the config check, ``gpu_check``'s parent) passes:
    ``scripts/train.sh`` binds its workers to the CPU."""
    if requested == bound:
        return
    if requested == "cpu":
        if "LOCAL_RANK" not in os.environ:
            return  # a config check or planner process: it trains nothing
        raise ConfigError(
            f"hardware.device = 'cpu', but this worker bound TorchTitan to {bound!r}: set "
            f"{DEVICE_ENV}=cpu in the workers' environment (scripts/train.sh does)"
        )
    raise ConfigError(
        f"hardware.device = {requested!r}, but {_cuda_problem()}; fix that, or set "
        "hardware.device = 'cpu' to train on the CPU on purpose"
    )


def _cuda_problem() -> str:
    """Why CUDA is unusable here, in one clause."""
    if os.environ.get(DEVICE_ENV) == "cpu":
        return f"{DEVICE_ENV}=cpu is set in the environment"
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a build without CUDA (install its CUDA wheel)"
    try:
        torch.cuda.init()
    except Exception as e:  # the driver's own words: missing, too old, no device
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    else:
        cause = "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"
    from protocol_models.tools.cuda_driver import driver_clause, node_driver

    build = driver_clause(torch.version.cuda, node_driver())
    return f"CUDA is unusable: {cause} (torch {torch.__version__} is {build})"
