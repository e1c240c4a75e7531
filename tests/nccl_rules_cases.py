"""Point-to-point patterns for ``test_nccl_rules.py``, run by ``torchrun --nproc-per-node 2`` with
``PM_NCCL_RULES`` set: ``python tests/nccl_rules_cases.py CASE [CASE ...]``. The world group is
created on the emulated NCCL backend (``protocol_models.tools.nccl_rules``), and every case calls
torch's own functions. Each case is correct on gloo; the planted ones break one of NCCL's rules
and must end with that rule's one line (``error: NCCL rule Rn ...``, exit code 2; the watchdog's
abort: exit code 3); the others must pass.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from protocol_models.tools import cpu_shim, nccl_rules
from protocol_models.tools.errors import LinkFault


def peer() -> int:
    return 1 - dist.get_rank()


def warm(group: dist.ProcessGroup) -> None:
    """Connect ``group``'s pair communicator in both directions: rank 0 sends first."""
    x = torch.zeros(1)
    for sender in (0, 1):
        if dist.get_rank() == sender:
            dist.send(x, dst=peer(), group=group)
        else:
            dist.recv(x, src=peer(), group=group)


def ordered() -> None:
    """Two directions, each on its own warmed pair communicator, pre-posted receives: passes."""
    down, up = dist.new_group([0, 1]), dist.new_group([0, 1])
    me = dist.get_rank()
    x = torch.zeros(1)
    (dist.isend(x, dst=1, group=down) if me == 0 else dist.irecv(x, src=0, group=down)).wait()
    (dist.isend(x, dst=0, group=up) if me == 1 else dist.irecv(x, src=1, group=up)).wait()
    inbox = [torch.zeros(2) for _ in range(3)]
    works = [dist.irecv(b, src=peer(), group=up if me == 0 else down) for b in inbox]
    for i in range(3):
        dist.isend(torch.full((2,), float(10 * me + i)), dst=peer(), group=down if me == 0 else up)
    for w in works:
        w.wait()
    assert [b[0].item() for b in inbox] == [10 * peer() + i for i in range(3)], inbox


def tags_ignored() -> None:
    """R3: matched in issue order whatever the tags (passes; the values show the order)."""
    group = dist.new_group([0, 1])
    warm(group)
    if dist.get_rank() == 0:
        dist.send(torch.tensor([1.0]), dst=1, group=group, tag=1)
        dist.send(torch.tensor([2.0]), dst=1, group=group, tag=2)
    else:
        second, first = torch.zeros(1), torch.zeros(1)
        dist.recv(second, src=0, group=group, tag=2)  # on gloo: the message tagged 2
        dist.recv(first, src=0, group=group, tag=1)
        assert (second.item(), first.item()) == (1.0, 2.0), (second, first)


def batch_vs_single() -> None:
    """R1 + R3: a batched send (the group's communicator) and a single receive (the pair's)."""
    group = dist.new_group([0, 1])
    warm(group)
    x = torch.zeros(4)
    dist.batch_isend_irecv([dist.P2POp(dist.irecv, torch.zeros(1), peer(), group),
                            dist.P2POp(dist.isend, torch.zeros(1), peer(), group)])[0].wait()  # fmt: skip
    if dist.get_rank() == 0:
        dist.batch_isend_irecv([dist.P2POp(dist.isend, x, 1, group)])[0].wait()
    else:
        dist.irecv(x, src=0, group=group).wait()


def crossing(a: dist.ProcessGroup, b: dist.ProcessGroup, meanwhile=lambda: None) -> None:
    """Rank 1 posts a receive on ``a``, runs ``meanwhile``, then sends on ``b`` what rank 0
    waits for before it sends on ``a`` (correct on gloo)."""
    x, y = torch.zeros(1), torch.zeros(1)
    if dist.get_rank() == 1:
        pending = dist.irecv(x, src=0, group=a)
        meanwhile()
        dist.send(y, dst=0, group=b)
        pending.wait()
    else:
        dist.recv(y, src=1, group=b)
        dist.send(x, dst=1, group=a)


def first_recv_blocks() -> None:
    """R2: rank 1's first op on a pair communicator is a receive that rank 0 reaches only after
    a message from rank 1 on another communicator (the norm exchange's old pattern)."""
    crossing(dist.new_group([0, 1]), dist.new_group([0, 1]))


def different_groups() -> None:
    """R3: a send on one group's pair communicator, its receive on another's."""
    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])
    warm(a)
    warm(b)
    x = torch.zeros(1)
    if dist.get_rank() == 0:
        dist.send(x, dst=1, group=a)
    else:
        dist.recv(x, src=0, group=b)


def size_mismatch() -> None:
    """R3: the n-th send is larger than the n-th receive (NCCL: "message truncated")."""
    group = dist.new_group([0, 1])
    warm(group)
    if dist.get_rank() == 0:
        dist.send(torch.zeros(5), dst=1, group=group)
    else:
        dist.recv(torch.zeros(3), src=0, group=group)


