"""The pipeline stage whose send/recv op builders are the hook point for the wire.

Every schedule (GPipe, 1F1B, ...) obtains all of its point-to-point traffic from the public
``PipelineStage.get_{fwd,bwd}_{send,recv}_ops`` builders and consumes each received microbatch in
``forward_one_chunk`` / ``backward_one_chunk``. ``WirePipelineStage`` wraps exactly those:

* **one message per microbatch and direction** (``wire.message``): with a lossy ``Codec``
  (``protocol_models.wire.codecs``) it sends the codec's payload packed into one buffer instead
  of the ``d``-wide tensor, and unpacks what it receives into the stage's normal receive buffer
  right before consuming it (forward activations and backward gradients alike); with a
  ``SimulatedLink`` the sender's clock stamp travels in the same buffer;
* **pre-posted receives** (``[transport] prepost_receives``, the default; gloo only): when a
  training or evaluation step asks for its first forward receive, every receive of the step is
  posted at once, forward and (training) backward, each into its own buffer; the builders then hand
  the schedule no receive ops, and each message is waited for right before its microbatch's
  compute. Under gloo's receiver-driven TCP transport a receive posted after its send costs one
  more latency, and torch's schedules post each receive only just before its compute. Off, the
  schedule posts and waits each receive as torch does (just in time);
* it accounts every message handed to the wire, per boundary and direction, and the time this
  stage waited for each (``WireMeter``);
* with a ``SimulatedLink`` it hands every consumed message to the link model, which sleeps
  until the message would have arrived.

Boundary ``b`` sits between stage ``b`` and stage ``b + 1``: a forward message from stage ``s``
crosses boundary ``s``, a backward message from stage ``s`` crosses boundary ``s - 1``.
(Shape-inference traffic at the first step does not pass through these builders.)

NCCL: every message travels on the group of its boundary and direction
(``wire.boundary_groups``: one sender, one receiver, both in microbatch order under GPipe and
1F1B), connected when the stage is built, so that NCCL's lazy set-up never waits for a message
that needs this stage first; and every receive is posted just in time, as torch's schedules do,
whatever ``prepost_receives`` says. A pre-posted NCCL receive is a kernel on the device until
its message arrives, and any device-wide synchronization meanwhile (TorchTitan's after a
process's first step, a ``cudaFree`` of cached memory) waits for it: under 1F1B a stage holding
the next step's forward receives then waits for a sender that first needs this stage's
gradients, for ever. Over NCCL's socket transport a message does not wait for its receive, so a
receive posted late costs nothing there (``wire.norm_exchange``). gloo matches each send to its
receive by peer and tag, with no shared queue, and keeps the pipeline's group.

Asynchronous mode (``enable_async``, for ``wire.async_schedule``): on gloo the schedule posts
each training call's receives itself (``post_batch_receives``; on NCCL each is posted just in
time, when its microbatch is consumed, as above), a message may be expected for the same
microbatch id of two batches at once (kept in order: both sides send and post in global
microbatch order), every message lands in the wire's own buffer (the stage's receive buffer of
that id may still be saved for the previous batch's backward) and is unpacked when consumed, and
each forward runs with the weight version the schedule names (``forward_version``,
``weight_versions``).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torchtitan.tools.logging import logger

from protocol_models.tools.errors import as_link_fault
from protocol_models.tools.nccl_rules import NCCL_DTYPES
from protocol_models.wire.boundary_groups import BoundaryGroups, follows_nccl
from protocol_models.wire.codecs import Codec, Payload
from protocol_models.wire.link import SimulatedLink
from protocol_models.wire.message import MessageLayout
from protocol_models.wire.meter import Mark, WireMeter, mark
from protocol_models.wire.weight_versions import WeightVersions

if TYPE_CHECKING:
    from protocol_models.wire import Wire

DIRECTIONS = ("fwd", "bwd")


@dataclass
class Inbound:
    """One message this stage expects: its layout, the buffer the wire fills, the stage's own
    receive buffer it is unpacked into (torch's ``_RecvInfo`` buffer; the same tensor when
    ``layout.direct`` and no codec), when its receive was posted (host time, and as ``mark``
    gives it: on CUDA an event on the stream), and the pre-posted receive's ``Work`` (None: the
    schedule posts and waits it)."""

    layout: MessageLayout
    buffer: torch.Tensor
    target: torch.Tensor
    boundary: int
    peer: int
    """The sender's global rank."""
    posted_at: float
    posted: Mark
    work: dist.Work | None = None


