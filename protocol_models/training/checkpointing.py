"""Where a run's checkpoints live, and which one every rank resumes from.

TorchTitan's ``CheckpointManager`` writes one DCP checkpoint for the whole world: each rank its
own shard files, but ``.metadata`` and every replicated entry (U, the train state, the shared
data-loader state) only on rank 0. That needs a filesystem every node sees. Nodes in different
regions usually have only their own disks, so ``[checkpoint] per_node = true`` makes every node
write a self-contained checkpoint of its own ranks, coordinated by the node's own process group::

    <dump_folder>/<checkpoint.folder>/run.json
    <dump_folder>/<checkpoint.folder>/node-<i>-of-<n>/step-<N>/{.metadata, __<r>_0.distcp, ...}

Each node folder holds its ranks' shards plus its own copy of the replicated entries, so a node
resumes from its own disk. The node folders never collide: copied into one checkpoint folder they
form the whole run, which ``protocol_models.export`` reads (``checkpoint_files``).

Without ``per_node``, a run of several nodes checks at start-up that the checkpoint folder is one
folder every node sees, and stops with one line if it is not. Before loading, every rank
reports the complete steps it sees and all resume from the latest step every rank has; a rank
that sees none while another sees some stops the run with one line (e.g. a node whose disk was
replaced).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpoint import (
    DATALOADER,
    LR_SCHEDULER,
    MODEL,
    OPTIMIZER,
    TRAIN_STATE,
    AsyncMode,
    CheckpointManager,
)
from torchtitan.tools import filesystem
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import GarbageCollection

from protocol_models.tools.errors import ConfigError, StartupError
from protocol_models.tools.ranges import AT_LEAST_1, OneOf, Range, Ranges

_STEP = re.compile(r"step-(\d+)")


def node_folder_name(node: int, nodes: int) -> str:
    """A node's folder in a per-node checkpoint folder (``checkpoint_files.NODE_FOLDER``)."""
    return f"node-{node}-of-{nodes}"


def this_node() -> int:
    """This process's node rank (torchrun's ``GROUP_RANK``; 0 outside torchrun)."""
    return int(os.environ.get("GROUP_RANK", "0"))


def complete_step_numbers(folder: str) -> list[int]:
    """The steps with a complete DCP checkpoint (``step-N/.metadata``) in ``folder``, sorted
    (TorchTitan's rule for what it may load)."""
    if not filesystem.isdir(folder):
        return []
    steps = []
    for name in filesystem.listdir(folder):
        match = _STEP.fullmatch(name)
        if match and filesystem.isfile(filesystem.join(filesystem.join(folder, name), ".metadata")):
            steps.append(int(match.group(1)))
    return sorted(steps)


def nodes_of_ranks() -> list[int]:
    """Every rank's node rank, by global rank (a collective over the world)."""
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, this_node())
    return nodes


def node_groups() -> tuple[int, int, dist.ProcessGroup]:
    """``(this node, nodes, the gloo group of this node's ranks)``; every rank calls it (one
    ``new_group`` per node, in node order, as ``torch.distributed`` requires)."""
    nodes_of = nodes_of_ranks()
    node_ids = sorted(set(nodes_of))
    mine = None
    for node in node_ids:
        ranks = [r for r, n in enumerate(nodes_of) if n == node]
        group = dist.new_group(ranks, backend="gloo")
        if node == this_node():
            mine = group
    assert mine is not None
    return node_ids.index(this_node()), len(node_ids), mine


def shared_folder_problem(folder: str) -> str | None:
    """Whether every node sees ``folder`` as one folder (a collective over the world): each
    node's first rank leaves a file named by a token rank 0 drew and this node, then looks for
    every node's; the files are removed. None: shared (or one node); else what each node saw."""
    nodes_of = nodes_of_ranks()
    nodes = sorted(set(nodes_of))
    if len(nodes) == 1:
        return None
    token = [os.urandom(8).hex() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    first = dist.get_rank() == nodes_of.index(this_node())

    def marker(node: int) -> str:
        return os.path.join(folder, f".shared-check-{token[0]}-node{node}")

    if first:
        os.makedirs(folder, exist_ok=True)
        with open(marker(this_node()), "w"):
            pass
    dist.barrier()
    seen = [n for n in nodes if os.path.exists(marker(n))]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, seen if first else None)
    if first:
        os.remove(marker(this_node()))
    views = {nodes_of[r]: v for r, v in enumerate(everyone) if v is not None}
    if all(v == nodes for v in views.values()):
        return None
    return "; ".join(f"node {n} sees the files of node(s) {v}" for n, v in sorted(views.items()))