def issue_order() -> None:
    """R4: rank 1 pre-posts a receive, then sends on the same communicator; rank 0 sends only
    after it received (one shared communicator per neighbour, both directions)."""
    group = dist.new_group([0, 1])
    warm(group)
    x, y = torch.zeros(1), torch.zeros(1)
    if dist.get_rank() == 1:
        pending = dist.irecv(x, src=0, group=group)
        dist.isend(y, dst=0, group=group).wait()
        pending.wait()
    else:
        dist.recv(y, src=1, group=group)
        dist.send(x, dst=1, group=group)


def mutual_receives() -> None:
    """R4: both ranks post a receive, then send, on one communicator: each send is held behind
    its own rank's receive, which waits for the other's send."""
    group = dist.new_group([0, 1])
    warm(group)
    x, y = torch.zeros(1), torch.zeros(1)
    pending = dist.irecv(x, src=peer(), group=group)
    dist.isend(y, dst=peer(), group=group)
    pending.wait()


def synchronize_pending() -> None:
    """R6: rank 1 pre-posts a receive, then synchronizes the device before it sends what rank 0
    needs before its send (a stage holding the next step's receives at TorchTitan's
    synchronize after the first step)."""
    import torchtitan.tools.utils as titan_utils

    down, up = dist.new_group([0, 1]), dist.new_group([0, 1])
    warm(down)  # connected: set-up is not what blocks
    warm(up)
    crossing(down, up, meanwhile=titan_utils.device_module.synchronize)


def empty_cache_pending() -> None:
    """R6 again: freeing the cached memory (CUDA's ``empty_cache``) waits for the device too."""
    import torchtitan.tools.utils as titan_utils

    down, up = dist.new_group([0, 1]), dist.new_group([0, 1])
    warm(down)
    warm(up)
    crossing(down, up, meanwhile=titan_utils.device_module.empty_cache)


def split() -> None:
    """R5: ``split_group`` without a bound device: torch's own check refuses it."""
    dist.split_group(split_ranks=[[0, 1]])


def batch_returns_one_work() -> None:
    """torch's ``batch_isend_irecv`` takes its NCCL branch: one ``Work`` for the whole batch."""
    x, y = torch.full((2,), float(dist.get_rank())), torch.zeros(2)
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer()),
                                    dist.P2POp(dist.irecv, y, peer())])  # fmt: skip
    assert len(works) == 1, works
    works[0].wait()
    assert y.tolist() == [float(peer())] * 2, y


def norm_exchange() -> None:
    """The gradient-norm exchange as a synchronous NCCL run builds and uses it (a batch at
    start-up and one at each clipping), and as the asynchronous schedule does (single ops on
    pair communicators connected at start-up, each batch's receives posted with this stage's
    own send), on every rank of the world: each gets the same global norm, ``sqrt(sum (r +
    1)^2)`` in the local norm's float32."""
    from protocol_models.wire.meter import WireMeter
    from protocol_models.wire.norm_exchange import NormExchange

    ranks, cpu = list(range(dist.get_world_size())), torch.device("cpu")
    mine = torch.tensor(float(1 + dist.get_rank()))
    expected = torch.tensor(float(sum((r + 1) ** 2 for r in ranks))).sqrt()
    synchronous = NormExchange(ranks, cpu, WireMeter(dim=4), None, nccl=True)
    synchronous.post()
    assert torch.equal(synchronous.global_norm(mine), expected)
    asynchronous = NormExchange(ranks, cpu, WireMeter(dim=4), None, nccl=True,
                                asynchronous=True)  # fmt: skip
    for batch in (1, 2):
        asynchronous.post_batch(batch)
        asynchronous.send(batch, mine)
    for batch in (1, 2):
        assert torch.equal(asynchronous.total(batch), expected)


def int16() -> None:
    """A type ProcessGroupNCCL has no NCCL type for (TopK's indices, sent unviewed)."""
    x = torch.zeros(3, dtype=torch.int16)
    (dist.isend(x, dst=1) if dist.get_rank() == 0 else dist.irecv(x, src=0)).wait()


def watchdog() -> None:
    """A receive whose message never comes outlives its group's 2 s timeout: NCCL's watchdog
    aborts the process (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), before the rules' bound (3 s in
    ``test_nccl_rules.py``)."""
    group = dist.new_group([0, 1], timeout=timedelta(seconds=2))
    warm(group)
    if dist.get_rank() == 1:
        dist.recv(torch.zeros(1), src=0, group=group)
    else:
        time.sleep(8)


CASES = {f.__name__: f for f in (ordered, tags_ignored, batch_vs_single, first_recv_blocks,
                                 different_groups, size_mismatch, issue_order, mutual_receives,
                                 synchronize_pending,
                                 empty_cache_pending, split, batch_returns_one_work, norm_exchange,
                                 int16, watchdog)}  # fmt: skip


def main() -> int:
    cpu_shim.install()  # as protocol_models.train does: TorchTitan's device module, on the CPU
    nccl_rules.init_process_group(timedelta(seconds=600))
    for name in sys.argv[1:]:
        try:
            CASES[name]()
        except nccl_rules.NcclRuleBroken as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 2
        except LinkFault as e:
            print(f"error: {e}", file=sys.stderr, flush=True)
            return 3
        print(f"rank {dist.get_rank()}: {name} passed", flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the rules' threads hold c10d objects: no interpreter teardown
