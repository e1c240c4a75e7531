"""NCCL's point-to-point rules on gloo: a test mode for CPU runs (``PM_NCCL_RULES``).

Every user trains over NCCL; CI runs gloo on CPU, and the two backends take the same calls but
obey different rules. With ``PM_NCCL_RULES=1`` (or ``bound``) in a worker's environment,
``protocol_models.train`` installs this module before TorchTitan starts: ``torch.distributed``
then reports ``"nccl"`` as every group's backend, so the plugin takes its NCCL branches, and
every point-to-point call (``isend``, ``irecv``, ``send``, ``recv``, ``batch_isend_irecv``,
``split_group``) obeys the rules below while gloo moves the bytes.

* **R1, which communicator an op uses.** A single op runs on a two-rank communicator of its
  (group, pair of ranks), created on its first use; a batch (``batch_isend_irecv``) on the
  group's own communicator. With a bound device (``PM_NCCL_RULES=bound``, as torch's eager
  init with ``init_process_group(device_id=...)``) single ops run on the group's too.
* **R2, set-up blocks.** A communicator's first op blocks the calling thread until every
  member has issued its first op there (``ncclCommInitRank``); so does the first message
  between two of its ranks in each direction, until the other side has issued its op for it
  (NCCL connects point-to-point peers lazily, at the first ``ncclGroupEnd`` that has them).
* **R3, matching.** Ops on different communicators never match; on one communicator the n-th
  send from A to B matches B's n-th receive from A, whatever their tags (a size mismatch is
  reported).
* **R4, issue order.** One communicator runs its ops in the order they were issued: a pending
  receive holds every later op of that communicator, sends included. A send completes only
  when its receive has been posted (NCCL's contract; its socket transport often completes a
  small send earlier, so the mode is the stricter of the two).
* **R5.** ``split_group`` needs a bound device.
* **R6, synchronize.** A device-wide synchronize waits for every op the rank has issued and not
  finished (on CUDA a pending receive is a kernel on the device); TorchTitan's device module's
  ``synchronize`` does here.

Each emulated communicator moves its bytes over a two-rank gloo group per pair of its members
that exchange messages (created through the default store, keyed by the communicator's name,
once the pair's set-up rendezvous of R2 is done there), with a thread per member that runs its
ops one unit at a time (R4; a batch is one unit) and tags the n-th message of each direction
``n`` (R3). A rule broken is one line (``NcclRuleBroken``, exit code 2 from
``protocol_models.train``) naming the rule, the ranks, the communicator and the two ops, raised
by the waiting rank once it has waited ``PM_NCCL_RULES_WAIT_S`` seconds (default 20) and the
rank it waits for has been waiting as long for it in turn (each rank publishes what it waits
in and what it has pending); a wait no such pair explains (a longer cycle, or a peer just busy
for ten times the bound) ends in a ``no progress`` line, so the mode never hangs silently.

Not modelled: CUDA streams (here ``wait()`` blocks the host; on CUDA it returns at once and the
stream waits), collectives (they run on gloo as they are, not ordered with a group
communicator's batches), ``irecv`` from any source (refused: NCCL has none), and memory per
communicator.
"""

from __future__ import annotations

import functools
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

from protocol_models.tools.errors import ConfigError, UserError

ENV = "PM_NCCL_RULES"
"""``1``: the rules of an unbound default group (TorchTitan 0.3.0's default); ``bound``: of a
device-bound one (R1, R5)."""
WAIT_ENV = "PM_NCCL_RULES_WAIT_S"
MODES = ("1", "bound")
PREFIX = "nccl_rules"
_OP_IDS = itertools.count()
POLL_S = 0.2


