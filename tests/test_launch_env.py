"""The launch environment of ``scripts/train.sh`` (``NGPU``/``NPROC_PER_NODE``, ``NNODES``,
``NODE_RANK``, ``MASTER_ADDR``) is held against the config's layout by the check that runs
before any worker: one line ``error: KEY=value: ...``, exit code 2, no worker, nothing written."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import REPO, TINY

LAUNCH_KEYS = ("NGPU", "NPROC_PER_NODE", "NNODES", "NODE_RANK", "MASTER_ADDR", "LOCAL_ADDR")
TWO_NODES = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1"}
FIXED_SHARDS = ["--parallelism.data_parallel_shard_degree", "1"]
"""tiny.toml's 2 stages without TorchTitan's -1 (which shards over the processes left over)."""

CASES = {
    "NGPU not the layout's": ({"NGPU": "3"}, [], "NGPU=3", ["needs 2 processes", "set NGPU=2"]),
    "NPROC_PER_NODE not the layout's": (
        {"NPROC_PER_NODE": "5"}, [], "NPROC_PER_NODE=5", ["needs 2 processes"]
    ),
    "NGPU not a number": ({"NGPU": "two"}, [], "NGPU=two", ["whole number >= 1"]),
    "NNODES not a number": ({"NNODES": "abc"}, [], "NNODES=abc", ["whole number >= 1"]),
    "NNODES zero": ({"NNODES": "0"}, [], "NNODES=0", ["whole number >= 1"]),
    "NNODES does not divide the layout": (
        {**TWO_NODES, "NNODES": "3"}, [], "NNODES=3", ["needs 2 processes", "divides 2"]
    ),
    "NNODES x NGPU not the layout's": (
        {**TWO_NODES, "NGPU": "2"}, FIXED_SHARDS, "NGPU=2",
        ["NNODES=2 x NGPU=2 = 4 processes", "needs 2 processes", "set NGPU=1"],
    ),
    "NODE_RANK unset on several nodes": (
        {"NNODES": "2", "MASTER_ADDR": "127.0.0.1"}, [], "NODE_RANK=(unset)",
        ["0..1", "NNODES=2"],
    ),
    "NODE_RANK out of range": (
        {**TWO_NODES, "NODE_RANK": "2"}, [], "NODE_RANK=2", ["0..1", "NNODES=2"]
    ),
    "NODE_RANK on a single node": ({"NODE_RANK": "1"}, [], "NODE_RANK=1", ["0..0", "NNODES=1"]),
    "MASTER_ADDR unset on several nodes": (
        {"NNODES": "2", "NODE_RANK": "0"}, [], "MASTER_ADDR=(unset)", ["NNODES=2"]
    ),
    "MASTER_ADDR that does not resolve": (
        {**TWO_NODES, "MASTER_ADDR": "nosuch-node.invalid"}, [], "MASTER_ADDR=nosuch-node.invalid",
        ["does not resolve", "NNODES=2"],
    ),
}  # fmt: skip


def _environment(launch: dict[str, str]) -> dict[str, str]:
    """This process's environment without any launch value of its own, plus ``launch``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_KEYS}
    return {**env, "OMP_NUM_THREADS": "1", **launch}


def _check(launch: dict[str, str], overrides: list[str]) -> None:
    """The launch check on tiny.toml with ``overrides``, in this process, under ``launch``."""
    from protocol_models.config.preflight import check_launch_environment
    from protocol_models.config.run_config import load_config

    config = load_config(str(TINY), list(overrides), check_environment=False)
    check_launch_environment(config, _environment(launch))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_launch_value_the_layout_refuses_is_one_line_naming_it(case):
    """Each refusal is one ``KEY=value: ...`` line naming the other value it disagrees with."""
    from protocol_models.tools.errors import ConfigError

    launch, overrides, key_value, named = CASES[case]
    with pytest.raises(ConfigError) as err:
        _check(launch, overrides)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"{key_value}: "), line
    assert all(text in line for text in named), line


@pytest.mark.parametrize("case", ["NGPU not the layout's", "NODE_RANK unset on several nodes"])
def test_a_refused_launch_stops_train_sh_before_any_worker(tmp_path, case):
    """Through ``scripts/train.sh``: exit code 2, the one line on stderr, nothing on stdout (not
    even the check's ``nproc=``: torchrun never started), no dump folder; also where bash itself
    would have refused the unset variable."""
    launch, overrides, key_value, _ = CASES[case]
    dump = tmp_path / "run"
    result = subprocess.run(
        ["bash", "scripts/train.sh", str(TINY), "--dump_folder", str(dump), *overrides],
        cwd=REPO, env=_environment(launch), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: {key_value}: "), line
    assert not dump.exists(), "a worker started and wrote the dump folder"


@pytest.mark.parametrize(
    "launch",
    [{"NGPU": "2"}, {"NGPU": "4"}, {**TWO_NODES, "NGPU": "1"}, {**TWO_NODES, "NODE_RANK": "0"}],
    ids=["the layout", "a multiple with shard degree -1", "two nodes", "two nodes, NGPU default"],
)
def test_launch_values_that_fit_the_layout_pass_the_check(launch):
    """tiny.toml: 2 stages, ``data_parallel_shard_degree = -1``, so 4 processes shard each
    stage 2 ways."""
    _check(launch, [])


def test_the_check_train_sh_runs_first_accepts_the_layout():
    """``python -m protocol_models.config`` (what ``scripts/train.sh`` runs first) prints the
    processes the layout needs."""
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.config", "--toml", str(TINY)],
        cwd=REPO, env=_environment({"NGPU": "2"}), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "nproc=2" in result.stdout.splitlines()
