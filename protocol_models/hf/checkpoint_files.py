"""Reading a run's DCP checkpoint on the CPU, one group of tensors at a time, without a process
group.

TorchTitan writes ``<dump_folder>/<checkpoint.folder>/step-N/`` (a ``.metadata`` file and one
``.distcp`` shard per rank) with the model's parameters and persistent buffers flattened to their
fully-qualified names (``layers.3.attention.wo.weight``, ``basis``); with ``[checkpoint]
per_node``, one such checkpoint per node in ``node-<i>-of-<n>/step-N/`` (``checkpointing``).
Layer keys keep their global ids on every pipeline stage, so a checkpoint written by any layout
reads the same: DCP gathers the stages' shards into whole tensors (``dcp.load(...,
no_dist=True)``), reading only the requested keys.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from protocol_models.tools.errors import UserError
from protocol_models.training.checkpointing import complete_step_numbers

_STEP = re.compile(r"step-(\d+)")
NODE_FOLDER = re.compile(r"node-(\d+)-of-(\d+)")
"""A node's folder in a per-node checkpoint folder: ``node-<node rank>-of-<nodes>``."""
TABLE_SHA256 = "train_state.subspace_table_sha256"
"""Where ``ProtocolTrainer.state_dict`` puts the digest of F, once TorchTitan flattens it."""


def _shared_steps(folder: Path) -> dict[int, Path]:
    """``step -> step-N folder`` for every complete checkpoint in ``folder`` (TorchTitan's
    rule, ``checkpointing.complete_step_numbers``)."""
    return {step: folder / f"step-{step}" for step in complete_step_numbers(str(folder))}


def _node_folders(folder: Path) -> dict[int, Path]:
    """``node -> node-<i>-of-<n> folder`` of a per-node checkpoint folder (empty: the shared
    layout); a UserError when it is one node's part only or mixes runs of different sizes."""
    found = {}
    for child in folder.iterdir():
        match = NODE_FOLDER.fullmatch(child.name)
        if match and child.is_dir():
            found[child] = (int(match.group(1)), int(match.group(2)))
    sizes = {n for _, n in found.values()}
    if len(sizes) > 1:
        raise UserError(
            f"--checkpoint {folder}: holds the node folders of runs with {sorted(sizes)} nodes; "
            "keep one run's node-*-of-N folders"
        )
    if not found:
        return {}
    (nodes,) = sizes
    missing = sorted(set(range(nodes)) - {i for i, _ in found.values()})
    if missing:
        raise UserError(
            f"--checkpoint {folder}: a per-node checkpoint without the folder of node(s) "
            f"{missing}; copy every node's node-*-of-{nodes} folder into it"
        )
    return {i: child for child, (i, _) in found.items()}


def complete_steps(folder: Path) -> dict[int, list[Path]]:
    """``step -> its step-N folders`` for every complete checkpoint in ``folder``: one folder in
    TorchTitan's layout; with ``[checkpoint] per_node`` (``node-<i>-of-<n>/step-N``), one per
    node, and a step is complete when every node's folder has it."""
    nodes = _node_folders(folder)
    if not nodes:
        return {step: [path] for step, path in _shared_steps(folder).items()}
    per_node = [_shared_steps(nodes[i]) for i in sorted(nodes)]
    common = set.intersection(*(set(steps) for steps in per_node))
    return {step: [steps[step] for steps in per_node] for step in common}


def _one_node_of_many(path: Path) -> str | None:
    """What is wrong with reading ``path`` alone when it is one node's part of a per-node
    checkpoint of several nodes (None: it is not)."""
    match = NODE_FOLDER.fullmatch(path.name)
    if match and int(match.group(2)) > 1:
        return (
            f"--checkpoint {path}: node {match.group(1)}'s part of a {match.group(2)}-node "
            "per-node checkpoint; copy every node's node-* folder into one checkpoint folder "
            "and pass that"
        )
    return None


