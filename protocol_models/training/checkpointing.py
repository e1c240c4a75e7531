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

A pipeline stage's FSDP group may span nodes (the 8B layout: a stage on two nodes of 8 GPUs), so
a node holds only its ranks' chunks of a sharded tensor. DCP's default save planner requires the
chunks of one save to cover every tensor whole; ``NodeSavePlanner`` instead checks what a node's
checkpoint guarantees (every chunk the node's ranks hold written exactly once, inside the tensor,
no two overlapping), so a node's ``.metadata`` lists its own chunks only. ``NodeLoadPlanner``
checks before reading that every rank's entries and chunks are in its node's folder (true when the
resume has the layout that saved): DCP's default load would leave a chunk it lacks unread.

Without ``per_node``, a run of several nodes checks at start-up that the checkpoint folder is one
folder every node sees, and stops with one line if it is not. Before loading, every rank
reports the complete steps it sees and all resume from the latest step every rank has; a rank
that sees none while another sees some stops the run with one line (e.g. a node whose disk was
replaced).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections import ChainMap, Counter
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_global_save_plan,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, SavePlan, WriteItemType
from torch.distributed.checkpoint.planner_helpers import _create_chunk_list
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torch.distributed.tensor import DTensor
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

from protocol_models.tools import gather
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
    return gather.all_gather_json(this_node())


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
    token = gather.all_gather_json(os.urandom(8).hex() if dist.get_rank() == 0 else None)[0]
    first = dist.get_rank() == nodes_of.index(this_node())

    def marker(node: int) -> str:
        return os.path.join(folder, f".shared-check-{token}-node{node}")

    if first:
        os.makedirs(folder, exist_ok=True)
        with open(marker(this_node()), "w"):
            pass
    dist.barrier()
    seen = [n for n in nodes if os.path.exists(marker(n))]
    everyone = gather.all_gather_json(seen if first else None)
    if first:
        os.remove(marker(this_node()))
    views = {nodes_of[r]: v for r, v in enumerate(everyone) if v is not None}
    if all(v == nodes for v in views.values()):
        return None
    return "; ".join(f"node {n} sees the files of node(s) {v}" for n, v in sorted(views.items()))


def _inside(size: torch.Size, chunk: ChunkStorageMetadata) -> bool:
    return all(
        0 <= o and 0 <= n and o + n <= d
        for o, n, d in zip(chunk.offsets, chunk.sizes, size, strict=True)
    )


def _overlap(a: ChunkStorageMetadata, b: ChunkStorageMetadata) -> bool:
    return all(
        ao < bo + bn and bo < ao + an
        for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes, strict=True)
    )


def node_plan_problems(all_plans: list[SavePlan], metadata: Metadata) -> list[str]:
    """What is wrong with a node's global save plan (empty: nothing): a chunk one of the node's
    ranks holds that the metadata does not list, a chunk listed twice, out of the tensor's bounds
    or overlapping another. Unlike DCP's check, the chunks need not cover the tensor: the node's
    ranks may hold part of it only (an FSDP group that spans nodes)."""
    problems: list[str] = []
    listed: Counter[tuple[str, tuple[int, ...], tuple[int, ...]]] = Counter()
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        for chunk in md.chunks:
            listed[key, tuple(chunk.offsets), tuple(chunk.sizes)] += 1
            if not _inside(md.size, chunk):
                problems.append(f"{key}: chunk {chunk} outside the tensor's size {list(md.size)}")
        chunks = [c for c in md.chunks if math.prod(c.sizes) > 0 and len(c.sizes) > 0]
        for i, a in enumerate(chunks):
            problems += [
                f"{key}: chunks {a} and {b} overlap" for b in chunks[i + 1 :] if _overlap(a, b)
            ]
    problems += [
        f"{key}: chunk at {off} listed {n} times" for (key, off, _), n in listed.items() if n > 1
    ]
    for plan in all_plans:
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
                if item.index.fqn not in metadata.state_dict_metadata:
                    problems.append(f"{item.index.fqn}: not written")
                continue
            chunk = item.tensor_data.chunk
            if (
                chunk is None
                or (item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes)) not in listed
            ):
                problems.append(f"{item.index.fqn}: a rank's chunk {chunk} not written")
    return problems


class NodeSavePlanner(DefaultSavePlanner):
    """DCP's default save planner with the global-plan check a node's checkpoint can pass
    (``node_plan_problems``) instead of DCP's, which also requires every tensor whole. Overrides
    the private ``DefaultSavePlanner._create_global_plan`` of torch 2.14 (the same steps: dedup
    the replicated entries, merge the plans, attach the flattening's mapping, check)."""

    def _create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        global_plan, metadata = create_default_global_save_plan(self._dedup_save_plans(all_plans))
        if self.flatten_state_dict:
            merged = dict(ChainMap(*(p.planner_data for p in global_plan)))
            metadata = dataclasses.replace(metadata, planner_data=merged)
        problems = node_plan_problems(all_plans, metadata)
        if problems:
            summary = "; ".join(problems)
            raise ValueError(f"node checkpoint: invalid global plan: {summary[:500]}")
        return global_plan, metadata


