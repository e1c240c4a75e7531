"""The process groups the pipeline's messages travel on under NCCL, connected at start-up.

NCCL's point-to-point rules (``protocol_models.tools.nccl_rules`` emulates them on CPU) decide
where a stage's messages may travel:

* a single op runs on a two-rank communicator of its (group, pair) -- on the group's own
  communicator once the default group has a bound device -- a batch on the group's, and one
  communicator runs its ops in the order they were issued, so two directions (or two peers)
  sharing one communicator queue behind each other;
* a communicator's first op, and the first message in each direction between two of its ranks,
  block the calling thread until the other side has issued its own.

So on NCCL every boundary and direction gets a group of its own (``group(direction,
boundary)``): each carries one sender's messages to one receiver, both in microbatch order, and
nothing else, whichever communicator NCCL picks for it (torch's schedules split a batch that
mixes groups into single ops per group). The reasons are two:

* full duplex: each direction has its own communicator, so its own issue order and its own
  connection, and forward activations and backward gradients do not queue behind each other (a
  stage's pending receive of a gradient never holds its next activation's send, nor the
  reverse), both directions of a link carrying at once;
* step-1 latency: every set-up is paid at start-up, not at a message in the middle of step 1.
  The groups are created over the pipeline's ranks by every stage in one order (``new_group``
  with local synchronization, as the norm exchange's), and connected when the stage is built:
  every stage sends or receives one element on each of its groups in that same order
  (``connect``), so each set-up finds its peer there (the first pair in the order has both sides
  waiting at it). A set-up costs round trips (the communicator's bootstrap, then one TCP connect
  per socket of its connection: ``scripts/multinode.env``), and for ``S >= 3`` stages these
  set-ups run ``S + 1`` deep one after another (docs/multinode.md, the NCCL path).

``split_group``, which torch's own per-direction communicators use, needs a bound device that
TorchTitan 0.3.0 does not give, and is not used.

gloo matches every message by peer and tag on connections it opens when a group is created, and
keeps the pipeline's own group (``follows_nccl``).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

DIRECTIONS = ("fwd", "bwd")


def follows_nccl(group: dist.ProcessGroup | None) -> bool:
    """Whether ``group``'s messages obey NCCL's rules: NCCL is among its backends (also
    ``cuda:nccl,cpu:gloo``, TorchTitan's with CPU offload, and ``nccl_rules``, the CPU emulation
    under ``PM_NCCL_RULES``)."""
    return "nccl" in str(dist.get_backend(group))


class BoundaryGroups:
    """One process group per (direction, boundary) of a pipeline (module docstring); built and
    connected collectively by the pipeline's ranks. Boundary ``b`` joins stage ``b`` and
    ``b + 1``; ``"fwd"`` messages flow from ``b`` to ``b + 1``, ``"bwd"`` back."""

    def __init__(self, pipeline: dist.ProcessGroup, timeout: timedelta | None = None):
        self.ranks = dist.get_process_group_ranks(pipeline)
        if self.ranks != sorted(self.ranks):
            raise ValueError(f"pipeline ranks {self.ranks} are not in stage order")
        self.groups = {
            (direction, boundary): dist.new_group(
                self.ranks, timeout=timeout, use_local_synchronization=True,
                group_desc=f"pipeline_{direction}_boundary{boundary}",
            )  # fmt: skip
            for direction in DIRECTIONS
            for boundary in range(len(self.ranks) - 1)
        }

    def group(self, direction: str, boundary: int) -> dist.ProcessGroup:
        return self.groups[(direction, boundary)]

    def all(self) -> list[dist.ProcessGroup]:
        return list(self.groups.values())

    def connect(self, stage: int, device: torch.device) -> None:
        """Send (the boundary's sender) or receive one element on each group this ``stage``
        belongs to, in the groups' order, so that every set-up happens here, with both sides
        present (module docstring)."""
        works = []
        for (direction, boundary), group in self.groups.items():
            sender = boundary if direction == "fwd" else boundary + 1
            receiver = boundary + 1 if direction == "fwd" else boundary
            if stage == sender:
                one = torch.ones(1, device=device)
                works.append(dist.isend(one, group=group, group_dst=receiver))
            elif stage == receiver:
                works.append(dist.irecv(torch.empty(1, device=device), group=group,
                                        group_src=sender))  # fmt: skip
        for work in works:
            work.wait()
