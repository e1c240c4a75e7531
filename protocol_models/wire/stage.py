"""The pipeline stage whose send/recv op builders are the hook point for the wire.

Every schedule (GPipe, 1F1B, ...) obtains all of its point-to-point traffic from the public
``PipelineStage.get_{fwd,bwd}_{send,recv}_ops`` builders and consumes each received microbatch in
``forward_one_chunk`` / ``backward_one_chunk``. ``WirePipelineStage`` wraps exactly those:

* it accounts every message handed to the wire, per boundary and direction (``WireMeter``);
* with a lossy ``Codec`` (``protocol_models.wire.codecs``) it sends the packed payload instead of
  the ``d``-wide tensor and unpacks what it receives into the stage's normal receive buffer right
  before consuming it (forward activations and backward gradients alike);
* with a ``SimulatedLink`` it adds the sender's 8-byte clock stamp to each message and, on the
  receiving side, waits until the link model says the message has arrived.

Boundary ``b`` sits between stage ``b`` and stage ``b + 1``: a forward message from stage ``s``
crosses boundary ``s``, a backward message from stage ``s`` crosses boundary ``s - 1``.
(Shape-inference traffic at the first step does not pass through these builders.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torchtitan.tools.logging import logger

from protocol_models.wire.codecs import Codec, Payload
from protocol_models.wire.link import SimulatedLink
from protocol_models.wire.meter import WireMeter

if TYPE_CHECKING:
    from protocol_models.wire import Wire


class WirePipelineStage(PipelineStage):
    """A ``PipelineStage`` that meters what it sends, optionally compresses it with a lossy codec
    and optionally routes it over a slow link.

    Codec state, per microbatch (chunk id): the forward payload this stage sent (``_sent``) and
    the one it received (``_received``) -- the backward of TopK (straight-through) and SVD needs
    them on both sides -- and the gradient payload buffers posted for receipt (``_grad_in``).
    """

    def __init__(self, *args, wire: Wire, **kwargs):
        super().__init__(*args, **kwargs)
        self.meter: WireMeter = wire.meter
        self.link: SimulatedLink | None = wire.link
        self.codec: Codec | None = wire.codec
        self._sent: dict[int, Payload] = {}
        self._received: dict[int, tuple[Payload, torch.Tensor]] = {}
        self._grad_in: dict[int, tuple[Payload, torch.Tensor]] = {}
        self._described: set[str] = set()

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self._describe_once("fwd", self.stage_index, ops)
        if self.codec is None or not ops:
            self.meter.record("fwd", self.stage_index, [op.tensor for op in ops])
            return self._with_stamp(ops)
        (op,) = ops
        with torch.no_grad():
            payload = self.codec.encode(op.tensor)
        self._sent[fwd_chunk_id] = payload
        self.meter.record("fwd", self.stage_index, payload, [op.tensor])
        return self._with_stamp(_sends(op, payload))

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self._describe_once("bwd", self.stage_index - 1, ops)
        if self.codec is None or not ops:
            self.meter.record("bwd", self.stage_index - 1, [op.tensor for op in ops])
            return self._with_stamp(ops)
        (op,) = ops
        with torch.no_grad():
            payload = self.codec.encode_grad(op.tensor, self._received[bwd_chunk_id][0])
        self.meter.record("bwd", self.stage_index - 1, payload, [op.tensor])
        return self._with_stamp(_sends(op, payload))

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_recv_ops(fwd_chunk_id)
        if self.codec is not None and ops:
            ops = self._payload_recvs(ops, "fwd", self._received, fwd_chunk_id)
        return self._with_expectation(ops, "fwd", fwd_chunk_id, self.stage_index - 1)

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_recv_ops(bwd_chunk_id)
        if self.codec is not None and ops:
            ops = self._payload_recvs(ops, "bwd", self._grad_in, bwd_chunk_id)
        return self._with_expectation(ops, "bwd", bwd_chunk_id, self.stage_index)

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._await_arrival("fwd", fwd_chunk_id)
        if self.codec is not None and fwd_chunk_id in self._received:
            payload, buffer = self._received[fwd_chunk_id]
            with torch.no_grad():
                buffer.copy_(self.codec.decode(payload, buffer.shape))
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._await_arrival("bwd", bwd_chunk_id)
        if self.codec is not None and bwd_chunk_id in self._grad_in:
            payload, buffer = self._grad_in.pop(bwd_chunk_id)
            sent = self._sent[bwd_chunk_id]
            with torch.no_grad():
                buffer.copy_(self.codec.decode_grad(payload, sent, buffer.shape))
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def _describe_once(self, direction: str, boundary: int, ops: list[dist.P2POp]) -> None:
        """Log, once per direction, what this stage's messages over ``boundary`` hold."""
        if not ops or direction in self._described:
            return
        self._described.add(direction)
        t = ops[0].tensor
        codec = f" (before the {self.codec.name} codec)" if self.codec is not None else ""
        logger.info(
            f"boundary {boundary} carries {str(t.dtype).removeprefix('torch.')} {direction} "
            f"messages {list(t.shape)}{codec}: {t.element_size()} B per coordinate"
        )

    def _payload_recvs(
        self, ops: list[dist.P2POp], direction: str, store: dict, chunk: int
    ) -> list[dist.P2POp]:
        """Receive ops for the payload of the one ``d``-wide tensor ``ops`` would receive; the
        payload buffers and that tensor (the stage's receive buffer) are kept in ``store``."""
        (op,) = ops
        target = op.tensor
        payload = [
            torch.empty(shape, dtype=dtype, device=target.device)
            for shape, dtype in self.codec.spec(target.shape, target.dtype, direction)
        ]
        store[chunk] = (payload, target)
        return [dist.P2POp(dist.irecv, _wire_view(t), op.peer, op.group) for t in payload]

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


NCCL_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
               torch.bfloat16, torch.float32, torch.float64)  # fmt: skip
"""Element types NCCL transfers; any other payload tensor travels as its bytes."""


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or (e.g. TopK's int16 indices) a uint8 view of the same memory: the bytes
    on the wire are identical, and a receive into the view fills the typed buffer."""
    return t if t.dtype in NCCL_DTYPES else t.view(torch.uint8)


def _sends(op: dist.P2POp, payload: Payload) -> list[dist.P2POp]:
    """Send ops for ``payload`` to the peer (and over the group) of the data op ``op``."""
    return [dist.P2POp(dist.isend, _wire_view(t), op.peer, op.group) for t in payload]