class NodeCheckpointLacks(Exception):
    """What ``NodeLoadPlanner`` raises on every rank when some rank's node checkpoint lacks what
    that rank needs; ``str(e)`` is one line (DCP wraps it in a ``CheckpointException``)."""


class NodeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that first checks, on every rank of every node, that the rank's
    entries and all of its chunks are in its node's checkpoint: DCP reads the saved chunks that
    overlap a rank's and silently leaves the rest, so a resume with another layout than the saved
    one (another split of the FSDP shards over the nodes) would train from partly loaded state.
    A collective over the world (every rank plans its load at the same point); when any rank
    lacks something, every rank raises the same ``NodeCheckpointLacks`` and keeps it in
    ``refusal``."""

    def __init__(self, checkpoint_id: str) -> None:
        super().__init__()
        self.checkpoint_id = checkpoint_id
        self.refusal: str | None = None

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        absent = [fqn for fqn in self.state_dict if fqn not in saved]
        plan, short, error = LoadPlan([]), [], None
        if not absent:
            try:
                plan = super().create_local_plan()
            except (RuntimeError, ValueError) as e:  # e.g. "Size mismatch between saved ..."
                error = (str(e).strip().splitlines() or [type(e).__name__])[0]
            else:
                short = self._short_of(plan)
        report = None
        if absent or short or error:
            report = (dist.get_rank(), this_node(), self.checkpoint_id, absent, short, error)
        reports = gather.all_gather_json(report)
        if any(reports):
            self.refusal = lacks_line(reports)
            raise NodeCheckpointLacks(self.refusal)
        return plan

    def _short_of(self, plan: LoadPlan) -> list[tuple[str, int, int]]:
        """``(name, elements read, elements held)`` of this rank's tensors whose saved chunks do
        not cover the rank's own (the chunks of one save never overlap: their sizes add up)."""
        read: Counter[str] = Counter()
        for item in plan.items:
            if item.type == LoadItemType.TENSOR:
                read[item.dest_index.fqn] += math.prod(item.lengths)
        short = []
        for fqn, obj in self.state_dict.items():
            if not isinstance(self.metadata.state_dict_metadata[fqn], TensorStorageMetadata):
                continue
            if isinstance(obj, DTensor) and obj.device_mesh.get_coordinate() is None:
                continue  # not on this rank's mesh: DCP reads nothing for it either
            held = sum(math.prod(c.sizes) for c in _create_chunk_list(obj))
            if read[fqn] < held:
                short.append((fqn, read[fqn], held))
        return short


def lacks_line(reports: list) -> str:
    """One line from the ranks' ``NodeLoadPlanner`` reports (None: that rank has everything)."""
    bad = [r for r in reports if r]
    rank, node, where, absent, short, error = bad[0]
    if error:
        what = error
    elif absent:
        more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
        what = f"entry {absent[0]}{more} not in it"
    else:
        fqn, read, held = short[0]
        more = f"; {len(short) - 1} more tensors short" if len(short) > 1 else ""
        what = f"{fqn}: {read} of the rank's {held} elements in it{more}"
    ranks = ", ".join(str(r[0]) for r in bad)
    return (
        f"checkpoint {where!r} lacks what rank {rank} (node {node}) needs ({what}; ranks lacking "
        f"something: {ranks}): a per-node checkpoint holds its node's own chunks only, and this "
        "one was written with another layout (node count or order, [parallelism] degrees, "
        "pipeline split); resume with the layout that wrote it"
    )


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
        seen = gather.all_gather_json((this_node(), complete_step_numbers(self.folder)))
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
        if self.node_group is None or to_hf:
            return super().dcp_save(
                state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf
            )
        # TorchTitan's calls, with the node's group and a planner a node's checkpoint passes
        save = {"checkpoint_id": checkpoint_id, "process_group": self.node_group,
                "planner": NodeSavePlanner()}  # fmt: skip
        if async_mode == AsyncMode.ASYNC:
            return dcp.async_save(state_dict, **save)
        if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
            return dcp.async_save(
                state_dict, **save, async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                async_stager=self.stager,
            )  # fmt: skip
        with torch.no_grad():
            dcp.save(state_dict, **save)
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
        planner = NodeLoadPlanner(checkpoint_id)
        try:
            dcp.load(
                state_dict, checkpoint_id=checkpoint_id, process_group=self.node_group,
                planner=planner,
            )  # fmt: skip
        except CheckpointException:
            if planner.refusal is None:
                raise
            raise StartupError(planner.refusal) from None
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
