"""NCCL's point-to-point rules on CPU (``PM_NCCL_RULES``, ``protocol_models.tools.nccl_rules``):
every planted violation ends the run with its rule's one line within the bound, the correct
patterns pass, and the asynchronous schedule is refused where NCCL's rules apply. (The plugin's
pipeline runs under the rules in ``test_exactness``, ``test_transport``, ``test_devices`` and
``test_reliability``.)"""

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


def run_cases(*cases: str, mode: str = "1") -> tuple[int, str, float]:
    """``(exit code, output, seconds)`` of ``nccl_rules_cases.py`` on 2 processes."""
    env = {**os.environ, "PM_NCCL_RULES": mode, "PM_NCCL_RULES_WAIT_S": str(BOUND_S),
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    began = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(CASES), *cases],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    return result.returncode, result.stdout + result.stderr, time.time() - began


def test_patterns_that_follow_the_rules_pass():
    """Pre-posted receives on a communicator per direction; tags ignored (the values arrive in
    issue order); a batch and a single op meet on the group's communicator once a device is
    bound (R1)."""
    code, output, _ = run_cases("ordered", "tags_ignored")
    assert code == 0, output[-3000:]
    code, output, _ = run_cases("batch_vs_single", mode="bound")
    assert code == 0, output[-3000:]


@pytest.mark.parametrize(
    ("case", "rule", "names"),
    [
        ("batch_vs_single", "R3", ("the pair communicator 0-1", "the group communicator")),
        ("first_recv_blocks", "R2", ("irecv from rank 0", "waits for rank 0")),
        ("different_groups", "R3", ("send to rank 1", "recv from rank 0")),
        ("size_mismatch", "R3", ("of 20 bytes", "message truncated")),
        ("issue_order", "R4", ("held behind its own irecv from rank 0",)),
        ("synchronize_pending", "R6", ("synchronize waits for its irecv from rank 0",)),
        ("split", "R5", ("split_group",)),
    ],
)
def test_a_planted_violation_is_one_line_naming_the_rule(case, rule, names):
    """Each pattern runs on gloo as it is; under the rules it ends with ``error: NCCL rule
    <rule> ...``, one line naming the ranks, the communicator and the ops, well inside ten
    times the bound (where an unexplained wait would be reported instead)."""
    code, output, seconds = run_cases(case)
    lines = [line for line in output.splitlines() if line.startswith("error: NCCL rule")]
    assert code != 0 and lines, output[-3000:]
    assert all(line.startswith(f"error: NCCL rule {rule} ") for line in lines), lines
    assert any(all(n in line for n in names) for line in lines), lines
    assert seconds < 10 * BOUND_S + 30, seconds


def test_async_schedule_is_refused_where_nccl_rules_apply(monkeypatch):
    """``Async1F1B``'s batched sends and pre-posted single receives would meet on different
    NCCL communicators: refused in one line on a CUDA config and under ``PM_NCCL_RULES``."""
    schedule = ["--parallelism.pipeline_parallel_schedule", "Async1F1B"]
    message = config_error(*schedule, "--hardware.device", "cuda")
    assert "Async1F1B" in message and "GPipe or 1F1B" in message
    monkeypatch.setenv("PM_NCCL_RULES", "1")
    assert config_error(*schedule) == message
