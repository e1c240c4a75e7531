"""NCCL on CPU: a ``torch.distributed`` backend that obeys NCCL's rules while gloo moves the bytes.

Every user trains over NCCL; CI runs on CPU, where only gloo exists, and the two backends take
the same calls but obey different rules. ``PM_NCCL_RULES=1`` (or ``bound``) in a CPU worker's
environment makes the trainer (``ProtocolTrainer.init_distributed``) create the world group, and
so every group derived from it, with the backend ``nccl_rules`` (registered through torch's
backend registry, ``Backend.register_backend``) instead of gloo. Nothing of torch or TorchTitan
is replaced: torch's own ``distributed_c10d`` and pipelining code run as they are and take the
branches they take on NCCL, because the backend has NCCL's properties:

* **One ``Work`` per coalesced batch.** ``supports_coalescing`` is true, so torch's
  ``batch_isend_irecv`` runs its ops inside ``_coalescing_manager`` and returns the one ``Work``
  of ``end_coalescing`` (``torch/distributed/distributed_c10d.py``), as ProcessGroupNCCL does.
* **R1, which communicator an op uses.** A single ``send``/``recv`` runs on a two-rank
  communicator of its (group, pair of ranks), created on its first use; a coalesced batch on the
  group's own communicator (ProcessGroupNCCL's ``pointToPoint`` keys a single op by
  ``getKeySendRecv(rank, peer)``, a batch by the group). With a bound device (``bound``, as
  ``init_process_group(device_id=...)``) single ops run on the group's too.
* **R2, set-up blocks.** A communicator's first op blocks the calling thread until every member
  has issued its first op there (``ncclCommInitRank``); so does the first message between two of
  its ranks in each direction, until the other side has issued its op for it (NCCL connects
  point-to-point peers lazily, at the first ``ncclGroupEnd`` that has them).
* **R3, matching.** Ops on different communicators never match; on one communicator the n-th
  send from A to B matches B's n-th receive from A, whatever their tags (a size mismatch is
  reported: NCCL's "message truncated").
* **R4, issue order.** One communicator runs its ops in the order they were issued: a pending
  receive holds every later op of that communicator, sends included. A send completes only when
  its receive has been posted (NCCL's contract; its socket transport often completes a small send
  earlier, so the mode is the stricter of the two).
* **R5.** ``split_group`` needs a bound device: torch's own check raises, as on NCCL (the backend
  does not support splitting, and a CPU group cannot be bound).
* **R6, device-wide waits.** A device-wide wait waits for every op the rank has issued and not
  finished (on CUDA a pending receive is a kernel on the device): the CPU device module's
  ``synchronize`` and ``empty_cache`` (``tools.cpu_shim``, where TorchTitan calls them) call
  ``device_wide_wait``. (The plugin itself makes no device-wide wait.)
* **Element types.** A tensor of a type ProcessGroupNCCL has no NCCL type for
  (``getNcclDataType``: ``NCCL_DTYPES``) is refused with NCCL's words.
* **The abort path.** TorchTitan sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``: a point-to-point
  op that outlives its group's timeout since it was issued makes NCCL's watchdog abort the
  communicator and end the process. Here a worker waiting for such an op ends the same way
  (``NcclWatchdogAbort``, a ``LinkFault``: the launcher restarts the run, which resumes from its
  last complete checkpoint); an op nobody waits for is not watched.

Collectives run on a gloo group of the same ranks (they are not ordered with a group
communicator's point-to-point batches). Each emulated communicator moves its point-to-point
bytes over a two-rank gloo group per pair of members that exchange messages (created through the
world's store, keyed by the communicator's name, once the pair's set-up rendezvous of R2 is done
there), with a thread per communicator that runs its ops one unit at a time (R4; a batch is one
unit) and tags the n-th message of each direction ``n`` (R3). A rule broken is one line
(``NcclRuleBroken``, exit code 2 from ``protocol_models.train``) naming the rule, the ranks, the
communicator and the two ops, raised by the waiting rank once it has waited
``PM_NCCL_RULES_WAIT_S`` seconds (default 20) and the rank it waits for has been waiting as long
for it in turn (each rank publishes what it waits in and what it has pending); either rank of
the cycle may be the one that reports it. A wait no such pair explains (a longer cycle, or a peer
just busy for ten times the bound) ends in a ``no progress`` line, so the mode never hangs
silently.

Not modelled: CUDA streams (here ``wait()`` blocks the host; on CUDA it returns at once and the
stream waits); ``Work.is_completed()`` of a point-to-point op (torch 2.14 hands a Python
backend's ``Work`` back through a holder that does not ask it, so it reads False; NCCL's reads
its CUDA event); ``irecv`` from any source (refused: NCCL has none); memory per communicator.
The backend refuses to start where CUDA would be used: it is a CPU test of the GPU path.
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import Backend as C10dBackend
from torch._C._distributed_c10d import ProcessGroupGloo

from protocol_models.tools.errors import ConfigError, LinkFault, UserError

ENV = "PM_NCCL_RULES"
"""``1``: the rules of an unbound default group (TorchTitan 0.3.0's default); ``bound``: of a
device-bound one (R1)."""
WAIT_ENV = "PM_NCCL_RULES_WAIT_S"
MODES = ("1", "bound")
BACKEND = "nccl_rules"
"""The backend's name in torch's registry (``dist.get_backend`` reports it)."""
PREFIX = "nccl_rules"
POLL_S = 0.2
NCCL_DTYPES = (torch.uint8, torch.int8, torch.int32, torch.int64, torch.float16,
               torch.bfloat16, torch.float32, torch.float64, torch.bool, torch.float8_e4m3fn,
               torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)  # fmt: skip
"""Element types ProcessGroupNCCL maps to an NCCL type (``getNcclDataType`` in
``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``; bool and the float8 types NCCL lacks
travel as uint8); any other tensor must travel as a uint8 view of its bytes."""
_OP_IDS = itertools.count()


class NcclRuleBroken(UserError):
    """A point-to-point pattern that NCCL would hang on or refuse; ``str(e)`` is one line."""


class NcclWatchdogAbort(LinkFault):
    """A wait outlived its group's timeout: NCCL's watchdog aborts the communicator and the
    process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``); the run restarts from its checkpoint."""


def mode(env=os.environ) -> str | None:
    """The rules asked for (``MODES``), None when off; anything else is refused."""
    value = env.get(ENV, "")
    if value in ("", "0"):
        return None
    if value not in MODES:
        raise ConfigError(f"{ENV}={value}: expected 1 (unbound default group), bound, or 0/unset")
    return value


def enabled(env=os.environ) -> bool:
    return mode(env) is not None


def check_device(device: str) -> None:
    """A bad ``PM_NCCL_RULES`` is refused in one line; so is the emulation, a CPU test of the GPU
    path, on a run that trains on ``device`` other than the CPU."""
    if enabled() and device != "cpu":
        raise ConfigError(
            f"{ENV}={os.environ[ENV]}: the CPU emulation of NCCL runs on the CPU only, and this "
            f"run trains on {device!r} (real NCCL); unset {ENV}"
        )


@dataclass
class Op:
    """One point-to-point op as the rules see it."""

    kind: str
    """``"send"`` or ``"recv"``."""
    peer: int
    """The other rank, global."""
    tensor: torch.Tensor
    tag: int = 0
    """The caller's tag (ignored by the matching, shown in reports)."""
    seq: int = 0
    """Its place among this rank's messages to (send) or from (recv) ``peer`` on its
    communicator: the tag gloo matches on."""
    done: bool = False
    id: int = field(default_factory=lambda: next(_OP_IDS))
    """This process's number for it (two ops may describe alike)."""

    def describe(self) -> str:
        t = self.tensor
        where = f"to rank {self.peer}" if self.kind == "send" else f"from rank {self.peer}"
        dtype = str(t.dtype).removeprefix("torch.")
        return f"i{self.kind} {where} ({list(t.shape)} {dtype}, tag {self.tag})"


