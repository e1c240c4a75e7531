"""The NVIDIA driver a torch build needs, and the one this node has.

A torch wheel bundles its CUDA runtime (``torch.version.cuda``), and CUDA's minor-version
compatibility lets any 12.x runtime run on a driver of CUDA 12.0 or newer and any 13.x on one of
13.0 or newer. So the floor depends on the CUDA major version only: the pinned ``torch==2.14.1``
from PyPI is built for CUDA 13.0 and needs driver >= 580.65.06; a node on an R535-R570 driver
(common on rented L4s) needs a CUDA 12 build of the same torch version, which
``PM_TORCH_CUDA=cu128 bash scripts/env.sh`` installs (docs/production.md).
"""

from __future__ import annotations

from pathlib import Path

DRIVER_FLOOR = {12: "525.60.13", 13: "580.65.06"}
"""Oldest Linux driver per CUDA major version (CUDA's minor-version compatibility)."""
DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
"""The loaded kernel module writes ``... Kernel Module  570.86.15 ...`` there."""
CUDA12_BUILD = "cu128"
"""The CUDA 12 build of torch that ``scripts/env.sh`` is pointed at for older drivers."""


def node_driver(path: Path | None = None) -> str | None:
    """This node's NVIDIA driver version (``"570.86.15"``), or None (no driver loaded), from
    ``path`` (default ``DRIVER_VERSION_FILE``)."""
    try:
        text = (path or DRIVER_VERSION_FILE).read_text()
    except OSError:
        return None
    words = text.split("Kernel Module", 1)[-1].split()
    return next((w for w in words if w[0].isdigit() and "." in w), None)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split(".") if part.isdigit())


def driver_floor(cuda: str) -> str | None:
    """The oldest driver that runs a build for CUDA ``cuda`` (``"13.0"``), or None (unknown)."""
    return DRIVER_FLOOR.get(int(cuda.split(".")[0]))


def driver_clause(cuda: str, driver: str | None) -> str:
    """What to tell a user whose CUDA does not start, after "torch X is": the build's floor, this
    node's driver and, when the driver is below the floor but runs CUDA 12, the command that
    installs that build."""
    floor = driver_floor(cuda)
    if floor is None:
        return f"built for CUDA {cuda}"
    clause = f"built for CUDA {cuda}, which needs NVIDIA driver >= {floor}"
    if driver is None:
        return clause + " (no driver is loaded on this node: /proc/driver/nvidia/version)"
    clause += f"; this node's is {driver}"
    if version_tuple(driver) >= version_tuple(floor):
        return clause
    if version_tuple(driver) >= version_tuple(DRIVER_FLOOR[12]):
        return (
            clause + f": update the driver, or install the CUDA 12 build: "
            f"PM_TORCH_CUDA={CUDA12_BUILD} bash scripts/env.sh"
        )
    return clause + ": update the driver"
