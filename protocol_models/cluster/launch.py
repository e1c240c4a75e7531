"""``torchrun`` for this plugin: ``python -m protocol_models.launch [torchrun args]``.

Same arguments as ``torchrun``; five differences:

* Multi-node ``c10d`` rendezvous (a fixed ``--nnodes``) honours ``--node_rank`` when it is
  given. torchrun's c10d rendezvous ignores it and numbers the nodes by host name, so
  TorchTitan's placement (pipeline stage ``s`` on global ranks ``s·D … s·D + D − 1``) would not
  follow the order the user gave. Here node ``n`` gets global ranks ``n·nproc_per_node …`` (see
  ``ProtocolRendezvous``); restarts and failure detection stay c10d's. (torchrun's
  ``static`` rendezvous also honours ``--node_rank``, but a restart reuses its store, whose keys
  from the previous attempt break the new process groups, and it does not restart the other
  nodes' workers.)
* Node 0 hosts the rendezvous store (``is_host``, unless ``--rdzv_conf`` says otherwise). c10d
  hosts it only on the machine whose host name or interface addresses match the endpoint's host,
  which is never true for an address behind NAT or a VPN's (``wg0``) address the host name does
  not resolve to: then no node hosts it and the rendezvous times out.
* A user error ends the run: it is deterministic (a missing file, a config the stages disagree
  on, a non-finite loss that a restart from the last checkpoint would meet again), so
  ``--max-restarts`` does not start the workers again to meet it again. A worker that stops
  with a user error leaves it in ``PROTOCOL_MODELS_USER_ERROR_FILE`` (set here, one per launch);
  before a restart the rendezvous finds it, closes the rendezvous (every node's agent then
  stops instead of restarting) and the launch ends with that line and exit code 2.
* Restarts (``--max-restarts``) get a fresh rendezvous store per attempt (see ``main``), and an
  agent waits out a partition of up to ``STORE_READ_TIMEOUT_S`` in the rendezvous.
* A failed job ends with one summary line rather than the launcher's own Python traceback.

Workers report their own errors (one ``error:`` line for user errors, a full traceback for bugs)
and record them in torchelastic's per-worker error file (``protocol_models.train``). When a worker
fails, torchrun raises ``ChildFailedError``; this wrapper prints the recorded error of the first
failing rank (the root cause: the others usually fail because it left) as one line, also when
``--local-ranks-filter`` hid that rank's output, and exits with the worker's code.
"""

from __future__ import annotations

import os
import sys
import tempfile
import uuid

from torch.distributed import PrefixStore
from torch.distributed.elastic.multiprocessing.errors import (
    ChildFailedError,
    ProcessFailure,
    record,
)
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.run import parse_args, parse_min_max_nnodes
from torch.distributed.run import run as torchrun_run

from protocol_models.tools.errors import USER_ERROR_FILE_ENV

RENDEZVOUS_BACKEND = "protocol-c10d"
"""The rendezvous backend ``main`` substitutes for ``c10d`` (and ``--standalone``'s c10d)."""
STORE_READ_TIMEOUT_S = 900
"""How long an agent's operation on the rendezvous store (on node 0) may wait (c10d's
``read_timeout``; torch's default is 60 s). Across a partition the agents of the far side wait
in it for the link to come back; with torch's 60 s their launcher gives up on a partition of a
few minutes while the workers' stall bound (``training.stall_watch``) has already restarted
them. 900 s is about as long as Linux keeps retransmitting on an open TCP connection
(``tcp_retries2 = 15``)."""


