"""GPU-path checks that run on CPU: bf16 mixed precision through TorchTitan's FSDP wrapper, and
the device of every tensor that enters a collective."""

from __future__ import annotations

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, torchrun

from protocol_models.subspace import leak_tolerance

# tests/tiny.toml: local_batch_size 4, microbatch 1, seq_len 64, d 64, k 4: 256 tokens per step
WIRES = {
    "subspace": ([], 256 * 4 * 2),
    "subspace 8-bit": (["--codec.bits", "8"], 256 * (4 + 2)),
    "dense": (["--protocol.mode", "dense"], 256 * 64 * 2),
    "resbm": (["--protocol.mode", "resbm"], 256 * 4 * 2),
    "mapl": (["--protocol.mode", "mapl"], 256 * 4 * 2),
}
"""Overrides, and the bytes per step and direction at boundary 0 under bf16: tokens x width x 2,
or, with 8-bit coordinates, tokens x (k one-byte codes + a bf16 scale)."""


@pytest.mark.parametrize("wire", list(WIRES))
def test_bf16_mixed_precision_wire(tmp_path, wire):
    """As on GPU: TorchTitan wraps every stage in FSDP with bf16 parameters (even at data
    parallel degree 1). Stage 0 must compute in bf16 and the wire must carry bf16: exactly 2
    bytes per coordinate (absolute bytes: the meter's ratio would hide a dtype mistake, since
    dense is counted in the same dtype); quantized coordinates keep their packed size."""
    overrides, sent = WIRES[wire]
    records, output = torchrun(
        2, tmp_path / "run", *overrides, "--training.steps", "10",
        "--training.mixed_precision_param", "bfloat16", return_output=True,
    )  # fmt: skip
    assert "boundary 0 carries bfloat16" in output
    for r in records:
        assert r["wire/fwd_bytes/b0"] == r["wire/bwd_bytes/b0"] == sent
    assert records[-1]["loss"] < records[0]["loss"] - 0.1
    if wire == "subspace":
        assert all(r["subspace/leak"] < leak_tolerance(torch.bfloat16) for r in records)
        assert max(r["subspace/leak"] for r in records) > leak_tolerance(torch.float32)


PROBED_RUNS = {
    "subspace updates": ["--protocol.update_every", "2"],
    "subspace 8-bit, 3 stages": ["--codec.bits", "8"],
    "mapl rvq": ["--protocol.mode", "mapl", "--protocol.rvq_stages", "2",
                 "--protocol.rvq_codebook", "16"],
}  # fmt: skip


@pytest.mark.parametrize("run", list(PROBED_RUNS))
def test_collectives_get_training_device_tensors(tmp_path, run):
    """Every tensor the plugin hands to a collective lives on the training device: the probe
    (tests/collective_probe) moves tensors created without a device to ``meta`` inside the
    plugin's collective call sites and checks each collective's tensors (a short pipelined run
    with the link simulator and a log every step, with subspace updates, 8-bit coordinates (the
    packed codes and scales), or MAPL with RVQ: its gradient and codebook exchange and its health
    metrics). The 3-stage run's middle stage meets the metadata inference's placeholders, which
    the probe fills with NaN: the leak, measured on real microbatches only, stays finite.

    The subspace-updates run also records every process group's timeout at each step: the init
    timeout until the first step is done (the pipeline's metadata inference runs the stages in
    series, each one's cold compile in turn), then the train timeout, for the mesh's groups and
    the plugin's own alike; its stage 1 sleeps in its first forward for longer than the train
    timeout, and the run still starts."""
    log = tmp_path / "probe.log"
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "collective_probe"),
                                       os.environ.get("PYTHONPATH", "")]),
        "COLLECTIVE_PROBE_LOG": str(log),
    }  # fmt: skip
    timeouts = []
    if run == "subspace updates":
        timeouts = ["--comm.init_timeout_seconds", "120", "--comm.train_timeout_seconds", "8"]
        env["COLLECTIVE_PROBE_TIMEOUTS"] = str(tmp_path / "timeouts")
        env["COLLECTIVE_PROBE_SLOW_FIRST_FORWARD"] = "1:10"
    stages = 3 if "3 stages" in run else 2
    records = torchrun(
        stages, tmp_path / "run", "--training.steps", "4", "--wan.latency_ms", "1",
        *PROBED_RUNS[run], *timeouts, env=env,
    )  # fmt: skip
    assert not log.exists(), log.read_text()
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    if stages == 3:
        leaks = [r["subspace/leak"] for r in records]
        assert all(math.isfinite(v) and v < leak_tolerance(torch.float32) for v in leaks), leaks
    if run == "subspace updates":
        assert records[-1]["subspace/updates"] == 2
        for rank in (0, 1):
            steps = [line.split() for line in Path(f"{tmp_path / 'timeouts'}.rank{rank}").read_text().splitlines()]
            assert [int(s[1]) for s in steps] == [1, 2, 3, 4]
            assert len(steps[0]) >= 2 + 4  # the world, the pipeline axis, the norm exchange's two
            assert set(steps[0][2:]) == {"120"}, steps[0]
            assert all(set(s[2:]) == {"8"} for s in steps[1:]), steps


def test_gpu_check_runs_in_cpu_mode():
    """The first thing a user runs on a new cluster, in CPU mode: a few real steps of the
    layout, then per-stage peak memory next to the planner, bytes per coordinate, throughput."""
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(TINY), "--steps", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = result.stdout[result.stdout.index("gpu check:") :]
    assert "| 0 |" in report and "| 1 |" in report
    assert "4 B per coordinate at boundary 0" in report
    assert "measured compression 16.0x" in report
    assert "subspace leak:" in report and "(exact:" in report
    assert "tokens/s per process" in report