@dataclass
class _Unit:
    """What a communicator runs as one: a single op, or a batch's ops together."""

    comm: _Comm
    ops: list[Op]
    timeout_s: float
    """The issuing group's timeout when it was issued (the watchdog's bound)."""
    issued_at: float = field(default_factory=time.time)
    """When it was issued: NCCL's watchdog times an op from there, not from its wait."""
    event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Work(dist.Work):
    """What the backend returns for point-to-point ops: ``wait()`` blocks until every unit it
    covers ran, diagnosing a wait that grows past the bound (``_Rules.wait_for``)."""

    def __init__(self, units: list[_Unit] | None = None):
        super().__init__()
        self.units = [] if units is None else units
        """Filled at ``end_coalescing`` for an op issued inside a batch."""

    def wait(self, timeout: timedelta | None = None) -> bool:
        for unit in self.units:
            RULES.wait_for(unit, unit.ops[0])
        return True


class _Comm:
    """One emulated NCCL communicator: its members (global ranks, sorted), a two-rank gloo
    group per peer this rank has a connection with (what moves the bytes), and the thread that
    runs its units in issue order."""

    def __init__(self, name: str, members: list[int], rank: int):
        self.name, self.members, self.rank = name, members, rank
        self.pairs: dict[int, dist.ProcessGroup] = {}
        """peer -> the gloo group of this rank and ``peer`` (rank 0: the lower)."""
        self.sends: dict[int, int] = {}
        self.recvs: dict[int, int] = {}
        self.links: set[tuple[int, int]] = set()
        """``(sender, receiver)`` pairs this rank has set up on the communicator."""
        self.units: list[_Unit] = []
        """Issued and not yet run, in issue order (the first is running)."""
        self.lock = threading.Lock()
        self.todo: queue.Queue[_Unit] = queue.Queue()
        threading.Thread(target=self._run, name=f"nccl-rules {name}", daemon=True).start()

    def issue(self, ops: list[Op], timeout_s: float) -> _Unit:
        for op in ops:
            counts = self.sends if op.kind == "send" else self.recvs
            op.seq = counts.get(op.peer, 0)
            counts[op.peer] = op.seq + 1
        unit = _Unit(self, ops, timeout_s)
        with self.lock:
            self.units.append(unit)
        self.todo.put(unit)
        return unit

    def _run(self) -> None:
        while True:
            unit = self.todo.get()
            try:
                self._move(unit)
            except Exception as e:  # gloo's (a peer gone), a rule's: the waiter raises it
                unit.error = e
            for op in unit.ops:
                op.done = True
            with self.lock:
                self.units.remove(unit)
            unit.event.set()
            RULES.changed()

    def _move(self, unit: _Unit) -> None:
        """Run ``unit``'s ops on gloo: each message's size first (tag ``2 seq``), as NCCL's socket
        transport does, so that a send larger than its receive is reported (NCCL: "message
        truncated") instead of aborting gloo; then its bytes (tag ``2 seq + 1``)."""
        sizes = {}
        works = []
        for op in unit.ops:
            pg, peer, nbytes = self.pairs[op.peer], int(op.peer > self.rank), _bytes(op.tensor)
            sizes[id(op)] = torch.tensor([nbytes.numel()], dtype=torch.int64)
            call = pg.send if op.kind == "send" else pg.recv
            works.append(call([sizes[id(op)]], peer, 2 * op.seq))
        for work in works:
            work.wait()
        works = []
        for op in unit.ops:
            pg, peer, nbytes = self.pairs[op.peer], int(op.peer > self.rank), _bytes(op.tensor)
            if op.kind == "send":
                works.append(pg.send([nbytes], peer, 2 * op.seq + 1))
                continue
            sent = int(sizes[id(op)])
            if sent > nbytes.numel():
                raise NcclRuleBroken(
                    f"NCCL rule R3 (on one communicator sends and receives match in issue order, "
                    f"tags ignored): rank {self.rank}'s {op.describe()} on {self.name} is matched "
                    f"with rank {op.peer}'s message number {op.seq} on it, of {sent} bytes "
                    f"(NCCL: message truncated)"
                )
            works.append(pg.recv([nbytes[:sent]], peer, 2 * op.seq + 1))
        for work in works:
            work.wait()


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as bytes (NCCL moves contiguous tensors only)."""
    if not tensor.is_contiguous():
        raise NcclRuleBroken(
            f"NCCL sends and receives contiguous tensors only; got one of shape "
            f"{list(tensor.shape)} and strides {list(tensor.stride())}"
        )
    return tensor.reshape(-1).view(torch.uint8)


def _check_dtypes(tensors: list[torch.Tensor]) -> None:
    """Refuse, with ProcessGroupNCCL's words, a tensor NCCL has no type for."""
    for t in tensors:
        if t.dtype not in NCCL_DTYPES:
            raise NcclRuleBroken(
                f"Input tensor data type is not supported for NCCL process group: {t.dtype} "
                f"(NCCL transfers {', '.join(str(d).removeprefix('torch.') for d in NCCL_DTYPES)};"
                " send other types as a uint8 view of their bytes)"
            )


