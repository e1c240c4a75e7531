"""The pipeline layout: which blocks each stage holds.

The model (which blocks are constrained), the pipeline split, the in-graph codecs, the planner
and the start-up checks all call ``stage_layer_ranges``, so they agree.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from protocol_models.tools.errors import ConfigError


def stage_layer_ranges(
    n_layers: int, n_stages: int, layers_per_stage: Sequence[int] | None = None
) -> list[range]:
    """The contiguous block ids of each of ``n_stages`` pipeline stages.

    ``layers_per_stage`` (``[protocol] layers_per_stage``): block counts per stage, each >= 1
    (a head-only last stage would put every block upstream of a boundary, so the LM head would
    read ``F[ids] + U c``: a rank-k bottleneck on the whole model's output), summing to
    ``n_layers``. ``None``: near-equal ranges, earlier stages take the remainder. The model (which
    blocks are constrained), the pipeline split and the planner all call this, so they agree.
    """
    if layers_per_stage is None:
        base, extra = divmod(n_layers, n_stages)
        sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
    else:
        sizes = list(layers_per_stage)
        key = f"protocol.layers_per_stage = {sizes}"
        if len(sizes) != n_stages:
            raise ConfigError(f"{key}: expected {n_stages} entries, one per pipeline stage")
        if min(sizes) < 1:
            raise ConfigError(f"{key}: every stage needs at least one block")
        if sum(sizes) != n_layers:
            raise ConfigError(f"{key}: sums to {sum(sizes)}, expected model.n_layers = {n_layers}")
    starts = itertools.accumulate(sizes, initial=0)
    return [range(start, start + size) for start, size in zip(starts, sizes, strict=False)]


__all__ = ["stage_layer_ranges"]
