"""What FSDP's collectives inside a stage cost on this cluster's network, for ``gpu_check``.

Under pipeline parallelism TorchTitan keeps a stage's parameters unsharded from its first
forward to its last backward (``fsdp_reshard_after_forward = "default"``), so FSDP runs, per
step and stage, one all-gather of the stage's parameters in the compute dtype and one
reduce-scatter of their gradients in the reduce dtype over the stage's FSDP group (with
``"always"``: an all-gather in every microbatch's forward and backward). The planner does not
count that time, and the network NCCL uses for it is decided per process (``NCCL_IB_DISABLE=1``,
set for the links between regions, moves it to TCP on a node with InfiniBand).

``measure`` runs after the check run's last step on every rank: each FSDP group times those two
collectives at the run's real sizes, dtypes and groups (the median of ``REPEATS``, each
bracketed by a device synchronize: the time they take alone, an upper bound on what they add to
a step when not overlapped with compute), and the metrics rank writes one row per pipeline stage
to ``<dump_folder>/fsdp_probe.json``. ``scripts/gpu_check.sh`` turns it on
(``PROTOCOL_MODELS_FSDP_PROBE=1``) and prints the rows.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.fsdp import get_fsdp_reshard_after_forward_policy

from protocol_models.tools import gather

FSDP_PROBE_ENV = "PROTOCOL_MODELS_FSDP_PROBE"
"""Set to 1 (by ``gpu_check``) to measure FSDP's collectives after the run's last step."""
FILE_NAME = "fsdp_probe.json"
REPEATS = 3


def shard_group(model_parts) -> tuple[dist.ProcessGroup, int] | None:
    """The process group over which this rank's parameters are sharded, and this rank's shard
    elements in all (None: no parameter is sharded over more than one rank)."""
    group, local = None, 0
    for part in model_parts:
        for param in part.parameters():
            if not isinstance(param, DTensor):
                continue
            dims = [i for i, p in enumerate(param.placements) if p.is_shard()]
            if not dims or param.device_mesh.size(dims[0]) == 1:
                continue
            group = param.device_mesh.get_group(dims[0])
            local += param.to_local().numel()
    return (group, local) if group is not None else None


def _median_seconds(run, device: torch.device) -> float:
    """Median wall time of ``REPEATS`` calls of ``run`` after one warm-up call, each bracketed
    by a device synchronize (on CPU the collectives are synchronous)."""
    times = []
    for _ in range(REPEATS + 1):
        _synchronize(device)
        start = time.perf_counter()
        run()
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _synchronize(device: torch.device) -> None:
    """Until the current stream's work is done (a collective's ``wait()`` made it wait for the
    collective), not the whole device's: no device-wide wait anywhere in the plugin."""
    if device.type != "cpu":
        torch.accelerator.current_stream(device).synchronize()


def time_collectives(group: dist.ProcessGroup, local: int, device: torch.device,
                     param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> dict:  # fmt: skip
    """One all-gather of ``local`` elements per rank in ``param_dtype`` and one reduce-scatter of
    the gathered size in ``reduce_dtype`` over ``group``: bytes (the gathered tensor's) and
    median seconds."""
    ranks = dist.get_world_size(group)
    gather_bytes, gather_s = _time_one(dist.all_gather_single, local, local * ranks, param_dtype,
                                       group, device)  # fmt: skip
    scatter_bytes, scatter_s = _time_one(dist.reduce_scatter_single, local * ranks, local,
                                         reduce_dtype, group, device)  # fmt: skip
    return {
        "ranks": ranks,
        "backend": str(dist.get_backend(group)),
        "all_gather_bytes": gather_bytes,
        "all_gather_s": gather_s,
        "reduce_scatter_bytes": scatter_bytes,
        "reduce_scatter_s": scatter_s,
    }


def _time_one(collective, inputs: int, outputs: int, dtype: torch.dtype,
              group: dist.ProcessGroup, device: torch.device) -> tuple[int, float]:  # fmt: skip
    """``collective(output, input, group=group)`` on buffers of ``outputs``/``inputs`` elements:
    the larger buffer's bytes and the median seconds. The buffers live only for this call, so
    the probe never holds more than one collective's (at most a step's unsharded gradients)."""
    source = torch.zeros(inputs, dtype=dtype, device=device)
    target = torch.empty(outputs, dtype=dtype, device=device)
    seconds = _median_seconds(lambda: collective(target, source, group=group), device)
    return max(inputs, outputs) * source.element_size(), seconds


def all_gathers_per_step(config) -> int:
    """FSDP all-gathers of a stage's parameters per step (see the module docstring)."""
    par = config.parallelism
    pp = par.pipeline_parallel_degree > 1
    if not get_fsdp_reshard_after_forward_policy(par.fsdp_reshard_after_forward, pp):
        return 1
    microbatches = config.training.local_batch_size // par.pipeline_parallel_microbatch_size
    return 2 * microbatches if pp else 2


def measure(trainer) -> None:
    """Every rank, after training: time this rank's FSDP group's collectives; the metrics rank
    (the last stage's first, where ``metrics.jsonl`` is) writes every stage's row. A run
    without FSDP sharding writes an empty list."""
    from protocol_models.training.metrics import metrics_rank

    config, dims = trainer.config, trainer.parallel_dims
    found = shard_group(trainer.model_parts)
    row = None
    if found is not None:
        training = config.training
        row = time_collectives(
            *found,
            trainer.device,
            TORCH_DTYPE_MAP[training.mixed_precision_param],
            TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        )
        row["stage"] = dims.get_mesh("pp").get_local_rank() if dims.pp_enabled else 0
        row["all_gathers_per_step"] = all_gathers_per_step(config)
        row["nccl_ib_disable"] = os.environ.get("NCCL_IB_DISABLE") == "1"
    everyone = gather.all_gather_json(row)
    if dist.get_rank() != metrics_rank(dims):
        return
    by_stage = {r["stage"]: r for r in everyone if r is not None}  # a stage's ranks agree
    rows = [by_stage[s] for s in sorted(by_stage)]
    Path(config.dump_folder, FILE_NAME).write_text(json.dumps(rows, indent=1))


def seconds_per_step(row: dict) -> float:
    """A stage's FSDP collectives per step, measured one after another."""
    return row["all_gathers_per_step"] * row["all_gather_s"] + row["reduce_scatter_s"]


def _network(row: dict) -> str:
    if row["backend"] != "nccl":
        return f"{row['backend']}"
    return "NCCL over TCP: NCCL_IB_DISABLE=1" if row["nccl_ib_disable"] else "NCCL"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.2f} MB"


def render(rows: list[dict], step_s: float) -> list[str]:
    """``gpu_check``'s lines for ``fsdp_probe.json``'s rows, next to the measured step time."""
    lines = []
    for row in rows:
        alone = seconds_per_step(row)
        lines.append(
            f"FSDP stage {row['stage']} ({row['ranks']} ranks, {_network(row)}): "
            f"{row['all_gathers_per_step']} x all-gather {_size(row['all_gather_bytes'])} in "
            f"{row['all_gather_s'] * 1e3:.1f} ms + reduce-scatter "
            f"{_size(row['reduce_scatter_bytes'])} in {row['reduce_scatter_s'] * 1e3:.1f} ms = "
            f"{alone:.3g} s per step when not overlapped ({alone / step_s:.0%} of the measured "
            f"{step_s:.3g} s step)"
        )
    return lines
