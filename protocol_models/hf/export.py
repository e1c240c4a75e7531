"""Export a run's checkpoint as an ordinary Hugging Face LLaMA.

    python -m protocol_models.export --checkpoint DIR [--step N] --out DIR
        [--dtype float32|bfloat16] [--max-shard-bytes N] [--toml FILE [--section.key value ...]]

``--checkpoint`` is a run's checkpoint folder (``<dump_folder>/checkpoint``, default: its latest
complete step) or one ``step-N`` folder, written by any pipeline layout, in any mode (subspace in
either parametrization, the dense twin, lossy-codec runs). The constraint is folded away
(``protocol_models.hf.fold``), the tensors are renamed and their rotary order converted
(``protocol_models.hf.hf_llama``), and ``--out`` receives ``config.json``,
``generation_config.json``, safetensors shards, the run's tokenizer files and the run record
``run.json``. What the checkpoint means comes from the ``run.json`` the run wrote next to it, or
from ``--toml`` (the run's config, and the overrides the run was launched with) for
checkpoints without one.

Everything runs on the CPU without a process group and holds one group of tensors at a time
(the embedding, one block, or norm + head) plus one shard being written, so an 8B export fits in
host memory. The result is written into a temporary folder next to ``--out`` and renamed into
place at the end: bad input (a missing checkpoint or step, an ``--out`` that is not empty, a
checkpoint of another layout) is one ``error:`` line, exit code 2, and nothing written.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from protocol_models.hf import cli
from protocol_models.hf.checkpoint_files import CheckpointTensors, describe, locate
from protocol_models.hf.fold import check_layout, dense_groups
from protocol_models.hf.hf_llama import (
    DEFAULT_SHARD_BYTES,
    ShardWriter,
    copy_tokenizer,
    hf_config,
    to_hf,
)
from protocol_models.model.boundary import BOUNDARIES
from protocol_models.tools.errors import UserError
from protocol_models.training import run_record
from protocol_models.training.run_record import RunRecord

USAGE = (
    "python -m protocol_models.export --checkpoint DIR [--step N] --out DIR "
    "[--dtype float32|bfloat16] [--toml FILE [--section.key value ...]]"
)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_record(checkpoint_folder: Path, toml: str | None, overrides: list[str]) -> RunRecord:
    """The run record next to the checkpoints, or the one ``--toml`` (the run's config, with
    the run's ``--section.key value`` overrides) gives."""
    if toml is None:
        return run_record.read(checkpoint_folder)
    from protocol_models.config.run_config import load_config

    return RunRecord.from_config(load_config(toml, overrides, check_environment=False))


def check_out(out: Path) -> None:
    """``--out`` must be absent or an empty folder."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out}: exists and is not an empty folder; name a new folder")


def export(
    step_dirs: Path | list[Path],
    record: RunRecord,
    out: Path,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
) -> list[str]:
    """Write the dense HF LLaMA of one step's checkpoint folders (``checkpoint_files.locate``)
    into ``out`` (absent or empty); return the
    names of the weight files. ``dtype`` None: the checkpoint's (its LM head's)."""
    check_out(out)
    model_config = record.model_config()
    if not BOUNDARIES[model_config.mode].exportable:
        raise UserError(
            f"protocol.mode = {model_config.mode!r}: its boundary layers are not part of a LLaMA, "
            "so the model has no Hugging Face form; export takes runs of the other modes"
        )
    tensors = CheckpointTensors(step_dirs)
    check_layout(model_config, {n: i.shape for n, i in tensors.info.items()}, tensors.where)
    dtype = dtype or tensors.info["lm_head.weight"].dtype
    new_parents = [p for p in reversed(out.absolute().parents) if not p.exists()]
    staging = None
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
        staging.chmod(0o777 & ~_umask())  # mkdtemp's folder is private; the result is not
        special_ids = copy_tokenizer(Path(record.hf_assets_path), staging)
        writer = ShardWriter(staging, dtype, max_shard_bytes)
        for group in dense_groups(model_config, tensors.load, tensors.table_sha256()):
            writer.add(to_hf(model_config, group))
        files = writer.close()
        config = hf_config(
            model_config,
            context=record.seq_len,
            dtype=dtype,
            special_ids=special_ids,
            init_std=record.model.init_std,
        )
        (staging / "config.json").write_text(json.dumps(config, indent=1))
        (staging / "generation_config.json").write_text(json.dumps(special_ids, indent=1))
        (staging / run_record.RECORD_NAME).write_text(record.to_json())
        if out.is_dir():
            out.rmdir()  # empty (checked above): the rename below replaces it
        os.rename(staging, out)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write it ({e.strerror or e})") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)  # gone after the rename; else a failure
        if not out.exists():
            for parent in reversed(new_parents):  # the folders made for --out, deepest first
                with contextlib.suppress(OSError):
                    parent.rmdir()
    return files


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _main(args: argparse.Namespace) -> None:
    out = Path(args.out)
    check_out(out)
    folder, step_dirs = locate(Path(args.checkpoint), args.step)
    record = load_record(folder, args.toml, args.overrides)
    files = export(step_dirs, record, out, DTYPES.get(args.dtype), args.max_shard_bytes)
    print(f"exported {describe(step_dirs)} ({record.protocol.mode}) to {out}: {', '.join(files)}")


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m protocol_models.export", usage=USAGE)
    p.add_argument("--checkpoint", required=True, metavar="DIR")
    p.add_argument("--step", type=int, metavar="N", help="default: the latest complete step")
    p.add_argument("--out", required=True, metavar="DIR", help="a new or empty folder")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="default: the checkpoint's")
    p.add_argument("--toml", metavar="FILE", help="the run's config, for a checkpoint folder "
                   "without run.json")  # fmt: skip
    p.add_argument("--max-shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, metavar="N")
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 exported, 2 bad input (one ``error:`` line on stderr, nothing written)."""
    return cli.run(_main, parser(), argv)
