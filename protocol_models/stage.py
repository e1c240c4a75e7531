"""The pipeline stage whose send ops are the hook point for the wire.

Every schedule (GPipe, 1F1B, ...) obtains all of its point-to-point traffic from
``PipelineStage.get_fwd_send_ops`` / ``get_bwd_send_ops``. ``WirePipelineStage`` wraps those two
public op builders and accounts every message handed to the wire, per boundary and direction.
Boundary ``b`` sits between stage ``b`` and stage ``b + 1``: a forward send from stage ``s``
crosses boundary ``s``, a backward send from stage ``s`` crosses boundary ``s - 1``.
(Shape-inference traffic at the first step does not pass through these builders.)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage


@dataclass
class WireMeter:
    """Bytes sent since the last ``reset()``, keyed by boundary index.

    ``dense`` holds what the same messages would have cost with a ``dim``-wide activation of the
    same dtype, i.e. an uncompressed boundary.
    """

    dim: int
    fwd: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    bwd: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    dense: dict[int, int] = field(default_factory=lambda: defaultdict(int))

    def record(self, direction: str, boundary: int, ops: list[dist.P2POp]) -> None:
        sent = getattr(self, direction)
        for op in ops:
            tensor = op.tensor
            sent[boundary] += tensor.numel() * tensor.element_size()
            per_feature = tensor.numel() // tensor.shape[-1]
            self.dense[boundary] += per_feature * self.dim * tensor.element_size()

    def reset(self) -> None:
        self.fwd.clear()
        self.bwd.clear()
        self.dense.clear()


class WirePipelineStage(PipelineStage):
    """A ``PipelineStage`` that reports every activation and gradient it sends to a meter."""

    def __init__(self, *args, meter: WireMeter, **kwargs):
        super().__init__(*args, **kwargs)
        self.meter = meter

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.meter.record("fwd", self.stage_index, ops)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.meter.record("bwd", self.stage_index - 1, ops)
        return ops
