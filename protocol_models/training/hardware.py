"""The ``[hardware]`` table and the peak FLOP/s the console's MFU is measured against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from torchtitan.tools.utils import get_peak_flops

from protocol_models.tools.ranges import AT_LEAST_1, POSITIVE, Ranges


@dataclass(kw_only=True, slots=True)
class HardwareSettings:
    """TOML table ``[hardware]``: the device the run trains on, and what the planner checks a
    layout against."""

    device: Literal["cuda", "cpu"] = "cuda"
    """``cuda``: a run stops with one line naming the cause when CUDA is unusable (never a
    silent CPU fallback); ``cpu``: train on CPU over gloo (the CPU configs and tests)."""

    usable_memory_gib: float = 22.5
    """Memory one GPU offers, as the driver reports its total (NVIDIA L4: about 22.5 GiB of its
    24 GB); ``python -m protocol_models.plan`` fails unless every stage's estimate, CUDA
    context included, plus a 10% margin fits in it."""
    peak_tflops: float | None = None
    """Dense bf16 tensor-core peak of one GPU in TFLOP/s, what the console's MFU is measured
    against and the planner predicts step times at ``--mfu`` of (NVIDIA L4 datasheet: 242 with
    sparsity, i.e. 121 dense). Unset (the default): MFU uses TorchTitan's figure for the device
    it detects (``mfu_peak``), the planner assumes an L4 (``cluster.plan.ASSUMED_PEAK_TFLOPS``)."""
    gpus_per_node: int = 8
    """Processes per node; the planner prints which nodes hold which pipeline stage."""

    RANGES: ClassVar[Ranges] = {
        "usable_memory_gib": POSITIVE,
        "peak_tflops": POSITIVE,
        "gpus_per_node": AT_LEAST_1,
    }


TITAN_FALLBACK_FLOPS = 312e12
"""What TorchTitan's ``get_peak_flops`` answers for a device name it does not know: the A100's
peak (``tools.private_api`` checks its source still says so)."""


def mfu_peak(peak_tflops: float | None, device_name: str) -> tuple[float, str]:
    """``(peak FLOP/s, where it comes from)``: what the console's MFU is measured against, and the
    clause the trainer's line names its source with.

    ``peak_tflops`` (``[hardware] peak_tflops``) wins when set. Unset: TorchTitan's own figure
    for ``device_name`` (``get_peak_flops``, the same call its metrics processor makes), where
    ``device_name`` is what TorchTitan's device memory monitor read (``"cpu"`` under the CPU
    shim, where the figure is TorchTitan's fallback and means nothing).
    """
    if peak_tflops is not None:
        return peak_tflops * 1e12, "from [hardware] peak_tflops"
    flops = get_peak_flops(device_name)
    if device_name == "cpu":
        return flops, "TorchTitan's figure for device 'cpu': no GPU, so this MFU means nothing"
    if flops == TITAN_FALLBACK_FLOPS and "A100" not in device_name:
        return flops, (f"TorchTitan's A100 fallback: it has no figure for {device_name!r}; "
                       "set [hardware] peak_tflops")  # fmt: skip
    return flops, f"detected: {device_name}"


__all__ = ["HardwareSettings", "TITAN_FALLBACK_FLOPS", "mfu_peak"]