class NcclRuleBroken(UserError):
    """A point-to-point pattern that NCCL would hang on or refuse; ``str(e)`` is one line."""


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
    blocking: bool = False
    """Issued by ``send``/``recv`` (else ``isend``/``irecv``, alone or in a batch)."""
    done: bool = False
    id: int = field(default_factory=lambda: next(_OP_IDS))
    """This process's number for it (two ops may describe alike)."""

    def describe(self) -> str:
        t = self.tensor
        where = f"to rank {self.peer}" if self.kind == "send" else f"from rank {self.peer}"
        dtype = str(t.dtype).removeprefix("torch.")
        call = ("" if self.blocking else "i") + self.kind
        return f"{call} {where} ({list(t.shape)} {dtype}, tag {self.tag})"


class Work:
    """What a wrapped op returns: ``wait()`` blocks until its unit ran (diagnosing a wait that
    grows past the bound), ``is_completed()`` does not."""

    def __init__(self, unit: _Unit, op: Op):
        self._unit, self._op = unit, op

    def wait(self, timeout: timedelta | None = None) -> bool:
        RULES.wait_for(self._unit, self._op)
        return True

    def is_completed(self) -> bool:
        return self._unit.event.is_set()

    def is_success(self) -> bool:
        return self._unit.event.is_set() and self._unit.error is None

    def exception(self):
        return self._unit.error


@dataclass
class _Unit:
    """What a communicator runs as one: a single op, or a batch's ops together."""

    comm: _Comm
    ops: list[Op]
    event: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


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

    def issue(self, ops: list[Op]) -> _Unit:
        for op in ops:
            counts = self.sends if op.kind == "send" else self.recvs
            op.seq = counts.get(op.peer, 0)
            counts[op.peer] = op.seq + 1
        unit = _Unit(self, ops)
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