@dataclass(frozen=True)
class Waiting:
    """One receive a stage has posted and not yet seen complete."""

    posted_at: float
    """``time.time()`` when it was posted."""
    stage: int
    message: str
    """What it receives: ``the fwd message of microbatch 3 over boundary 0``, ``the gradient
    norm``."""
    peer_stage: int
    peer_rank: int
    """The sender's global rank."""


class WirePipelineStage(PipelineStage):
    """A ``PipelineStage`` that sends one message per microbatch and direction, pre-posts its
    receives, meters what it sends, optionally compresses it with a lossy codec and optionally
    routes it over a slow link (module docstring).

    Codec state, per microbatch (chunk id): the forward payload this stage sent (``_sent``) and
    the one it received (``_received``) -- the backward of TopK (straight-through) and SVD needs
    them on both sides. Expected messages: ``_inbound[(direction, chunk)]``, in the order they
    arrive (two batches' at most, in asynchronous mode).
    """

    def __init__(self, *args, wire: Wire, **kwargs):
        super().__init__(*args, **kwargs)
        self.boundary_groups: BoundaryGroups | None = None
        """NCCL: the group of each boundary and direction (None: gloo, the pipeline's group)."""
        if follows_nccl(self.group):
            self.boundary_groups = BoundaryGroups(self.group, wire.timeout)
            self.boundary_groups.connect(self.stage_index, self.device)
        self.meter: WireMeter = wire.meter
        self.link: SimulatedLink | None = wire.link
        self.codec: Codec | None = wire.codec
        self.prepost = wire.prepost and self.boundary_groups is None
        """Whether this stage pre-posts its receives (gloo with ``prepost_receives``)."""
        self._sent: dict[int, Payload] = {}
        self._received: dict[int, Payload] = {}
        self._inbound: dict[tuple[str, int], deque[Inbound]] = {}
        self._forward_posted = False
        self.asynchronous = False
        self.versions: WeightVersions | None = None
        """Asynchronous mode: the stage's two weight versions."""
        self.forward_version: int | None = None
        """Asynchronous mode: the version the next forwards use (None: the module's own
        parameters, e.g. evaluation)."""
        self.compute_dtype = torch.float32
        """Asynchronous mode: the forwards' autocast dtype (float32: no autocast); the stage
        module is not FSDP-wrapped then (``wire.pipeline``)."""
        self.keep_forward_caches = False
        """Asynchronous mode: a batch's backwards still trail in the pipeline, so the next
        schedule call's ``clear_runtime_states`` keeps their forward caches."""
        self._described: set[str] = set()
        wire.stages.append(self)

    def enable_async(self) -> None:
        """Asynchronous mode (module docstring); on gloo it needs ``prepost_receives``. On NCCL
        its receives are posted just in time, as the synchronous schedules' are: a pending
        receive is a kernel any device-wide wait would wait for (a compile's autotuning, a
        ``cudaFree``), and over NCCL's sender-driven socket transport a late receive costs
        nothing."""
        if self.boundary_groups is None and not self.prepost:
            raise ValueError("the asynchronous schedule needs transport.prepost_receives = true")
        self.asynchronous = True
        self.versions = WeightVersions(self.submod)

    def clear_runtime_states(self) -> None:
        """Between schedule calls: torch's clearing, except that while a batch's backwards
        trail (``keep_forward_caches``) only the outputs are cleared (their forward caches and
        input buffers serve the backwards of the next call)."""
        if not self.keep_forward_caches:
            super().clear_runtime_states()
        else:
            self.output_chunks.clear()

    def forward_maybe_with_nosync(self, *args, **kwargs):
        if not self.asynchronous:
            return super().forward_maybe_with_nosync(*args, **kwargs)
        low = self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=low):
            if self.forward_version is None:
                return self.submod(*args, **kwargs)
            return self.versions.forward(self.forward_version, *args, **kwargs)

    # -- sends ---------------------------------------------------------------------------------

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        self._describe_once("fwd", self.stage_index, ops)
        return self._send_ops("fwd", self.stage_index, fwd_chunk_id, ops)

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        self._describe_once("bwd", self.stage_index - 1, ops)
        return self._send_ops("bwd", self.stage_index - 1, bwd_chunk_id, ops)

    def _send_ops(
        self, direction: str, boundary: int, chunk: int, ops: list[dist.P2POp]
    ) -> list[dist.P2POp]:
        """The one send op of this microbatch's message in place of torch's (one tensor, or
        none: nothing crosses the boundary this way)."""
        if not ops:
            return ops
        (op,) = ops
        if self.codec is None:
            parts = [op.tensor]
        else:
            with torch.no_grad():
                if direction == "fwd":
                    parts = self.codec.encode(op.tensor)
                    self._sent[chunk] = parts
                else:
                    parts = self.codec.encode_grad(op.tensor, self._received[chunk])
        self.meter.record(direction, boundary, parts, [op.tensor])
        layout = self._layout([(p.shape, p.dtype) for p in parts])
        stamp = self.link.stamp(op.tensor.device) if self.link is not None else None
        message = _wire_view(layout.pack(parts, stamp))
        return [dist.P2POp(dist.isend, message, op.peer, self._group(direction, boundary, op))]

    # -- receives ------------------------------------------------------------------------------

    def get_fwd_recv_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        if self.prepost:
            if fwd_chunk_id == 0 and not self.asynchronous:  # a schedule's first of a step
                self._post_step()
            return []
        return self._recv_ops("fwd", fwd_chunk_id, super().get_fwd_recv_ops(fwd_chunk_id))

    def get_bwd_recv_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        if self.prepost:
            return []
        return self._recv_ops("bwd", bwd_chunk_id, super().get_bwd_recv_ops(bwd_chunk_id))

    def post_next_forward(self) -> None:
        """Post the next step's forward receives now: this step's backward is done, so their
        buffers are free. The trainer calls this when the step's schedule is over and another
        training step surely follows: the next step's first message is then posted for before
        its sender sends it, even though this stage still has the optimizer step (and the
        gradient-norm exchange) ahead. No-op unless receives are pre-posted (in asynchronous
        mode the schedule posts them a call ahead, except at a drain)."""
        if not self.prepost or self._forward_posted:
            return
        if not self.asynchronous:
            self._check_consumed()
        self._post("fwd")
        self._forward_posted = True

    def post_batch_receives(self, next_forward: bool) -> None:
        """Asynchronous mode: post the receives of the schedule call about to run and, with
        ``next_forward`` (a training call of the next batch surely follows), the next call's
        forward receives too. The upstream stage runs up to a step ahead, so its first message
        of the next batch may leave before this stage's call is over; under gloo a receive
        posted after its message was sent costs a round trip more. On NCCL nothing is posted
        ahead: each receive is posted when its microbatch is consumed (``enable_async``)."""
        if not self.prepost:
            return
        self._post_step()
        if next_forward:
            self._post("fwd")
            self._forward_posted = True

    def check_drained(self) -> None:
        """Asynchronous mode: the pipeline has flushed, so every expected message was consumed."""
        self._check_consumed()

    def _post_step(self) -> None:
        """Post every receive of the step (forward, and backward when it has one), in
        microbatch order per direction; the schedule asked for its first forward receive. The
        forward receives may have been posted already (``post_next_forward``)."""
        if self._forward_posted:
            self._forward_posted = False
        else:
            if not self.asynchronous:
                self._check_consumed()
            self._post("fwd")
        if self.has_backward:
            self._post("bwd")

    def _check_consumed(self) -> None:
        if self._inbound:
            unconsumed = list(self._inbound)
            raise RuntimeError(f"stage {self.stage_index}: messages never consumed: {unconsumed}")

    def _post(self, direction: str) -> None:
        """Post this step's receives of ``direction``, in microbatch order."""
        chunks = self.args_recv_info if direction == "fwd" else self.grad_recv_info
        for chunk in sorted(chunks):
            self._post_chunk(direction, chunk)

    def _post_chunk(self, direction: str, chunk: int) -> None:
        """Post the receive of microbatch ``chunk``'s message of ``direction`` (none when
        nothing arrives this way)."""
        build = super().get_fwd_recv_ops if direction == "fwd" else super().get_bwd_recv_ops
        for op in self._recv_ops(direction, chunk, build(chunk)):
            work = op.op(op.tensor, group=op.group, tag=op.tag, group_src=op.group_peer)
            self._inbound[(direction, chunk)][-1].work = work

    def _recv_ops(self, direction: str, chunk: int, ops: list[dist.P2POp]) -> list[dist.P2POp]:
        """The one receive op of this microbatch's message in place of torch's, and the
        ``Inbound`` that remembers it (none when nothing arrives this way)."""
        if not ops:
            return ops
        (op,) = ops
        target = op.tensor
        if self.codec is None:
            parts = [(target.shape, target.dtype)]
        else:
            parts = self.codec.spec(target.shape, target.dtype, direction)
        layout = self._layout(parts)
        direct = layout.direct and self.codec is None and not self.asynchronous
        buffer = target if direct else layout.empty(target.device)
        boundary = self.stage_index - 1 if direction == "fwd" else self.stage_index
        inbound = Inbound(layout, buffer, target, boundary, op.peer, posted_at=time.time(),
                          posted=mark(self.device))  # fmt: skip
        self._inbound.setdefault((direction, chunk), deque()).append(inbound)
        return [dist.P2POp(dist.irecv, _wire_view(buffer), op.peer,
                           self._group(direction, boundary, op))]  # fmt: skip

    def _group(self, direction: str, boundary: int, op: dist.P2POp) -> dist.ProcessGroup:
        """The group a message of ``direction`` over ``boundary`` travels on (module docstring);
        ``op``: torch's op for it."""
        if self.boundary_groups is None:
            return op.group
        return self.boundary_groups.group(direction, boundary)

    def _layout(self, parts) -> MessageLayout:
        return MessageLayout(tuple((torch.Size(s), d) for s, d in parts), self.link is not None)

    # -- consuming -----------------------------------------------------------------------------

    def forward_one_chunk(self, fwd_chunk_id: int, *args, **kwargs):
        self._consume("fwd", fwd_chunk_id)
        self.submod.in_microbatch = True  # a real microbatch: its leak is measured
        try:
            return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)
        finally:
            self.submod.in_microbatch = False

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        self._consume("bwd", bwd_chunk_id)
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def _consume(self, direction: str, chunk: int) -> None:
        """Wait for this microbatch's message (pre-posted; asynchronous mode on NCCL: posted
        now), let the link model deliver it (training only: evaluation runs with the link off),
        and unpack or decode it into the stage's receive buffer. No-op when nothing arrives this
        way."""
        if self.asynchronous and not self.prepost:
            self._post_chunk(direction, chunk)
        queue = self._inbound.get((direction, chunk))
        if not queue:
            return
        inbound = queue.popleft()
        if not queue:
            del self._inbound[(direction, chunk)]
        if inbound.work is None:  # the schedule posted and waited it just now
            began = inbound.posted
        else:
            began, host_began = mark(self.device), time.time()
            try:
                inbound.work.wait()
            except RuntimeError as e:  # gloo: the peer's connection closed or broke
                what = (f"stage {self.stage_index}: the {direction} message of microbatch {chunk} "
                        f"over boundary {inbound.boundary} from rank {inbound.peer}, waited "
                        f"{time.time() - host_began:.0f} s,")  # fmt: skip
                fault = as_link_fault(e, what)
                if fault is None:
                    raise
                raise fault from e
        self.meter.waited(direction, inbound.boundary, began, mark(self.device))
        parts, stamp = inbound.layout.unpack(inbound.buffer)
        if self.link is not None and self.submod.training:
            nbytes = inbound.layout.payload_bytes
            self.link.deliver(direction, inbound.boundary, nbytes, stamp, inbound.posted_at)
        target = inbound.target
        if direction == "fwd" and self.asynchronous:  # its last batch's input gradient was sent
            target.grad = None
        with torch.no_grad():
            if self.codec is None:
                if parts[0] is not target:
                    target.copy_(parts[0])
            elif direction == "fwd":
                self._received[chunk] = parts
                target.copy_(self.codec.decode(parts, target.shape))
            else:
                target.copy_(self.codec.decode_grad(parts, self._sent[chunk], target.shape))

    def waiting(self) -> list[Waiting]:
        """The pre-posted receives not yet complete (``training.stall_watch``; any thread)."""
        out = []
        for (direction, chunk), queue in list(self._inbound.items()):
            for inbound in list(queue):
                if inbound.work is not None and not inbound.work.is_completed():
                    message = (f"the {direction} message of microbatch {chunk} over boundary "
                               f"{inbound.boundary}")  # fmt: skip
                    peer = self.stage_index + (-1 if direction == "fwd" else 1)
                    out.append(Waiting(inbound.posted_at, self.stage_index, message, peer,
                                       inbound.peer))  # fmt: skip
        return out

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


def _wire_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or (e.g. TopK's int16 indices, a type NCCL has not) a uint8 view of the same
    memory: the bytes on the wire are identical, and a receive into the view fills the typed
    buffer."""
    return t if t.dtype in NCCL_DTYPES else t.view(torch.uint8)
