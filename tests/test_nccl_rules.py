"""NCCL on CPU (``PM_NCCL_RULES``, ``protocol_models.tools.nccl_rules``): torch's own code takes its
NCCL branches on the emulated backend, every planted violation ends the run with its rule's one
line within the bound, the correct patterns pass, and enabling the emulation replaces nothing in
torch or TorchTitan. (The plugin's pipeline runs under the rules in ``test_exactness``,
``test_async``, ``test_transport``, ``test_devices`` and ``test_reliability``.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import REPO, config_error

CASES = REPO / "tests" / "nccl_rules_cases.py"
BOUND_S = 3
"""``PM_NCCL_RULES_WAIT_S`` here: a rule broken is reported after about this long."""


def run_cases(*cases: str, mode: str = "1", nproc: int = 2) -> tuple[int, str, float]:
    """``(exit code, output, seconds)`` of ``nccl_rules_cases.py`` on ``nproc`` processes."""
    env = {**os.environ, "PM_NCCL_RULES": mode, "PM_NCCL_RULES_WAIT_S": str(BOUND_S),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    began = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         str(nproc), str(CASES), *cases],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr, time.time() - began


def test_patterns_that_follow_the_rules_pass():
    """Pre-posted receives on a communicator per direction; tags ignored (the values arrive in
    issue order); torch's ``batch_isend_irecv`` returns one ``Work`` for a batch, as on NCCL;
    the gradient-norm exchange, synchronous (a batch at each clipping: it indexed one ``Work`` per
    op and crashed at start-up on NCCL) and asynchronous; a batch and a single op meet on the
    group's communicator once a device is bound (R1)."""
    code, output, _ = run_cases("ordered", "tags_ignored", "batch_returns_one_work",
                                "norm_exchange")  # fmt: skip
    assert code == 0, output[-3000:]
    code, output, _ = run_cases("batch_vs_single", mode="bound")
    assert code == 0, output[-3000:]


@pytest.mark.parametrize("mode", ["1", "bound"])
def test_the_norm_exchange_follows_the_rules_on_three_stages(mode):
    """Both forms of the exchange between 3 ranks, unbound (a pair communicator per group and
    pair) and bound (one communicator per group, so a rank's pending receives hold its sends
    behind them): every rank gets the global norm, no rule broken."""
    code, output, _ = run_cases("norm_exchange", mode=mode, nproc=3)
    assert code == 0, output[-3000:]


@pytest.mark.parametrize(
    ("case", "rule", "names"),
    [
        ("batch_vs_single", "R3", ("the pair communicator 0-1", "the group communicator")),
        ("first_recv_blocks", "R2", ("is the first there", "irecv from rank 0", "irecv from rank 1")),
        ("different_groups", "R3", ("send to rank 1", "recv from rank 0")),
        ("size_mismatch", "R3", ("of 20 bytes", "message truncated")),
        ("issue_order", "R4", ("held behind its own irecv from rank 0",)),
        ("mutual_receives", "R4", ("is held behind its own irecv from rank", "ahead of its own send")),
        ("synchronize_pending", "R6", ("device-wide wait waits for its irecv from rank 0",)),
        ("empty_cache_pending", "R6", ("device-wide wait waits for its irecv from rank 0",)),
    ],
)
def test_a_planted_violation_is_one_line_naming_the_rule(case, rule, names):
    """Each pattern runs on gloo as it is; under the rules it ends with ``error: NCCL rule
    <rule> ...``, one line naming the ranks, the communicator and the ops, well inside ten
    times the bound (where an unexplained wait would be reported instead). Either rank of the
    cycle may report it (both wait for each other): the names checked are in both reports."""
    code, output, seconds = run_cases(case)
    lines = [line for line in output.splitlines() if line.startswith("error: NCCL rule")]
    assert code != 0 and lines, output[-3000:]
    assert all(line.startswith(f"error: NCCL rule {rule} ") for line in lines), lines
    assert all(all(n in line for n in names) for line in lines), lines
    assert seconds < 10 * BOUND_S + 30, seconds


@pytest.mark.parametrize(
    ("case", "code", "line"),
    [
        ("split", 1, "No device associated with the default pg, not safe to split"),
        ("int16", 2, "error: Input tensor data type is not supported for NCCL process group: "
                     "torch.int16"),
        ("watchdog", 3, "error: NCCL watchdog: rank 1 waits in irecv from rank 0"),
    ],
)
def test_what_nccl_itself_refuses(case, code, line):
    """R5 is torch's own check (``split_group`` without a bound device); a type NCCL has none
    for is refused in ProcessGroupNCCL's words; a wait past its group's timeout ends the worker
    as NCCL's watchdog does (exit code 3: the launcher restarts the run from its checkpoint)."""
    returned, output, _ = run_cases(case)
    assert returned != 0 and line in output, output[-3000:]
    if code != 1:  # torch's own error ends the worker through torchrun's traceback
        assert f"exitcode  : {code}" in output, output[-3000:]


def test_async_on_torch_2_15_is_refused_with_the_reason(monkeypatch):
    """torch 2.15's stages own each receive buffer until its step is complete, and refuse the
    receives ``Async1F1B`` posts ahead: one line, on CPU and NCCL alike (torch's version is
    stood in for; a run against a real 2.15 is in docs/testing.md)."""
    import torch
    from torch.torch_version import TorchVersion

    monkeypatch.setattr(torch, "__version__", TorchVersion("2.15.0+cu132"))
    message = config_error("--parallelism.pipeline_parallel_schedule", "Async1F1B")
    assert message.startswith("parallelism.pipeline_parallel_schedule = 'Async1F1B' needs torch "
                              "2.14 (this is 2.15.0+cu132)"), message


def test_the_emulation_is_refused_on_a_gpu_run(monkeypatch):
    """It is a CPU test of the GPU path: a CUDA config under ``PM_NCCL_RULES`` is one line."""
    monkeypatch.setenv("PM_NCCL_RULES", "1")
    message = config_error("--hardware.device", "cuda")
    assert message.startswith("PM_NCCL_RULES=1: the CPU emulation of NCCL runs on the CPU only")


def test_enabling_the_emulation_replaces_nothing_in_torch_or_torchtitan():
    """With the emulation on, a world group, collectives, point-to-point ops, a batch and the
    device-wide waits rebind exactly the attributes of torch's and TorchTitan's modules that
    the same traffic on plain gloo rebinds (torch's own set-up globals), nothing more
    (``tests/import_purity.py --emulate``); the one thing added is the backend's entry in
    torch's backend registry. The same check sees a planted replacement of
    ``dist.batch_isend_irecv`` (what the emulation once did)."""

    def rebound(mode: str, *extra: str) -> list[str]:
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
             str(REPO / "tests" / "import_purity.py"), "--emulate", *extra],
            cwd=REPO, capture_output=True, text=True, timeout=300,
            env={**os.environ, "PM_NCCL_RULES": mode, "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr[-3000:]
        return result.stdout.splitlines()

    gloo, emulated = rebound("0"), rebound("1")
    assert emulated == ["registry: nccl_rules", *gloo], (emulated, gloo)
    assert "torch.distributed.batch_isend_irecv rebound" in rebound("1", "--plant")
