"""The model the after-training commands read: an exported folder (``--hf DIR``) or a run's
checkpoint (``--checkpoint DIR [--step N] [--toml FILE]``, exported into a temporary folder
first), loaded with ``transformers``' ``LlamaForCausalLM``."""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from protocol_models.hf import cli
from protocol_models.hf.checkpoint_files import locate
from protocol_models.hf.export import export, load_record
from protocol_models.tools.errors import UserError
from protocol_models.training import run_record
from protocol_models.training.run_record import RunRecord


def add_source_arguments(parser: cli.Parser) -> None:
    """``--hf DIR`` or ``--checkpoint DIR [--step N] [--toml FILE [--section.key value ...]]``."""
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--hf", metavar="DIR", help="a folder written by protocol_models.export")
    source.add_argument("--checkpoint", metavar="DIR", help="a run's checkpoint folder or step")
    parser.add_argument("--step", type=int, metavar="N", help="with --checkpoint")
    parser.add_argument("--toml", metavar="FILE", help="with --checkpoint, when it has no run.json")


@contextlib.contextmanager
def model_folder(args: argparse.Namespace) -> Iterator[Path]:
    """The exported folder ``args`` name (a temporary export of ``--checkpoint``)."""
    if args.hf:
        folder = Path(args.hf)
        if not (folder / "config.json").is_file():
            raise UserError(f"--hf {folder}: no config.json; pass a protocol_models.export folder")
        yield folder
        return
    checkpoint_folder, step_dirs = locate(Path(args.checkpoint), args.step)
    record = load_record(checkpoint_folder, args.toml, args.overrides)
    with tempfile.TemporaryDirectory(prefix="protocol-models-export-") as tmp:
        folder = Path(tmp) / "model"
        export(step_dirs, record, folder)
        yield folder


def folder_record(folder: Path) -> RunRecord | None:
    """The run record an export carries (None: a folder without one)."""
    if not (folder / run_record.RECORD_NAME).is_file():
        return None
    return run_record.read(folder)


def load_causal_lm(folder: Path):
    """``LlamaForCausalLM`` from ``folder`` in fp32, in eval mode."""
    import torch

    try:
        from transformers import LlamaForCausalLM
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise UserError("this command needs transformers: pip install -e '.[hf]'") from None
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    return LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
