"""The step's global gradient norm over the pipeline group, exchanged instead of all-reduced.

Gradient clipping needs ``sqrt(sum_s n_s^2)`` over the pipeline stages ``s`` before any stage can
step. TorchTitan reduces it with an all-reduce after every stage's backward: over slow links a
ring all-reduce of one number costs about ``2 (P - 1)`` latencies, and under gloo's
receiver-driven transport each of its rounds a round trip, on the critical path of every step.

``NormExchange`` instead posts, at the start of every step, one receive from every other stage
of its pipeline; a stage whose backward is done sends its ``n_s^2`` to every other stage and
sums the ``P`` values in stage order once they are there. Under GPipe and 1F1B the first stage
finishes its backward last, holding every other value by then, and the others wait one latency
for its value -- while the first stage already starts the next step's forward, whose first
message needs that latency too. The exchange costs no extra latency on the step; the sum is
the same on every stage (one fixed order), and for two stages equals the all-reduce's bit for
bit (``a + b == b + a``).

Each message is ``[n_s^2, clock, row...]`` in float64 (the squared norm's own dtype converts
exactly); ``clock`` is the sender's time for the link simulator, which delays each value by its
latency. On a log step the stage's metrics row (``metrics._StageRow``) rides along, so the log
step needs no collective of its own: every stage then holds every stage's row (``rows``).
Messages to higher-ranked stages travel on one group, to lower-ranked on another (gloo).

On NCCL a synchronous schedule posts nothing ahead (``batched``): a receive pre-posted at the
step's start would be the first op on its communicator, which NCCL creates (and connects) only
when the sender joins it -- at its clipping, after a pipeline step that needs the receiver: a
deadlock; and a pending NCCL receive holds any device-wide wait (TorchTitan's after a process's
first step) until its message arrives. Instead every stage sends and receives its values in one
``batch_isend_irecv`` on one group of the pipeline's ranks at its clipping; the group is
connected by one such batch when the exchange is built (every stage builds it at start-up), not
in the middle of a step. torch runs a batch on NCCL as one coalesced group and returns one
``Work`` for all of it (gloo: one per op), so the exchange waits for what it gets and indexes
nothing. By NCCL's source (not yet measured on GPUs) it costs the step nothing on its socket
transport, which pushes a small send onto its TCP connection without waiting for the receive
(``ncclNetSocketIsend``): the values of the stages that finished earlier wait in the first
stage's socket buffers when it posts its batch, and the others wait one latency for its value
while it starts the next step, as above. (Over InfiniBand a send waits for its receive to be
posted: the first stage then waits one round trip for the others' values.)

Under the asynchronous schedule (``wire.async_schedule``) a batch's gradient is complete on a stage
when its last backward of it is done, and applied a step later: ``post_batch(b)`` posts the
receives of batch ``b``'s norms at the start of its step, ``send(b, n_s)`` sends this stage's as
soon as its gradient is complete, and ``total(b)`` waits for the others' when the update is due.
Two batches may be outstanding at once; every stage posts and sends them in batch order. No
metrics row travels this way. On NCCL (``nccl``) nothing is posted at the step's start:
``send(b, n_s)`` posts the receives of ``b``'s norms together with this stage's sends. A
receive pending on NCCL is a kernel that any device-wide wait (TorchTitan's after a process's
first step, a compile's autotuning, a ``cudaFree``) waits for, so it may only be pending while its
sender surely sends without this stage: every stage's last backward of ``b`` (where it sends)
needs only gradients this stage has sent by then, or comes before this stage's. The values travel
as single ops on the two groups, which run on one two-rank communicator per (group, pair), each
carrying one sender's values to one receiver (with a bound device one communicator per group:
every stage then issues its ops in the same rounds, ``_in_rounds``); every such communicator is
created and connected when the exchange is built (``_connect_pairs``), not in the middle of a
step.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol_models.wire.link import SimulatedLink
from protocol_models.wire.meter import WireMeter
from protocol_models.wire.stage import Waiting

Posted = tuple[int, torch.Tensor, dist.Work]
"""A posted receive: ``(peer stage, its buffer, its work)``."""


class NormExchange:
    """One pipeline's exchange of squared gradient norms (module docstring). ``ranks``: the
    global ranks of this rank's pipeline group, stage order; built collectively by them."""

    def __init__(self, ranks: list[int], device: torch.device, meter: WireMeter,
                 link: SimulatedLink | None, timeout: timedelta | None = None,
                 nccl: bool = False, asynchronous: bool = False):  # fmt: skip
        self.ranks, self.device, self.meter, self.link = ranks, device, meter, link
        if ranks != sorted(ranks):
            raise ValueError(f"pipeline ranks {ranks} are not in stage order")
        self.stage = ranks.index(dist.get_rank())
        self.batched = nccl and not asynchronous
        """NCCL under a synchronous schedule: one batch of sends and receives at the clipping,
        nothing posted ahead."""
        self.prepost = not nccl
        """Whether the asynchronous schedule's receives are posted at its step's start (gloo)
        or with this stage's own send (NCCL)."""
        self._groups = [
            dist.new_group(ranks, timeout=timeout, use_local_synchronization=True,
                           group_desc=f"grad_norm_exchange{i}")  # fmt: skip
            for i in range(1 if self.batched else 2)
        ]
        self._open = False
        """Whether ``post`` opened this step's exchange."""
        self._receiving: list[tuple[int, float, dist.Work | _Batch]] = []
        """This step's receives not yet waited for: ``(peer stage, posted at, work)``."""
        self._posted: list[Posted] = []
        if self.batched:
            self._connect()
        elif nccl:
            self._connect_pairs()
        self._batches: dict[int, list[Posted]] = {}
        self._batch_sends: dict[int, tuple[torch.Tensor, list[dist.Work]]] = {}
        self._row_width = 0
        self.rows: torch.Tensor | None = None
        """``[stages, width]`` float64: every stage's metrics row, from the last exchange that
        carried rows (``post(row_width > 0)``); None otherwise."""

    @property
    def groups(self) -> list[dist.ProcessGroup]:
        return list(self._groups)

    def _group(self, sender: int, receiver: int) -> dist.ProcessGroup:
        """gloo: messages to higher stages on the first group, to lower on the second."""
        return self._groups[0] if receiver > sender else self._groups[-1]

    def post(self, row_width: int = 0) -> None:
        """Open this step's exchange (at the step's start), with room for a metrics row of
        ``row_width`` values (0: no row this step): on gloo, post its receives, one from every
        other stage. Counts the exchange on the meter."""
        if self._open:
            raise RuntimeError("the previous step's gradient norms were never reduced")
        self._open = True
        self._row_width, self.rows = row_width, None
        if self.batched:
            self.meter.collective("grad_norm", 1)
        else:
            self._posted = self._post_receives(2 + row_width)

    def _post_receives(self, width: int) -> list[Posted]:
        """One receive of ``width`` float64 values from every other stage; counted."""
        posted = []
        for peer in range(len(self.ranks)):
            if peer == self.stage:
                continue
            buffer = torch.empty(width, dtype=torch.float64, device=self.device)
            group = self._group(peer, self.stage)
            posted.append((peer, buffer, dist.irecv(buffer, group=group, group_src=peer)))
        self.meter.collective("grad_norm", 1)
        self._receiving = [(peer, time.time(), work) for peer, _, work in posted]
        return posted

    def waiting(self) -> list[Waiting]:
        """This step's gradient-norm receives not yet complete (``training.stall_watch``; any
        thread)."""
        return [Waiting(posted_at, self.stage, "the gradient norm", peer, self.ranks[peer])
                for peer, posted_at, work in list(self._receiving)
                if not work.is_completed()]  # fmt: skip

    def _message(self, square: torch.Tensor, row: torch.Tensor | None) -> torch.Tensor:
        """``[n_s^2, clock, row...]`` float64 (module docstring)."""
        if self.link is not None:
            clock = self.link.stamp(self.device).reshape(1)
        else:
            clock = torch.zeros(1, dtype=torch.float64, device=self.device)
        parts = [square.to(torch.float64).reshape(1), clock]
        return torch.cat(parts if row is None else [*parts, row])

    def _send_all(self, message: torch.Tensor) -> list[dist.Work]:
        return [
            dist.isend(message, group=self._group(self.stage, peer), group_dst=peer)
            for peer in range(len(self.ranks))
            if peer != self.stage
        ]

    def _sum(self, squares: dict[int, torch.Tensor], arrivals: list[torch.Tensor]) -> torch.Tensor:
        """``sqrt`` of the squares summed in stage order; the link model delivers the values."""
        if self.link is not None and arrivals:
            self.link.exchange(float(torch.stack(arrivals).max()))
        total = squares[0]
        for stage in range(1, len(self.ranks)):
            total = total + squares[stage]
        return total**0.5

    def post_batch(self, batch: int) -> None:
        """Asynchronous schedule: post the receives of ``batch``'s norms at its step's start
        (on NCCL ``send`` posts them)."""
        if batch in self._batches:
            raise RuntimeError(f"the gradient norms of batch {batch} are already expected")
        if self.prepost:
            self._batches[batch] = self._post_receives(2)

    def send(self, batch: int, local_norm: torch.Tensor) -> None:
        """Asynchronous schedule: send this stage's norm of ``batch`` (its gradient is complete;
        on NCCL with the receives of the others', ``_in_rounds``)."""
        square = local_norm.detach() ** 2
        message = self._message(square, None)
        if self.prepost:
            self._batch_sends[batch] = (square, self._send_all(message))
            return
        self._batches[batch], sends = self._in_rounds(message)
        self._batch_sends[batch] = (square, sends)

    def total(self, batch: int) -> torch.Tensor:
        """Asynchronous schedule: ``batch``'s global norm, in its local norm's dtype, once every
        stage's value is there (``send`` of this stage first)."""
        square, sends = self._batch_sends.pop(batch)
        squares, arrivals = {self.stage: square}, []
        for peer, buffer, work in self._batches.pop(batch):
            work.wait()
            squares[peer] = buffer[0].to(square.dtype)
            arrivals.append(buffer[1])
        for work in sends:
            work.wait()
        return self._sum(squares, arrivals)

    def global_norm(
        self, local_norm: torch.Tensor, row: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``sqrt(sum_s n_s^2)`` in ``local_norm``'s dtype, summed in stage order, given this
        stage's norm ``n_s`` (a device scalar, already reduced over its data-parallel shards)
        and, when ``post`` made room for one, this stage's metrics row ``[width]`` float64."""
        width = 0 if row is None else row.numel()
        if width != self._row_width:
            raise ValueError(f"a metrics row of {width} values; {self._row_width} were posted")
        if not self._open:
            raise RuntimeError("the gradient-norm exchange was not posted this step")
        self._open = False
        square = local_norm.detach() ** 2
        message = self._message(square, row)
        if self.batched:
            received = self._exchange_batched(message)
        else:
            sends = self._send_all(message)
            for _, _, work in self._posted:
                work.wait()
            received = [(peer, buffer) for peer, buffer, _ in self._posted]
            self._posted = []
            for work in sends:
                work.wait()
        squares = {self.stage: square}
        rows = {self.stage: row}
        arrivals = []
        for peer, buffer in received:
            squares[peer] = buffer[0].to(square.dtype)
            arrivals.append(buffer[1])
            rows[peer] = buffer[2:]
        if row is not None:
            self.rows = torch.stack([rows[stage] for stage in range(len(self.ranks))])
        return self._sum(squares, arrivals)

    def _connect(self) -> None:
        """NCCL: one batch now, so that the group is created and connected at start-up, with
        every stage there (module docstring)."""
        self._exchange_batched(torch.zeros(2, dtype=torch.float64, device=self.device))

    def _exchange_batched(self, message: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """NCCL: ``message`` to every other stage and theirs from every other stage, in one
        batch on the one group (module docstring); ``[(peer, its message)]``."""
        (group,) = self._groups
        ops, received = [], []
        for peer in range(len(self.ranks)):
            if peer == self.stage:
                continue
            buffer = torch.empty_like(message)
            received.append((peer, buffer))
            ops += [dist.P2POp(dist.isend, message, group=group, group_peer=peer),
                    dist.P2POp(dist.irecv, buffer, group=group, group_peer=peer)]  # fmt: skip
        batch = _Batch(dist.batch_isend_irecv(ops))
        now = time.time()
        self._receiving = [(peer, now, batch) for peer, _ in received]
        batch.wait()
        return received

    def _connect_pairs(self) -> None:
        """NCCL, asynchronous schedule: one value over every link (sender, receiver), so that
        every pair communicator is created and connected here (``_in_rounds``: a set-up waits
        only for its partner, who reaches it after the same rounds, so the ``S (S - 1)`` set-ups
        take about ``S`` rounds; walking the links in plain order would chain them)."""
        posted, sends = self._in_rounds(torch.zeros(2, dtype=torch.float64, device=self.device))
        for work in [w for _, _, w in posted] + sends:
            work.wait()

    def _in_rounds(self, message: torch.Tensor) -> tuple[list[Posted], list[dist.Work]]:
        """NCCL, asynchronous schedule: ``message`` to every other stage and a receive of theirs
        from each, as single ops issued in the rounds of a round robin (``round_robin``), the
        same order on every stage: on a communicator several stages share (a bound device) the
        earliest op not yet done then always has both its sides at the head of their queues, so
        one communicator's issue order never closes a cycle. ``(posted receives, sends)``."""
        posted, sends = [], []
        for first, second in round_robin(len(self.ranks)):
            for sender, receiver in ((first, second), (second, first)):
                group = self._group(sender, receiver)
                if self.stage == sender:
                    sends.append(dist.isend(message, group=group, group_dst=receiver))
                elif self.stage == receiver:
                    buffer = torch.empty_like(message)
                    work = dist.irecv(buffer, group=group, group_src=sender)
                    posted.append((sender, buffer, work))
        self.meter.collective("grad_norm", 1)
        self._receiving = [(peer, time.time(), work) for peer, _, work in posted]
        return posted, sends


def round_robin(n: int) -> list[tuple[int, int]]:
    """Every pair of ``0 .. n - 1`` once, ``(lower, higher)``, in the rounds of the circle method
    (in each round every number is in at most one pair), round after round."""
    players = list(range(n)) + ([None] if n % 2 else [])
    pairs = []
    for _ in range(len(players) - 1):
        half = len(players) // 2
        for a, b in zip(players[:half], reversed(players[half:]), strict=True):
            if a is not None and b is not None:
                pairs.append((min(a, b), max(a, b)))
        players = [players[0], players[-1], *players[1:-1]]
    return pairs


class _Batch:
    """The ``Work``s of one ``batch_isend_irecv``: one for the whole batch on NCCL (torch's
    coalescing manager), one per op on gloo; complete when all of them are."""

    def __init__(self, works: list[dist.Work]):
        self.works = works

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()