class NcclRulesBackend(C10dBackend):
    """The ``nccl_rules`` backend of one process group (module docstring): collectives on a gloo
    group of its ranks, point-to-point ops under NCCL's rules."""

    def __init__(self, opts) -> None:
        super().__init__(opts.group_rank, opts.group_size)
        self.ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        """The group's global ranks, by group rank."""
        self.group_name = str(opts.group_id)
        self.timeout = opts.timeout
        self.gloo = ProcessGroupGloo(dist.PrefixStore("gloo/", opts.store), opts.group_rank,
                                     opts.group_size, opts.timeout)  # fmt: skip
        self._batch: list[tuple[Op, _Work]] | None = None
        """Inside ``start_coalescing``: the ops issued so far, each with its ``Work``."""
        self._label: str | None = None

    # -- NCCL's properties ---------------------------------------------------------------------

    @property
    def supports_coalescing(self) -> bool:
        return True

    def getBackendName(self) -> str:  # noqa: N802 (the name torch's C++ dispatch looks up)
        return BACKEND

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout = timeout
        self.gloo.set_timeout(timeout)

    @property
    def options(self) -> C10dBackend.Options:
        """The backend's options, as NCCL's and gloo's expose them (``_timeout``: the group's)."""
        return C10dBackend.Options(BACKEND, self.timeout)

    def label(self) -> str:
        """The group's name in reports: its description (``group_desc``), name and ranks."""
        if self._label is None:
            desc = getattr(c10d._resolve_process_group(self.group_name), "group_desc", "")
            ranks = ",".join(map(str, self.ranks))
            shown = (f"{desc!r} (name {self.group_name}, " if desc and desc != "undefined"
                     else f"{self.group_name} (")  # fmt: skip
            self._label = f"group {shown}ranks {ranks})"
        return self._label

    # -- point to point ------------------------------------------------------------------------

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> _Work:
        return self._p2p("send", tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> _Work:
        return self._p2p("recv", tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        raise NcclRuleBroken("NCCL receives from one named rank; irecv from any source has no "
                             "NCCL equivalent")  # fmt: skip

    def _p2p(self, kind: str, tensors: list[torch.Tensor], group_peer: int, tag: int) -> _Work:
        (tensor,) = tensors
        _check_dtypes(tensors)
        op = Op(kind, self.ranks[group_peer], tensor, tag)
        work = _Work()
        if self._batch is not None:
            self._batch.append((op, work))
            return work
        comm = RULES.comm_for(self, op.peer, batched=False, first=op)
        work.units.append(RULES.issue(comm, [op], self.timeout.total_seconds()))
        return work

    def start_coalescing(self) -> None:
        self._batch = []

    def end_coalescing(self) -> _Work:
        """The batch's one ``Work``: its ops run on the group's communicator as one unit (R1)."""
        batch, self._batch = self._batch or [], None
        if not batch:
            return _Work()
        ops = [op for op, _ in batch]
        comm = RULES.comm_for(self, ops[0].peer, batched=True, first=ops[0])
        unit = RULES.issue(comm, ops, self.timeout.total_seconds())
        for _, work in batch:
            work.units.append(unit)
        return _Work([unit])

    # -- collectives: gloo's, refusing what NCCL has no type for ----------------------------

    def allreduce(self, tensors, opts):
        _check_dtypes(tensors)
        return self.gloo.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors, opts):
        _check_dtypes(tensors)
        return self.gloo.allreduce_coalesced(tensors, opts)

    def broadcast(self, tensors, opts):
        _check_dtypes(tensors)
        return self.gloo.broadcast(tensors, opts)

    def allgather(self, outputs, inputs, opts):
        _check_dtypes(inputs)
        return self.gloo.allgather(outputs, inputs, opts)

    def all_gather_single(self, output, input, opts):
        _check_dtypes([input])
        return self.gloo.all_gather_single(output, input, opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        _check_dtypes(inputs)
        return self.gloo.all_gather_single_coalesced(outputs, inputs, opts)

    def allgather_coalesced(self, outputs, inputs, opts):
        _check_dtypes(inputs)
        return self.gloo.allgather_coalesced(outputs, inputs, opts)

    def reduce_scatter(self, outputs, inputs, opts):
        _check_dtypes(outputs)
        return self.gloo.reduce_scatter(outputs, inputs, opts)

    def reduce_scatter_single(self, output, input, opts):
        _check_dtypes([input])
        return self.gloo.reduce_scatter_single(output, input, opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        _check_dtypes(inputs)
        return self.gloo.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def all_to_all_single(self, output, input, output_splits, input_splits, opts):
        _check_dtypes([input])
        return self.gloo.all_to_all_single(output, input, output_splits, input_splits, opts)

    def gather(self, outputs, inputs, opts):
        _check_dtypes(inputs)
        return self.gloo.gather(outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts):
        _check_dtypes(outputs)
        return self.gloo.scatter(outputs, inputs, opts)

    def reduce(self, tensors, opts):
        _check_dtypes(tensors)
        return self.gloo.reduce(tensors, opts)

    def barrier(self, opts):
        return self.gloo.barrier(opts)


def _create(opts, backend_options) -> NcclRulesBackend:
    """torch's factory call for a new group (``extended_api``): the world's is the first."""
    backend = NcclRulesBackend(opts)
    if not opts.global_ranks_in_group:
        RULES.start(opts.store, opts.group_rank, opts.group_size, bound=mode() == "bound")
    return backend


def register() -> None:
    """Add ``nccl_rules`` to torch's backend registry (idempotent; nothing else changes)."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


def init_process_group(timeout: timedelta) -> None:
    """Create the world group on the emulated backend (before TorchTitan would create it on
    gloo: it keeps an initialized default group), as TorchTitan's ``init_distributed`` would:
    autograd on one thread (its device-mesh state is thread-local)."""
    register()
    torch.autograd.set_multithreading_enabled(False)
    dist.init_process_group(BACKEND, timeout=timeout)


def device_wide_wait() -> None:
    """R6: what a device-wide wait does to this rank's point-to-point ops (nothing outside the
    emulation): it waits until every op it issued has run."""
    if RULES.started:
        RULES.wait_all()


class _Rules:
    """The per-process state of the mode: the emulated communicators, this rank's published
    state (what it waits in, what it has pending) and the diagnosis of a long wait."""

    def __init__(self) -> None:
        self.started = False
        self.bound = False
        self.rank = 0
        self.world = 1
        self.store: dist.Store | None = None
        """The world group's store: every rank's published state, every set-up rendezvous."""
        self.comms: dict[str, _Comm] = {}
        self.lock = threading.Lock()
        self.blocked: dict | None = None
        self._dirty = threading.Event()

    def start(self, store: dist.Store, rank: int, world: int, bound: bool) -> None:
        """At the world group's creation: this rank's place, and the thread that publishes its
        state once it changed."""
        self.store, self.rank, self.world, self.bound = store, rank, world, bound
        self.started = True
        threading.Thread(target=self._publish, name="nccl-rules state", daemon=True).start()

    # -- communicators -------------------------------------------------------------------------

    def comm_for(self, backend: NcclRulesBackend, peer: int, batched: bool, first: Op) -> _Comm:
        """The communicator an op with ``peer`` on ``backend``'s group runs on (R1), created on
        first use: unbound, when every member has issued its first op there (R2); bound, at
        once (NCCL created it with the group)."""
        if batched or self.bound:
            name = f"the group communicator of {backend.label()}"
            members = backend.ranks
        else:
            pair = sorted((self.rank, peer))
            name, members = f"the pair communicator {pair[0]}-{pair[1]} of {backend.label()}", pair
        with self.lock:
            comm = self.comms.get(name)
        if comm is None:
            comm = self._create(name, sorted(members), first)
        return comm

    def _create(self, name: str, members: list[int], first: Op) -> _Comm:
        if not self.bound:
            key = f"{PREFIX}/comm/{name}"
            joined = {f"{key}/joined/{m}": m for m in members}
            self._rendezvous({f"{key}/joined/{self.rank}"}, joined, name, first)
        comm = _Comm(name, members, self.rank)
        with self.lock:
            self.comms[name] = comm
        self.changed()
        return comm

    def issue(self, comm: _Comm, ops: list[Op], timeout_s: float) -> _Unit:
        """R2: the first message in each direction between two ranks of ``comm`` waits until
        the other side has issued its op for it (a batch's new peers together); then ``ops``
        join ``comm``'s queue as one unit."""
        me = self.rank
        key = f"{PREFIX}/comm/{comm.name}/link"
        mine, theirs = set(), {}
        for op in ops:
            link = (me, op.peer) if op.kind == "send" else (op.peer, me)
            if link in comm.links:
                continue
            comm.links.add(link)
            mine.add(f"{key}/{link[0]}->{link[1]}/{op.kind}")
            other = "recv" if op.kind == "send" else "send"
            theirs[f"{key}/{link[0]}->{link[1]}/{other}"] = op.peer
        if mine:
            self._rendezvous(mine, theirs, comm.name, ops[0])
        for peer in sorted({op.peer for op in ops} - set(comm.pairs)):  # both sides are here
            pair = sorted((me, peer))
            store = dist.PrefixStore(f"{PREFIX}/comm/{comm.name}/gloo/{pair[0]}-{pair[1]}",
                                     self.store)  # fmt: skip
            comm.pairs[peer] = ProcessGroupGloo(store, pair.index(me), 2,
                                                timedelta(seconds=timeout_s))  # fmt: skip
        return comm.issue(ops, timeout_s)

    def _rendezvous(self, mine: set[str], theirs: dict[str, int], comm: str, first: Op) -> None:
        """Publish the keys ``mine``, then wait (blocked) until every key of ``theirs`` (key ->
        the rank that sets it) is there."""
        for key in mine:
            self.store.set(key, "1")
        self._block(_blocked("set-up", comm, first))
        try:
            self._wait(
                lambda: self.store.check(list(theirs)),
                lambda waited: self._diagnose_setup(theirs, comm, first, waited),
            )
        finally:
            self._unblock()

    # -- waiting -------------------------------------------------------------------------------

    def wait_for(self, unit: _Unit, op: Op) -> None:
        if not unit.event.is_set():
            self._block(_blocked("wait", unit.comm.name, op))
            try:
                self._wait(
                    unit.event.is_set,
                    lambda waited: self._diagnose_wait(unit, op, waited),
                    unit,
                )
            finally:
                self._unblock()
        if unit.error is not None:
            raise unit.error

    def _pending(self) -> list[_Unit]:
        """The units this rank has issued and not yet run, communicator by communicator."""
        with self.lock:
            comms = list(self.comms.values())
        units = []
        for comm in comms:
            with comm.lock:
                units += comm.units
        return units

    def wait_all(self) -> None:
        """R6: wait (blocked, as ``sync``) until every unit this rank has issued has run."""
        for unit in self._pending():
            op = unit.ops[0]
            self._block(_blocked("sync", unit.comm.name, op))
            try:
                self._wait(unit.event.is_set,
                           lambda waited, u=unit, o=op: self._diagnose_sync(u, o, waited),
                           unit)  # fmt: skip
            finally:
                self._unblock()

    def _diagnose_sync(self, unit: _Unit, op: Op, waited: float) -> None:
        theirs = self._stuck(self._states().get(op.peer, {}), waited, self.rank)
        if theirs is not None:
            raise NcclRuleBroken(
                f"{R6} rank {self.rank}'s device-wide wait waits for its {op.describe()} on "
                f"{unit.comm.name}, and rank {op.peer} waits in {theirs['op']} on "
                f"{theirs['comm']}"
            )

    def _wait(self, ready, diagnose, unit: _Unit | None = None) -> None:
        """Until ``ready()``: wait on ``unit``'s event, else poll, from 1 ms up to ``POLL_S``
        apart; past the bound, ``diagnose(waited)`` raises when it finds the cycle; once
        ``unit`` has outlived its group's timeout since it was issued, NCCL's watchdog would
        abort the process."""
        bound = float(os.environ.get(WAIT_ENV, "20"))
        began, pause = time.time(), 0.001
        while not ready():
            if unit is not None:
                unit.event.wait(POLL_S)
            else:
                time.sleep(pause)
                pause = min(2 * pause, POLL_S)
            waited = time.time() - began
            if unit is not None and time.time() - unit.issued_at >= unit.timeout_s:
                raise NcclWatchdogAbort(
                    f"NCCL watchdog: rank {self.rank} waits in {self.blocked['op']} on "
                    f"{self.blocked['comm']}, issued {time.time() - unit.issued_at:.0f} s ago, "
                    f"past its group's timeout of {unit.timeout_s:.0f} s: the communicator is "
                    "aborted and the process ends "
                    "(TORCH_NCCL_ASYNC_ERROR_HANDLING=3); restarting from the last complete "
                    "checkpoint (needs --max-restarts)"
                )
            if waited >= bound:
                diagnose(waited)
            if waited >= 10 * bound:
                raise NcclRuleBroken(
                    f"no progress for {waited:.0f} s: rank {self.rank} waits in "
                    f"{self.blocked['op']} on {self.blocked['comm']}; other ranks: "
                    f"{self._others_text()}"
                )

    def _block(self, what: dict) -> None:
        self.blocked = what
        self.changed()

    def _unblock(self) -> None:
        self.blocked = None
        self.changed()

    # -- published state -----------------------------------------------------------------------

    def changed(self) -> None:
        self._dirty.set()

    def _publish(self) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            self.store.set(f"{PREFIX}/state/{self.rank}", json.dumps(self._state()))
            time.sleep(POLL_S / 2)

    def _state(self) -> dict:
        pending = [{"comm": unit.comm.name, "id": op.id, "op": op.describe()}
                   for unit in self._pending() for op in unit.ops]  # fmt: skip
        return {"blocked": self.blocked, "pending": pending, "now": time.time()}

    def _states(self) -> dict[int, dict]:
        out = {}
        for rank in range(self.world):
            key = f"{PREFIX}/state/{rank}"
            if rank != self.rank and self.store.check([key]):
                out[rank] = json.loads(self.store.get(key))
        out[self.rank] = self._state()
        return out

    def _others_text(self) -> str:
        parts = []
        for rank, state in sorted(self._states().items()):
            if rank == self.rank:
                continue
            b = state["blocked"]
            parts.append(f"rank {rank} " + (f"waits in {b['op']} on {b['comm']}" if b else "runs"))
        return "; ".join(parts) or "none published"

    @staticmethod
    def _stuck(state: dict, waited: float, on: int) -> dict | None:
        """What ``state``'s rank is blocked in, if it has been for about as long as we have and
        it waits for rank ``on``."""
        b = state.get("blocked")
        if b is None or b["peer"] != on or time.time() - b["since"] < waited / 2:
            return None
        return b

    # -- diagnosis -----------------------------------------------------------------------------

    def _diagnose_setup(self, keys: dict[str, int], comm: str, first: Op, waited: float) -> None:
        states = self._states()
        for key, member in keys.items():
            if self.store.check([key]):
                continue
            theirs = self._stuck(states.get(member, {}), waited, self.rank)
            if theirs is not None:
                raise NcclRuleBroken(
                    f"NCCL rule R2 (set-up blocks until the other side issues its op there): "
                    f"rank {self.rank}'s {first.describe()} on {comm} is the first there "
                    f"and waits for rank {member}, which waits in {theirs['op']} on "
                    f"{theirs['comm']}"
                )

    def _diagnose_wait(self, unit: _Unit, op: Op, waited: float) -> None:
        me, comm = self.rank, unit.comm
        with comm.lock:
            head = comm.units[0] if comm.units else None
        states = self._states()
        if head is not None and head is not unit:  # R4: held behind an earlier op
            held = head.ops[0]
            theirs = self._stuck(states.get(held.peer, {}), waited, me)
            if theirs is not None:
                raise NcclRuleBroken(
                    f"NCCL rule R4 (one communicator runs its ops in issue order): rank {me}'s "
                    f"{op.describe()} on {comm.name} is held behind its own {held.describe()}, "
                    f"and rank {held.peer} waits in {theirs['op']} on {theirs['comm']}"
                )
            return
        for mine in unit.ops:  # the peer waits for this rank too: which rule joins the two?
            peer = states.get(mine.peer, {})
            theirs = None if mine.done else self._stuck(peer, waited, me)
            if theirs is None:
                continue
            if theirs["what"] == "sync":
                raise NcclRuleBroken(
                    f"{R6} rank {mine.peer}'s device-wide wait waits for its {theirs['op']} on "
                    f"{theirs['comm']}, and rank {me} waits in {mine.describe()} on {comm.name}"
                )
            if theirs["what"] == "set-up":
                raise NcclRuleBroken(
                    f"NCCL rule R2 (set-up blocks until the other side issues its op there): "
                    f"rank {mine.peer}'s {theirs['op']} on {theirs['comm']} is the first there "
                    f"and waits for rank {me}, which waits in {mine.describe()} on {comm.name}"
                )
            ahead = [o for o in peer.get("pending", []) if o["comm"] == theirs["comm"]]
            if ahead and ahead[0]["id"] != theirs["id"]:
                raise NcclRuleBroken(
                    f"NCCL rule R4 (one communicator runs its ops in issue order): rank "
                    f"{mine.peer}'s {theirs['op']} on {theirs['comm']} is held behind its own "
                    f"{ahead[0]['op']}, and rank {me} waits in {mine.describe()} on {comm.name}"
                )
            if theirs["comm"] != comm.name and theirs["kind"] != mine.kind:
                raise NcclRuleBroken(
                    f"NCCL rule R3 (ops on different communicators never match): rank {me}'s "
                    f"{mine.describe()} on {comm.name} and rank {mine.peer}'s {theirs['op']} on "
                    f"{theirs['comm']}"
                )
            behind = [o for o in ahead[1:] if o["op"].startswith(f"isend to rank {me} ")]
            if theirs["comm"] == comm.name and mine.kind == theirs["kind"] == "recv" and behind:
                raise NcclRuleBroken(
                    f"NCCL rule R4 (one communicator runs its ops in issue order): rank "
                    f"{mine.peer}'s {behind[0]['op']} on {comm.name} is held behind its own "
                    f"{theirs['op']}, which waits for rank {me}, whose {mine.describe()} is "
                    "ahead of its own send there"
                )


RULES = _Rules()
R6 = ("NCCL rule R6 (a device-wide wait waits for every pending NCCL op, a pre-posted receive "
      "too):")  # fmt: skip


def _blocked(what: str, comm: str, op: Op) -> dict:
    """What a rank publishes while it is blocked: in a communicator's ``set-up``, a ``wait``
    or a device-wide ``sync``, for ``op`` on ``comm``."""
    return {"what": what, "comm": comm, "id": op.id, "op": op.describe(), "kind": op.kind,
            "peer": op.peer, "since": time.time()}  # fmt: skip