class ProtocolRendezvous(RendezvousHandler):
    """c10d rendezvous that ends the run after a user error and, given one, makes each node's
    rank the ``--node_rank`` it was started with.

    Before each round: if a worker of the previous attempt left a user error in
    ``user_error_file``, the rendezvous is closed (so no node's agent restarts) and
    ``RendezvousClosedError`` carries the error's line.

    ``node_rank``: every round, after c10d's join (which numbers the nodes by host name), each
    node publishes its ``node_rank`` in the round's store; once all have, the round's rank of each
    node becomes its ``node_rank`` (all nodes refuse the round if the ranks are not
    ``0 … nnodes − 1`` exactly once). Without a shared agent store the workers' store is hosted by
    global rank 0, so its address is then taken from the node that now has rank 0. Everything
    else is c10d's.
    """

    def __init__(self, inner: RendezvousHandler, node_rank: int | None, local_addr: str | None,
                 user_error_file: str | None = None):  # fmt: skip
        self._inner = inner
        self._node_rank = node_rank
        self._local_addr = local_addr
        self._user_error_file = user_error_file

    def next_rendezvous(self) -> RendezvousInfo:
        if self._user_error_file and os.path.isfile(self._user_error_file):
            with open(self._user_error_file) as f:
                line = f.read().strip()
            try:
                self._inner.set_closed()
            except RendezvousError:  # the store's host already ended the run (the same error)
                pass
            raise RendezvousClosedError(line)
        info = self._inner.next_rendezvous()
        if self._node_rank is None:
            return info
        store = PrefixStore("protocol_models/node_rank/", info.store)  # info.store is per round
        store.set(str(info.rank), str(self._node_rank))
        keys = [str(r) for r in range(info.world_size)]
        store.wait(keys)
        node_ranks = [int(v) for v in store.multi_get(keys)]
        if sorted(node_ranks) != list(range(info.world_size)):
            raise RendezvousError(
                f"the {info.world_size} nodes were started with node ranks {sorted(node_ranks)}; "
                f"each of 0..{info.world_size - 1} must be given to exactly one node"
            )
        bootstrap = info.bootstrap_store_info
        if not self._inner.use_agent_store:
            bootstrap = RendezvousStoreInfo.build(
                self._node_rank, PrefixStore("bootstrap/", store), local_addr=self._local_addr
            )
        return RendezvousInfo(info.store, self._node_rank, info.world_size, bootstrap)

    def get_backend(self) -> str:
        return RENDEZVOUS_BACKEND

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._inner.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def _create_rendezvous(params: RendezvousParameters) -> RendezvousHandler:
    """Registry hook: a c10d handler for ``params`` (minus ``node_rank``), wrapped. A node told
    to host the store that cannot (its port is taken: another node on this machine hosts it)
    joins as a client, as c10d's own guess would."""
    config = dict(params.config)
    node_rank = config.pop("node_rank", None)

    def c10d(**overrides: str) -> RendezvousHandler:
        return rendezvous_handler_registry.create_handler(
            RendezvousParameters(
                "c10d",
                params.endpoint,
                params.run_id,
                params.min_nodes,
                params.max_nodes,
                params.local_addr,
                **{**config, **overrides},
            )
        )

    try:
        inner = c10d()
    except RendezvousConnectionError:
        if config.get("is_host") != "1":
            raise
        inner = c10d(is_host="0")
    return ProtocolRendezvous(
        inner,
        None if node_rank is None else int(node_rank),
        params.local_addr,
        os.environ.get(USER_ERROR_FILE_ENV),
    )


rendezvous_handler_registry.register(RENDEZVOUS_BACKEND, _create_rendezvous)


def failure_summary(error: ChildFailedError, shown_local_ranks: set[int] | None) -> str | None:
    """The one line that names the root cause of a failed worker group: the first failing rank
    (``first_failure``), its exit code and its recorded error; with the path of its output when
    the filter hid it.

    ``None`` when it is a user error (exit code 2) whose ``error:`` line was shown: by that rank
    or by a shown rank that failed the same way (``shown_local_ranks`` None: all were shown).
    """
    rank, failure = first_failure(error)

    def shown(f: ProcessFailure) -> bool:
        return shown_local_ranks is None or f.local_rank in shown_local_ranks

    if failure.exitcode == 2 and any(
        shown(f) and f.exitcode == 2 and _reason(f) == _reason(failure)
        for f in error.failures.values()
    ):
        return None
    line = f"error: worker rank {rank} exited with code {failure.exitcode}: {_reason(failure)}"
    log = os.path.join(os.path.dirname(failure.error_file), "stderr.log")
    if not shown(failure) and os.path.isfile(log):
        line += f" (its output: {log})"
    return line


def first_failure(error: ChildFailedError) -> tuple[int, ProcessFailure]:
    """The rank that failed first, and its failure. torchelastic orders failures by the whole
    second of their error record (or, without one, of when it saw the process end) and breaks
    ties by dict order; a rank's record and the "connection closed" records of the peers it
    left behind often share a second, so within a second the earlier error file wins (its
    modification time), and a failure without a record comes last. When ranks hit the same
    error together (a user error every stage detects) and torchelastic terminated the first
    recorder while it was exiting, the rank that exited with that error stands for it."""

    def when(item: tuple[int, ProcessFailure]) -> tuple[int, float]:
        failure = item[1]
        try:
            return failure.timestamp, os.path.getmtime(failure.error_file)
        except OSError:  # no record ("<N/A>")
            return failure.timestamp, float("inf")

    rank, failure = min(error.failures.items(), key=when)
    if failure.exitcode < 0:  # ended by a signal: after recording the error a peer exited with?
        for peer_rank, peer in error.failures.items():
            if peer.exitcode > 0 and _reason(peer) == _reason(failure):
                return peer_rank, peer
    return rank, failure


