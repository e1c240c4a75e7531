"""Shared helpers: real ``torchrun`` launches of the plugin's worker entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol_models.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "tiny.toml"


@pytest.fixture(scope="session", autouse=True)
def bundled_data():
    """The Shakespeare data and tokenizer, prepared once (a no-op when already there)."""
    from protocol_models import shakespeare

    return shakespeare.prepare(REPO / shakespeare.DEFAULT_CACHE)


def torchrun(
    nproc: int, dump_folder: Path, *overrides: str, toml: Path = TINY, env=None,
    return_output: bool = False,
):  # fmt: skip
    """Run ``protocol_models.train`` on ``nproc`` CPU processes; return the JSONL records (and
    the run's stdout + stderr with ``return_output``)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node", str(nproc),
        "-m", "protocol_models.train", "--toml", str(toml),
        "--dump_folder", str(dump_folder),
        "--parallelism.pipeline_parallel_degree", str(nproc),
        *overrides,
    ]  # fmt: skip
    result = subprocess.run(
        cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PROTOCOL_MODELS_DEVICE": "cpu", **(env or {})},
    )  # fmt: skip
    assert result.returncode == 0, (
        f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    )
    records = read_jsonl(dump_folder / "metrics.jsonl")
    return (records, result.stdout + result.stderr) if return_output else records
