"""Reading a run's DCP checkpoint on the CPU, one group of tensors at a time, without a process
group.

TorchTitan writes ``<dump_folder>/<checkpoint.folder>/step-N/`` (a ``.metadata`` file and one
``.distcp`` shard per rank) with the model's parameters and persistent buffers flattened to their
fully-qualified names (``layers.3.attention.wo.weight``, ``basis``). Layer keys keep their global
ids on every pipeline stage, so a checkpoint written by any layout reads the same: DCP gathers the
stages' shards into whole tensors (``dcp.load(..., no_dist=True)``), reading only the requested
keys.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from protocol_models.errors import UserError

_STEP = re.compile(r"step-(\d+)")
TABLE_SHA256 = "train_state.subspace_table_sha256"
"""Where ``ProtocolTrainer.state_dict`` puts the digest of F, once TorchTitan flattens it."""


def complete_steps(folder: Path) -> dict[int, Path]:
    """``step -> step-N folder`` for every complete checkpoint (one with ``.metadata``) in
    ``folder`` (TorchTitan's rule)."""
    steps = {}
    for child in folder.iterdir():
        match = _STEP.fullmatch(child.name)
        if match and (child / ".metadata").is_file():
            steps[int(match.group(1))] = child
    return steps


def locate(path: Path, step: int | None) -> tuple[Path, Path]:
    """``(checkpoint folder, step folder)`` named by ``--checkpoint path [--step step]``.

    ``path`` is either a checkpoint folder holding ``step-N`` folders (default: the latest
    complete one) or one ``step-N`` folder. Anything else is a UserError naming what exists."""
    if (path / ".metadata").is_file():
        match = _STEP.fullmatch(path.name)
        if step is not None and (match is None or int(match.group(1)) != step):
            raise UserError(f"--step {step}: {path} is itself one checkpoint; drop --step")
        return path.parent, path
    if not path.is_dir():
        raise UserError(
            f"--checkpoint {path}: no such folder; pass a run's checkpoint folder "
            "(<dump_folder>/checkpoint) or one of its step-N folders"
        )
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


@dataclass(frozen=True, slots=True)
class TensorInfo:
    shape: tuple[int, ...]
    dtype: torch.dtype


class CheckpointTensors:
    """The tensors of one ``step-N`` folder: their shapes and dtypes from the metadata, and
    ``load(names)``, which reads just those tensors, whole, into CPU memory."""

    def __init__(self, step_dir: Path):
        self.step_dir = step_dir
        try:
            metadata = dcp.FileSystemReader(str(step_dir)).read_metadata()
        except Exception as e:
            raise UserError(f"{step_dir}: not a readable DCP checkpoint ({e})") from None
        self.info = {
            name: TensorInfo(tuple(meta.size), meta.properties.dtype)
            for name, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }

    def table_sha256(self) -> bytes | None:
        """The sha256 of F the trainer stores with its train state (None: not in this
        checkpoint, e.g. a dense run or a model-only save)."""
        if TABLE_SHA256 not in self.info:
            return None
        return bytes(self.load([TABLE_SHA256])[TABLE_SHA256].tolist())

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        """``name -> tensor`` (the stored dtype) for ``names``, all present in ``info``."""
        tensors = {n: torch.empty(self.info[n].shape, dtype=self.info[n].dtype) for n in names}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            reader = dcp.FileSystemReader(str(self.step_dir))
            dcp.load(tensors, storage_reader=reader, no_dist=True)
        return tensors
