"""The declared ranges of the TOML tables whose dataclass is TorchTitan's (``[training]``,
``[parallelism]``, ``[lr_scheduler]``, ``[comm]``, ``[profiler]``, ``[compile]``, ``[debug]``),
keyed by table and key; the mechanism and the plugin's own tables: ``protocol_models.tools.ranges``.

The ranges are what TorchTitan 0.3.0 can run, with its sentinels: ``training.global_batch_size
= -1`` and ``parallelism.data_parallel_shard_degree = -1`` infer the value, ``training.max_norm =
inf`` clips nothing, ``comm.trace_buf_size = 0`` turns the flight recorder off and
``profiler.profiler_repeat = 0`` profiles until the run ends. ``lr_scheduler.warmup_steps`` may
exceed the steps: TorchTitan then warms up over all of them.
"""

from __future__ import annotations

import math

from protocol_models.tools.ranges import (
    AT_LEAST_0,
    AT_LEAST_1,
    FRACTION,
    SECONDS,
    SEED,
    OneOf,
    Range,
    Ranges,
)
from protocol_models.wire.pipeline import SCHEDULES


def _compile_backends() -> list[str]:
    """``torch.compile``'s registered backends, the debugging ones (``eager``) included."""
    import torch._dynamo

    return torch._dynamo.list_backends(exclude_tags=())


TORCHTITAN_RANGES: dict[str, Ranges] = {
    "training": {
        "local_batch_size": AT_LEAST_1,
        "global_batch_size": Range(
            low=1, also=(-1,), note="-1 = local_batch_size x the data-parallel degree"
        ),
        "seq_len": AT_LEAST_1,
        "max_norm": Range(low=0, low_open=True, also=(math.inf,), note="inf = no clipping"),
        "steps": AT_LEAST_1,
        "gc_freq": AT_LEAST_1,
    },
    "parallelism": {
        "data_parallel_replicate_degree": AT_LEAST_1,
        "data_parallel_shard_degree": Range(low=1, also=(-1,), note="-1 = the ranks left over"),
        "tensor_parallel_degree": AT_LEAST_1,
        "pipeline_parallel_degree": AT_LEAST_1,
        "pipeline_parallel_first_stage_less_layers": AT_LEAST_0,
        "pipeline_parallel_last_stage_less_layers": AT_LEAST_0,
        "pipeline_parallel_layers_per_stage": AT_LEAST_1,
        "pipeline_parallel_schedule": OneOf(SCHEDULES),
        "pipeline_parallel_microbatch_size": AT_LEAST_1,
        "context_parallel_degree": AT_LEAST_1,
        "context_parallel_load_balancer": OneOf(("headtail", "ptrr")),
        "expert_parallel_degree": AT_LEAST_1,
    },
    "lr_scheduler": {
        "warmup_steps": AT_LEAST_0,
        "total_steps": AT_LEAST_1,
        "decay_ratio": FRACTION,
        "min_lr_factor": FRACTION,
    },
    "comm": {
        "init_timeout_seconds": SECONDS,
        "train_timeout_seconds": SECONDS,
        "trace_buf_size": Range(low=0, note="0 = no flight recorder"),
    },
    "profiler": {
        "profile_freq": AT_LEAST_1,
        "profiler_repeat": Range(low=0, note="0 = repeat until the run ends"),
        "profiler_skip_first": AT_LEAST_0,
        "profiler_skip_first_wait": Range(low=0, high=1, note="1 = skip the first wait"),
        "profiler_active": AT_LEAST_1,
        "profiler_warmup": AT_LEAST_0,
        "memory_snapshot_freq": AT_LEAST_1,
        "memory_snapshot_max_entries": AT_LEAST_1,
    },
    "compile": {
        "components": OneOf(("model", "loss")),
        "backend": OneOf(_compile_backends),
    },
    "debug": {"seed": SEED},
}
"""Each TorchTitan table's declarations, by key."""
