"""What a run's checkpoints mean: ``run.json``, written next to them when the run starts.

A checkpoint holds the trained tensors, not what they are: whether ``wo`` ``[k, in]`` is a
factor ``A`` of ``W = U A``, which seed regenerates ``F``, which tokenizer the ids come from.
Every node's first rank writes this record into the checkpoint folder's ``run.json`` at
start-up (a resumed run rewrites it); ``python -m protocol_models.export`` reads it. ``layout``
names the plugin's checkpoint layout (parameter names and shapes for a given record): it is bumped
whenever that changes, and a checkpoint of another layout is refused instead of being misread.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from protocol_models.data import corpus
from protocol_models.model.model import ModelArch, build_model_config
from protocol_models.tools.errors import UserError
from protocol_models.training import checkpoint_store
from protocol_models.training.protocol import ProtocolSettings

LAYOUT_VERSION = 1
"""The checkpoint layout this plugin writes and reads."""
RECORD_NAME = "run.json"


@dataclass(kw_only=True, slots=True)
class RunRecord:
    """The settings a checkpoint needs to be read without the run's TOML file."""

    layout: int
    model: ModelArch
    protocol: ProtocolSettings
    stages: int
    """The pipeline layout the model was built for (which blocks are constrained)."""
    seq_len: int
    local_batch_size: int
    validation_steps: int
    """``[validator] steps``: batches of ``local_batch_size`` rows (-1: the whole split)."""
    hf_assets_path: str
    """The tokenizer folder, absolute."""
    dataloader: dict[str, Any]
    """``[dataloader]`` as a dict (local paths absolute), to rebuild the validation data."""

    @classmethod
    def from_config(cls, config) -> RunRecord:
        """The record of a ``ProtocolTrainer.Config``."""
        loader = dataclasses.asdict(config.dataloader)
        for key in ("files", "validation_files", "cache_dir"):
            loader[key] = _absolute(loader[key])
        return cls(
            layout=LAYOUT_VERSION,
            model=config.model,
            protocol=config.protocol,
            stages=config.layout_stages,
            seq_len=config.training.seq_len,
            local_batch_size=config.training.local_batch_size,
            validation_steps=config.validator.steps,
            hf_assets_path=_absolute(config.hf_assets_path),
            dataloader=loader,
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, where: str) -> RunRecord:
        """Parse a record; a record of another layout (or no record at all) is a UserError."""
        try:
            raw = json.loads(text)
            layout = raw.get("layout")
        except (json.JSONDecodeError, AttributeError) as e:
            raise UserError(f"{where} is not a run record ({e})") from None
        if layout != LAYOUT_VERSION:
            raise UserError(
                f"{where} records checkpoint layout {layout!r}; this version of protocol_models "
                f"reads layout {LAYOUT_VERSION} only (export it with the plugin version that "
                "trained it)"
            )
        try:
            return cls(
                **{
                    **raw,
                    "model": ModelArch(**raw["model"]),
                    "protocol": ProtocolSettings(**raw["protocol"]),
                }
            )
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{where} is not a layout-{LAYOUT_VERSION} run record ({e})") from None

    def model_config(self):
        """The ``ProtocolModel.Config`` the run trained (``build_model_config``)."""
        return build_model_config(self.model, self.protocol, self.stages)


def _absolute(value: str | list[str]) -> str | list[str]:
    """Local paths made absolute (URLs and empty values unchanged)."""
    if isinstance(value, list):
        return [_absolute(v) for v in value]
    if not value or corpus.is_remote(value):
        return value
    return os.path.abspath(value)


def write(config) -> None:
    """Every node's first rank writes ``run.json`` into the run's checkpoint folder (with
    checkpointing on), so a node with only its own disk has it too; whole
    (``checkpoint_store.write_text``), so a reader never sees half a record, also where the
    nodes share the folder."""
    if not config.checkpoint.enable or int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    record = RunRecord.from_config(config).to_json()
    checkpoint_store.write_text(checkpoint_store.checkpoint_folder(config), RECORD_NAME, record)


def read(folder: Path) -> RunRecord:
    """The record in a checkpoint folder (a UserError naming ``--toml`` when there is none)."""
    if re.match(r"[a-z][a-z0-9+.-]+:/", str(folder)):  # a URL (Path folds its "//")
        raise UserError(f"{folder}: a checkpoint in an object store is read from a local copy "
                        "(e.g. aws s3 sync URL ckpt/, then --checkpoint ckpt)")  # fmt: skip
    path = folder / RECORD_NAME
    if not path.is_file():
        raise UserError(
            f"{folder} has no {RECORD_NAME} (runs of this plugin write one next to their "
            "checkpoints); pass --toml with the run's config instead"
        )
    return RunRecord.from_json(path.read_text(), str(path))