class ProtocolCheckpointManager(CheckpointManager):
    """TorchTitan's DCP checkpointing with an agreed resume step and, with ``per_node``, one
    self-contained checkpoint per node (layout in the module docstring)."""

    @dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        per_node: bool = False
        """Every node writes a self-contained checkpoint of its own ranks to
        ``<folder>/node-<i>-of-<n>/`` (no shared filesystem needed). To export, copy every node's
        ``node-*`` folder into one checkpoint folder."""

        RANGES: ClassVar[Ranges] = {
            "interval": AT_LEAST_1,
            "keep_latest_k": Range(low=2, also=(0,), note="0 = keep every checkpoint"),
            "load_step": Range(low=0, also=(-1,), note="-1 = the latest"),
            "exclude_from_loading": OneOf((OPTIMIZER, LR_SCHEDULER, DATALOADER, TRAIN_STATE)),
        }

        def __post_init__(self) -> None:
            CheckpointManager.Config.__post_init__(self)
            if self.per_node and self.last_save_in_hf:
                raise ConfigError(
                    "checkpoint.per_node = true writes DCP checkpoints only; set "
                    "checkpoint.last_save_in_hf = false and export with protocol_models.export"
                )

    def __init__(self, config: Config, **components: Any) -> None:
        super().__init__(config, **components)
        self.node_group: dist.ProcessGroup | None = None
        if not self.enable or not dist.is_initialized():
            return
        self.run_folder = self.folder
        """The run's checkpoint folder (``folder`` is this node's own in it, with ``per_node``)."""
        if config.per_node:
            node, nodes, self.node_group = node_groups()
            self.folder = filesystem.join(self.folder, node_folder_name(node, nodes))
            if self.pg is not None:  # the async modes' group: the node's, too
                self.pg = self.node_group
        elif not filesystem.is_remote(self.folder):
            problem = shared_folder_problem(self.folder)
            if problem:
                raise StartupError(
                    f"checkpoint.folder {self.folder!r} is not one folder every node sees "
                    f"({problem}): without a filesystem shared by every node set [checkpoint] "
                    "per_node = true"
                )

    def load(self, step: int = -1) -> bool:
        if self.enable and dist.is_initialized():
            step = self.agreed_step(step)
        return super().load(step=step)

    def agreed_step(self, requested: int) -> int:
        """The step every rank loads: ``requested`` (``checkpoint.load_step``) when every rank
        has it, else the latest step complete on every rank (-1: none anywhere, a fresh start).
        A rank that lacks the requested step, or sees no step another rank has in common with
        it, raises one line naming what each node sees."""
        seen: list = [None] * dist.get_world_size()
        dist.all_gather_object(seen, (this_node(), complete_step_numbers(self.folder)))
        common = set.intersection(*(set(steps) for _, steps in seen))
        latest = max((s for _, steps in seen for s in steps), default=-1)
        if requested == -1 and (common or latest == -1):
            step = max(common, default=-1)
            if step < latest:
                logger.warning(
                    f"checkpoint: step {latest} is not complete on every rank; resuming from "
                    f"step {step}, the latest every rank has"
                )
            return step
        if requested in common:
            return requested
        by_node: dict[int, set[int]] = {}
        for node, steps in seen:
            by_node.setdefault(node, set(steps))
            by_node[node] &= set(steps)
        what = "; ".join(
            f"node {n} sees {'steps ' + str(sorted(s)) if s else 'none'}"
            for n, s in sorted(by_node.items())
        )
        wanted = f"checkpoint.load_step = {requested}" if requested != -1 else "a resume"
        raise StartupError(
            f"{wanted}: the ranks do not see the same checkpoints in {self.run_folder!r} ({what}); "
            "without a filesystem shared by every node set [checkpoint] per_node = true, or "
            "copy the missing checkpoint onto the nodes that lack it"
        )

    def dcp_save(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        async_mode: AsyncMode,
        enable_garbage_collection: bool = False,
        to_hf: bool = False,
    ):
        if self.node_group is None or async_mode != AsyncMode.DISABLED or to_hf:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        with torch.no_grad():
            dcp.save(state_dict, checkpoint_id=checkpoint_id, process_group=self.node_group)
        if enable_garbage_collection:
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return None

    def dcp_load(
        self,
        state_dict: dict[str, Any],
        checkpoint_id: str,
        from_hf: bool,
        from_quantized: bool,
    ) -> None:
        if self.node_group is None or from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, checkpoint_id=checkpoint_id, process_group=self.node_group)
        if MODEL in self.states:  # TorchTitan flattens the model's entries into state_dict
            self.states[MODEL].load_state_dict(state_dict)
        return None

    def _should_purge(self) -> bool:
        """Per node, the node's first rank purges its own folder (TorchTitan: global rank 0)."""
        if self.node_group is None:
            return super()._should_purge()
        return (
            self.keep_latest_k > 0
            and dist.get_rank(self.node_group) == 0
            and filesystem.isdir(self.folder)
        )