class _Rules:
    """The per-process state of the mode: the emulated communicators, this rank's published
    state (what it waits in, what it has pending) and the diagnosis of a long wait."""

    def __init__(self) -> None:
        self.bound = False
        self.comms: dict[str, _Comm] = {}
        self.lock = threading.Lock()
        self.blocked: dict | None = None
        self._dirty = threading.Event()
        self._publisher = threading.Thread(target=self._publish, name="nccl-rules state",
                                           daemon=True)  # fmt: skip
        """Publishes this rank's state once it changed (started by ``install``)."""

    # -- communicators -------------------------------------------------------------------------

    @property
    def store(self) -> dist.Store:
        return c10d._get_default_store()

    def comm_for(self, group: dist.ProcessGroup | None, peer: int, batched: bool,
                 first: Op) -> _Comm:  # fmt: skip
        """The communicator an op with ``peer`` on ``group`` runs on (R1), created on first
        use: unbound, when every member has issued its first op there (R2); bound, at once (NCCL
        created it with the group)."""
        group = group if group is not None else c10d._get_default_group()
        label = group_label(group)
        if batched or self.bound:
            name = f"the group communicator of {label}"
            members = dist.get_process_group_ranks(group)
        else:
            pair = sorted((dist.get_rank(), peer))
            name, members = f"the pair communicator {pair[0]}-{pair[1]} of {label}", pair
        with self.lock:
            comm = self.comms.get(name)
        if comm is None:
            comm = self._create(name, sorted(members), first)
        return comm

    def _create(self, name: str, members: list[int], first: Op) -> _Comm:
        rank = dist.get_rank()
        if not self.bound:
            key = f"{PREFIX}/comm/{name}"
            joined = {f"{key}/joined/{m}": m for m in members}
            self._rendezvous({f"{key}/joined/{rank}"}, joined, name, first)
        comm = _Comm(name, members, rank)
        with self.lock:
            self.comms[name] = comm
        self.changed()
        return comm

    def issue(self, comm: _Comm, ops: list[Op]) -> _Unit:
        """R2: the first message in each direction between two ranks of ``comm`` waits until
        the other side has issued its op for it (a batch's new peers together); then ``ops``
        join ``comm``'s queue as one unit."""
        me = dist.get_rank()
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
            comm.pairs[peer] = dist.ProcessGroupGloo(store, pair.index(me), 2,
                                                     timedelta(seconds=600))  # fmt: skip
        return comm.issue(ops)

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
                    unit.event,
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
                           unit.event)  # fmt: skip
            finally:
                self._unblock()

    def _diagnose_sync(self, unit: _Unit, op: Op, waited: float) -> None:
        theirs = self._stuck(self._states().get(op.peer, {}), waited, dist.get_rank())
        if theirs is not None:
            raise NcclRuleBroken(
                f"{R6} rank {dist.get_rank()}'s synchronize waits for its {op.describe()} on "
                f"{unit.comm.name}, and rank {op.peer} waits in {theirs['op']} on "
                f"{theirs['comm']}"
            )

    def _wait(self, ready, diagnose, event: threading.Event | None = None) -> None:
        """Until ``ready()``: wait on ``event`` (a unit's), else poll, from 1 ms up to
        ``POLL_S`` apart; past the bound, ``diagnose(waited)`` raises when it finds the cycle."""
        bound = float(os.environ.get(WAIT_ENV, "20"))
        began, pause = time.time(), 0.001
        while not ready():
            if event is not None:
                event.wait(POLL_S)
            else:
                time.sleep(pause)
                pause = min(2 * pause, POLL_S)
            waited = time.time() - began
            if waited >= bound:
                diagnose(waited)
            if waited >= 10 * bound:
                raise NcclRuleBroken(
                    f"no progress for {waited:.0f} s: rank {dist.get_rank()} waits in "
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
            self.store.set(f"{PREFIX}/state/{dist.get_rank()}", json.dumps(self._state()))
            time.sleep(POLL_S / 2)

    def _state(self) -> dict:
        pending = [{"comm": unit.comm.name, "id": op.id, "op": op.describe()}
                   for unit in self._pending() for op in unit.ops]  # fmt: skip
        return {"blocked": self.blocked, "pending": pending, "now": time.time()}

    def _states(self) -> dict[int, dict]:
        out = {}
        for rank in range(dist.get_world_size()):
            key = f"{PREFIX}/state/{rank}"
            if rank != dist.get_rank() and self.store.check([key]):
                out[rank] = json.loads(self.store.get(key))
        out[dist.get_rank()] = self._state()
        return out

    def _others_text(self) -> str:
        parts = []
        for rank, state in sorted(self._states().items()):
            if rank == dist.get_rank():
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
            theirs = self._stuck(states.get(member, {}), waited, dist.get_rank())
            if theirs is not None:
                raise NcclRuleBroken(
                    f"NCCL rule R2 (set-up blocks until the other side issues its op there): "
                    f"rank {dist.get_rank()}'s {first.describe()} on {comm} is the first there "
                    f"and waits for rank {member}, which waits in {theirs['op']} on "
                    f"{theirs['comm']}"
                )

    def _diagnose_wait(self, unit: _Unit, op: Op, waited: float) -> None:
        me, comm = dist.get_rank(), unit.comm
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
                    f"{R6} rank {mine.peer}'s synchronize waits for its {theirs['op']} on "
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


RULES = _Rules()
R6 = ("NCCL rule R6 (a device-wide synchronize waits for every pending NCCL op, a pre-posted "
      "receive too):")  # fmt: skip


def _blocked(what: str, comm: str, op: Op) -> dict:
    """What a rank publishes while it is blocked: in a communicator's ``set-up`` or a
    ``wait``, for ``op`` on ``comm``."""
    return {"what": what, "comm": comm, "id": op.id, "op": op.describe(), "kind": op.kind,
            "peer": op.peer, "since": time.time()}  # fmt: skip


def group_label(group: dist.ProcessGroup) -> str:
    """``group``'s name in reports: its description (``group_desc``) and its ranks."""
    name = c10d._get_process_group_name(group)
    desc = getattr(group, "group_desc", "")
    ranks = ",".join(map(str, dist.get_process_group_ranks(group)))
    shown = f"{desc!r} (name {name}, " if desc and desc != "undefined" else f"{name} ("
    return f"group {shown}ranks {ranks})"


def _global(group: dist.ProcessGroup | None, rank: int | None, group_rank: int | None) -> int:
    if group_rank is not None:
        return dist.get_global_rank(group or c10d._get_default_group(), group_rank)
    if rank is None:
        raise NcclRuleBroken("NCCL receives from one named rank; irecv from any source has no "
                             "NCCL equivalent")  # fmt: skip
    return rank


def _single(kind: str, blocking: bool):
    """The rules' ``isend`` / ``irecv`` (``blocking``: ``send`` / ``recv``)."""

    def call(tensor, peer=None, group=None, tag=0, group_peer=None):
        op = Op(kind, _global(group, peer, group_peer), tensor, tag, blocking=blocking)
        comm = RULES.comm_for(group, op.peer, batched=False, first=op)
        work = Work(RULES.issue(comm, [op]), op)
        if blocking:
            work.wait()
            return op.peer if kind == "recv" else None
        return work

    if kind == "send":

        def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
            return call(tensor, dst, group, tag, group_dst)

        return isend

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        return call(tensor, src, group, tag, group_src)

    return irecv


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[Work]:
    """R1: a batch runs on its group's communicator, as one unit."""
    c10d._check_p2p_op_list(p2p_op_list)  # torch's: one group, isend/irecv only
    group = p2p_op_list[0].group
    ops = [Op("send" if p.op is c10d.isend else "recv", p.peer, p.tensor, p.tag)
           for p in p2p_op_list]  # fmt: skip
    comm = RULES.comm_for(group, ops[0].peer, batched=True, first=ops[0])
    unit = RULES.issue(comm, ops)
    return [Work(unit, op) for op in ops]


def _synchronize(original):
    """R6: a device-wide synchronize waits for every op this rank has issued and not finished
    (on CUDA, NCCL's pending kernels: a pre-posted receive among them)."""

    @functools.wraps(original)
    def synchronize(*args, **kwargs):
        RULES.wait_all()
        return original(*args, **kwargs)

    return synchronize


def _split_group(original):
    @functools.wraps(original)
    def split_group(*args, **kwargs):
        if not RULES.bound:
            raise NcclRuleBroken(
                "NCCL rule R5 (split_group needs a bound device): split_group was called and the "
                "default group has no bound device (NCCL: 'No device associated with the default "
                "pg, not safe to split any process groups'; TorchTitan binds one only with "
                "[comm] mode = \"torchcomms\")"
            )
        return original(*args, **kwargs)

    return split_group


def _get_backend(original):
    @functools.wraps(original)
    def get_backend(group=None):
        backend = original(group)
        return "nccl" if backend == "gloo" else backend

    return get_backend


_installed = False


def install() -> None:
    """Put the rules in place in this process (idempotent): ``torch.distributed``'s
    point-to-point calls and ``get_backend`` are replaced, in the package and in
    ``distributed_c10d`` (``P2POp`` checks its op against the latter's)."""
    global _installed
    if _installed:
        return
    _installed = True
    RULES.bound = mode() == "bound"
    RULES._publisher.start()
    replacements = {
        "isend": _single("send", blocking=False),
        "irecv": _single("recv", blocking=False),
        "send": _single("send", blocking=True),
        "recv": _single("recv", blocking=True),
        "batch_isend_irecv": batch_isend_irecv,
        "split_group": _split_group(c10d.split_group),
    }
    for name, replacement in replacements.items():
        setattr(c10d, name, replacement)
        setattr(dist, name, replacement)
    dist.get_backend = _get_backend(dist.get_backend)  # the package's: callers outside torch
    import torchtitan.tools.utils as titan_utils  # its device module: CPU shim's here (R6)

    module = titan_utils.device_module
    module.synchronize = _synchronize(module.synchronize)
