"""The dry-run planner: exact parameter counts, memory that fits, and fast answers."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from conftest import REPO

from protocol_models.config import load_config
from protocol_models.model import stage_layer_ranges
from protocol_models.plan import analytical_param_count, plan_stages

CONFIGS = ["llama3_8b_protocol", "llama3_8b_dense", "llama3_2b_protocol", "llama3_2b_dense"]


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_counts_match_the_architecture(name):
    config = load_config(str(REPO / "configs" / f"{name}.toml"), [], check_environment=False)
    ranges = stage_layer_ranges(config.model.n_layers, config.layout_stages)
    constrained = {i for r in ranges[:-1] for i in r}
    k = config.protocol.k if config.protocol.mode == "subspace" else None
    counted = sum(p.params for p in plan_stages(config))
    assert counted == analytical_param_count(config.model, k, constrained)
    if name == "llama3_8b_dense":
        assert counted == 8_030_261_248  # Meta's LLaMA-3 8B (untied embedding and head)


@pytest.mark.parametrize("name", ["llama3_8b_protocol", "llama3_2b_protocol"])
def test_planner_cli_fits_and_is_fast(name):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.plan", "--toml", f"configs/{name}.toml",
         "--bandwidth-mbps", "80", "--latency-ms", "50"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - start < 60
    rows = [line for line in result.stdout.splitlines() if line.startswith("| ") and "GiB" in line]
    assert rows and all(line.rstrip().endswith("| yes |") for line in rows)
    assert "102.4x" in result.stdout and "wire lower bound" in result.stdout


def test_planner_refuses_a_layout_that_does_not_fit():
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.plan", "--toml", "configs/llama3_8b_protocol.toml",
         "--parallelism.data_parallel_shard_degree", "1", "--activation_checkpoint", "none"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "more than hardware.gpu_memory_gib = 24" in result.stderr