def _reason(failure: ProcessFailure) -> str:
    """The recorded exception (``Type: message``, first line), or what torchelastic knows without
    a record: the signal that ended the process."""
    if failure.error_file_data.get("message") == "<NONE>":  # torchelastic's "no error file"
        return failure.message if failure.exitcode < 0 else "no error recorded"
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    lines = str(message).strip().splitlines()
    return lines[0] if lines else "an empty error record"


def rendezvous_conf(conf: str, node_rank: int | None) -> str:
    """``--rdzv_conf`` for ``ProtocolRendezvous``: the user's ``conf`` plus, with a node rank,
    ``node_rank`` and -- unless ``conf`` sets it -- ``is_host`` for node 0 alone; and, unless
    ``conf`` sets it, ``read_timeout`` = ``STORE_READ_TIMEOUT_S``."""
    extra = []
    if node_rank is not None:
        extra.append(f"node_rank={node_rank}")
        if "is_host=" not in conf:
            extra.append(f"is_host={int(node_rank == 0)}")
    if "read_timeout=" not in conf:
        extra.append(f"read_timeout={STORE_READ_TIMEOUT_S}")
    return ",".join(filter(None, [conf, *extra]))


def _node_rank_given(launcher_argv: list[str]) -> bool:
    """Whether ``--node_rank`` was given (as an option or as torchrun's ``PET_NODE_RANK``)."""
    names = ("--node_rank", "--node-rank")
    return "PET_NODE_RANK" in os.environ or any(a.split("=")[0] in names for a in launcher_argv)


def main(argv: list[str] | None = None) -> int:
    # A restarted worker group must not reuse the rendezvous' shared TCPStore: its keys from the
    # previous attempt (e.g. gloo peer addresses) are still there and race with the new ones,
    # so a restart after a killed worker can fail to connect. Without sharing, every attempt
    # gets a fresh store on a fresh port.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # where torchelastic copies a failed worker's error record (else it logs that it has none)
    os.environ.setdefault("TORCHELASTIC_ERROR_FILE", os.path.join(tempfile.mkdtemp(), "error.json"))
    # where a worker leaves a user error (one file per launch): the rendezvous then ends the run
    os.environ[USER_ERROR_FILE_ENV] = os.path.join(tempfile.mkdtemp(), "user_error")
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.standalone:  # what torchrun makes of it, so that the rendezvous below applies
        args.standalone, args.nnodes, args.rdzv_id = False, "1:1", str(uuid.uuid4())
        args.rdzv_backend, args.rdzv_endpoint = "c10d", "localhost:0"
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if args.rdzv_backend == "c10d":
        node_rank = None
        launcher_argv = argv[: len(argv) - len(args.training_script_args) - 1]
        if min_nodes == max_nodes > 1 and _node_rank_given(launcher_argv):
            if not 0 <= args.node_rank < max_nodes:
                print(
                    f"error: --node_rank {args.node_rank} is not one of 0..{max_nodes - 1} "
                    f"(--nnodes {max_nodes})",
                    file=sys.stderr,
                )
                return 2
            # passed on in rdzv_conf (torchrun would warn that c10d ignores it)
            node_rank, args.node_rank = args.node_rank, 0
        args.rdzv_backend = RENDEZVOUS_BACKEND
        args.rdzv_conf = rendezvous_conf(args.rdzv_conf, node_rank)
    try:
        record(torchrun_run)(args)
    except RendezvousClosedError as e:  # a user error here (its line) or on another node
        if not str(e):
            print("error: another node closed the rendezvous (a user error, or its launcher "
                  "gave up: see that node's output); not restarted", file=sys.stderr)  # fmt: skip
            return 2
        print(f"error: {str(e).removeprefix('error: ')} (not restarted: a user error would "
              "recur)", file=sys.stderr)  # fmt: skip
        return 2
    except RendezvousError as e:  # e.g. a node missing or two nodes with one --node_rank
        print(f"error: rendezvous failed: {e}", file=sys.stderr)
        return 2
    except ChildFailedError as e:
        shown = None
        if args.local_ranks_filter:
            shown = {int(r) for r in args.local_ranks_filter.split(",")}
        summary = failure_summary(e, shown)
        if summary is not None:
            print(summary, file=sys.stderr)
        _, failure = first_failure(e)
        return failure.exitcode if failure.exitcode > 0 else 1
    return 0
