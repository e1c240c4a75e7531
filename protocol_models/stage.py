"""The pipeline stage whose send/recv op builders are the hook point for the wire.

Every schedule (GPipe, 1F1B, ...) obtains all of its point-to-point traffic from the public
``PipelineStage.get_{fwd,bwd}_{send,recv}_ops`` builders and consumes each received microbatch in
``forward_one_chunk`` / ``backward_one_chunk``. ``WirePipelineStage`` wraps exactly those:

* it accounts every message handed to the wire, per boundary and direction (``WireMeter``);
* with a ``SimulatedLink`` it adds the sender's 8-byte clock stamp to each message and, on the
  receiving side, waits until the link model says the message has arrived.

Boundary ``b`` sits between stage ``b`` and stage ``b + 1``: a forward message from stage ``s``
crosses boundary ``s``, a backward message from stage ``s`` crosses boundary ``s - 1``.
(Shape-inference traffic at the first step does not pass through these builders.)
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from protocol_models.link import SimulatedLink


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
    """A ``PipelineStage`` that meters what it sends and optionally routes it over a slow link."""

    def __init__(self, *args, meter: WireMeter, link: SimulatedLink | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.meter = meter
        self.link = link

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self.meter.record("fwd", self.stage_index, ops)
        return self._with_stamp(ops)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self.meter.record("bwd", self.stage_index - 1, ops)
        return self._with_stamp(ops)

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        return self._with_expectation(ops, "fwd", fwd_chunk_id, self.stage_index - 1)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        return self._with_expectation(ops, "bwd", bwd_chunk_id, self.stage_index)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._await_arrival("fwd", fwd_chunk_id)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._await_arrival("bwd", bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def _with_stamp(self, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        if self.link is not None and ops:
            ops.append(SimulatedLink.stamp_op(ops[-1]))
        return ops

    def _with_expectation(self, ops, direction: str, chunk: int, boundary: int):
        if self.link is not None and ops:
            ops.append(self.link.expect_op(direction, chunk, boundary, ops))
        return ops

    def _await_arrival(self, direction: str, chunk: int) -> None:
        if self.link is None:
            return
        if self.submod.training:
            self.link.wait(direction, chunk)
        else:
            self.link.discard(direction, chunk)
