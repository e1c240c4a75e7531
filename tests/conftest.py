"""Shared helpers: real ``torchrun`` launches of the plugin's worker entry point."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from protocol_models.training.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "tests" / "tiny.toml"

PLAN_LAYOUT = [
    "--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.vocab_size", "512", "--model.ffn_hidden_dim", "96", "--protocol.k", "4",
    "--protocol.layers_per_stage", "[2, 1, 1]", "--optimizer.name", "adamw",
    "--parallelism.pipeline_parallel_degree", "3", "--parallelism.pipeline_parallel_microbatch_size",
    "2", "--training.local_batch_size", "8", "--training.seq_len", "16",
    "--training.mixed_precision_param", "bfloat16",
]  # fmt: skip
"""plan.py's tiny layout (3 stages of [2, 1, 1] blocks, d=64, V=512, bf16, 4 microbatches of
2 x 16 tokens) with k = 4: the learned boundaries' planner tests compare it with its dense twin."""


def fake_commands(folder: Path, bodies: dict[str, str]) -> Path:
    """Stand-in programs ``folder/<name>`` that run ``bodies[name]`` in bash (``srun``,
    ``scontrol``, the Python a script runs); returns ``folder``, to put first on ``PATH``."""
    folder.mkdir(exist_ok=True)
    for name, body in bodies.items():
        (folder / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (folder / name).chmod(0o755)
    return folder


def config_error(*overrides: str) -> str:
    """The ``ConfigError`` message tiny.toml with ``overrides`` raises (asserted one line)."""
    from protocol_models.config.run_config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(str(TINY), list(overrides), check_environment=False)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.fixture(scope="session", autouse=True)
def bundled_data():
    """The Shakespeare data and tokenizer, prepared once (a no-op when already there)."""
    from protocol_models.data import shakespeare

    return shakespeare.prepare(REPO / shakespeare.DEFAULT_CACHE)


@pytest.fixture(scope="session")
def seed_checkpoint(tmp_path_factory):
    """``seed_checkpoint(stages, *overrides)``: the step-0 checkpoint of the tiny model (the
    subspace model, or what ``overrides`` such as ``--protocol.mode resbm`` make it) built for
    ``stages`` pipeline stages, written once per session by one process (TorchTitan's
    ``create_seed_checkpoint``); pipelined and in-process runs loading it start identical."""
    made: dict[tuple[str, ...], Path] = {}

    def make(stages: int, *overrides: str) -> Path:
        key = (str(stages), *overrides)
        if key not in made:
            folder = tmp_path_factory.mktemp(f"seed{stages}")
            torchrun(
                1, folder, "--protocol.stages", str(stages), *overrides,
                "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
            )  # fmt: skip
            made[key] = folder / "checkpoint" / "step-0"
        return made[key]

    return make


NCCL_RULES = {"PM_NCCL_RULES": "1"}
"""A launch's environment for NCCL's point-to-point rules on gloo (``tools.nccl_rules``): the
plugin takes its NCCL branches and a broken rule ends the run with one line."""
VALIDATE_AT_END = ["--validator.enable", "--validator.freq", "3", "--validator.steps", "2"]
"""Validation after the last of tiny.toml's 3 steps, on 2 batches (what export tests compare)."""
SAMPLE_PROMPTS = ["ROMEO:", "To be, or not"]
SAMPLES = ["--metrics.sample_prompts", repr(SAMPLE_PROMPTS).replace("'", '"'),
           "--metrics.sample_tokens", "8"]  # fmt: skip
"""Greedy continuations at each validation (``samples.jsonl``)."""


@pytest.fixture(scope="session")
def seeded_runs(tmp_path_factory, seed_checkpoint):
    """``seeded_runs(stages)``: ``(single, piped)`` dump folders of two runs of the tiny subspace
    model from ``seed_checkpoint(stages)``, one process (``protocol.stages``) and ``stages`` GPipe
    processes, each run once per session with a checkpoint at its last step, validation and
    sampled continuations."""
    made: dict[int, tuple[Path, Path]] = {}

    def make(stages: int) -> tuple[Path, Path]:
        if stages not in made:
            folder = tmp_path_factory.mktemp(f"seeded{stages}")
            load = ["--checkpoint.enable", "--checkpoint.initial_load_path",
                    str(seed_checkpoint(stages)), *VALIDATE_AT_END, *SAMPLES]  # fmt: skip
            single, piped = folder / "pp1", folder / f"pp{stages}"
            torchrun(1, single, "--protocol.stages", str(stages), *load)
            torchrun(stages, piped, *load)
            made[stages] = single, piped
        return made[stages]

    return make


def assert_same_run(a: list[dict], b: list[dict], steps: list[int], rtol: float = 2e-6) -> None:
    """Two runs' records log ``steps`` with the same loss and global gradient norm at each, to
    ``rtol``. Exact runs agree to ~1e-7; the tolerance is far below what a 0.1% reconstruction
    error produces (~1e-5)."""
    assert [r["step"] for r in a] == [r["step"] for r in b] == steps
    for ra, rb in zip(a, b, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(ra[key] - rb[key]) <= rtol * abs(ra[key]), (ra["step"], key, ra, rb)


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