def locate(path: Path, step: int | None) -> tuple[Path, list[Path]]:
    """``(checkpoint folder, step folders)`` named by ``--checkpoint path [--step step]``.

    ``path`` is either a checkpoint folder holding ``step-N`` folders, or node folders each
    holding them (default: the latest complete step), or one ``step-N`` folder. Anything else is
    a UserError naming what exists."""
    if (path / ".metadata").is_file():
        match = _STEP.fullmatch(path.name)
        if step is not None and (match is None or int(match.group(1)) != step):
            raise UserError(f"--step {step}: {path} is itself one checkpoint; drop --step")
        problem = _one_node_of_many(path.parent)
        if problem:
            raise UserError(problem)
        folder = path.parent.parent if NODE_FOLDER.fullmatch(path.parent.name) else path.parent
        return folder, [path]
    if not path.is_dir():
        raise UserError(
            f"--checkpoint {path}: no such folder; pass a run's checkpoint folder "
            "(<dump_folder>/checkpoint) or one of its step-N folders"
        )
    problem = _one_node_of_many(path)
    if problem:
        raise UserError(problem)
    if NODE_FOLDER.fullmatch(path.name):  # the one node of a 1-node run
        path = path.parent
    steps = complete_steps(path)
    if not steps:
        raise UserError(
            f"--checkpoint {path}: holds no complete checkpoint (step-N folder with .metadata); "
            "pass a run's checkpoint folder (<dump_folder>/checkpoint) or one step-N folder"
        )
    if step is None:
        step = max(steps)
    if step not in steps:
        raise UserError(
            f"--step {step}: {path} has no complete checkpoint of that step; it has steps "
            f"{sorted(steps)}"
        )
    return path, steps[step]


def describe(step_dirs: list[Path]) -> str:
    """A step's folders, for messages: the one folder, or ``<folder>/node-*/step-N``."""
    if len(step_dirs) == 1:
        return str(step_dirs[0])
    return str(step_dirs[0].parent.parent / "node-*" / step_dirs[0].name)


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


class CheckpointTensors:
    """The tensors of one step's checkpoint (one ``step-N`` folder, or one per node): their
    shapes and dtypes from the metadata, and ``load(names)``, which reads just those tensors,
    whole, into CPU memory.

    Invariant: every tensor in ``info`` is covered entirely by the chunks the folders hold
    together (a per-node checkpoint whose data-parallel shards span nodes is whole only with
    every node's folder); a replicated tensor may be stored in several folders."""

    def __init__(self, step_dirs: Path | list[Path]):
        self.step_dirs = [step_dirs] if isinstance(step_dirs, Path) else list(step_dirs)
        self.where = describe(self.step_dirs)
        self.info: dict[str, TensorInfo] = {}
        self._folders_of: dict[str, list[Path]] = {}
        chunks: dict[str, set[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        for step_dir in self.step_dirs:
            try:
                metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
            except Exception as e:
                raise UserError(f"{step_dir}: not a readable DCP checkpoint ({e})") from None
            for name, meta in metadata.state_dict_metadata.items():
                if not isinstance(meta, TensorStorageMetadata):
                    continue
                self.info[name] = TensorInfo(tuple(meta.size), meta.properties.dtype)
                self._folders_of.setdefault(name, []).append(step_dir)
                chunks.setdefault(name, set()).update(
                    (tuple(c.offsets), tuple(c.sizes)) for c in meta.chunks
                )
        for name, held in chunks.items():
            stored = sum(math.prod(sizes) for _, sizes in held)
            whole = math.prod(self.info[name].shape)
            if stored < whole:
                raise UserError(
                    f"{self.where}: {name} is only partly stored in these folders ({stored} of "
                    f"its {whole} elements); copy every node's node-* folder of the run into the "
                    "checkpoint folder"
                )

    def table_sha256(self) -> bytes | None:
        """The sha256 of F the trainer stores with its train state (None: not in this
        checkpoint, e.g. a dense run or a model-only save)."""
        if TABLE_SHA256 not in self.info:
            return None
        return bytes(self.load([TABLE_SHA256])[TABLE_SHA256].tolist())

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """``name -> tensor`` (the stored dtype) for ``names``, all present in ``info``; each
        folder fills the chunks it holds."""
        tensors = {n: torch.empty(self.info[n].shape, dtype=self.info[n].dtype) for n in names}
        for step_dir in self.step_dirs:
            here = {n: t for n, t in tensors.items() if step_dir in self._folders_of[n]}
            if not here:
                continue
            with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
                warnings.simplefilter("ignore", UserWarning)
                reader = dcp.FileSystemReader(str(step_dir))
                dcp.load(here, storage_reader=reader, no_dist=True)
        return tensors
