"""GPU-path checks that run on CPU: bf16 mixed precision through TorchTitan's FSDP wrapper, and
the device of every tensor that enters a collective."""

from __future__ import annotations

import json
import math
import os
import subprocess
import types
from pathlib import Path

import pytest
import torch
from conftest import NCCL_RULES, REPO, TINY, torchrun

from protocol_models.cluster.fsdp_probe import FSDP_PROBE_ENV
from protocol_models.cluster.plan import plan_stages
from protocol_models.config.run_config import load_config
from protocol_models.model.subspace import leak_tolerance

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
            steps = _group_timeouts(tmp_path / "timeouts", rank)
            assert sorted(steps) == [1, 2, 3, 4]
            assert len(steps[1]) >= 4  # the world, the pipeline axis, the norm exchange's two
            assert {t for t, _ in steps[1]} == {120}, steps[1]
            assert all({t for t, _ in steps[s]} == {8} for s in (2, 3, 4)), steps


def _group_timeouts(path: Path, rank: int) -> dict[int, list[tuple[int, int]]]:
    """``step -> [(timeout seconds, group size), ...]`` of every group of ``rank`` as the step
    started (the collective probe's ``$COLLECTIVE_PROBE_TIMEOUTS`` record)."""
    steps = {}
    for line in Path(f"{path}.rank{rank}").read_text().splitlines():
        _, step, *groups = line.split()
        steps[int(step)] = [tuple(int(float(v)) for v in g.split(":")) for g in groups]
    return steps


PP_FSDP = ["--parallelism.pipeline_parallel_degree", "2", "--codec.bits", "8",
           "--model.loss_chunk_tokens", "32", "--training.mixed_precision_param", "bfloat16",
           "--activation_checkpoint", "full", "--training.steps", "4"]  # fmt: skip
"""The 8B config's layout scaled down to 4 processes: 2 pipeline stages, each over 2 ranks."""


def test_pipeline_with_fsdp_matches_replicated_parameters(tmp_path, seed_checkpoint):
    """The 8B layout scaled down: 4 processes, 2 pipeline stages x 2-way FSDP (each stage's
    parameters sharded over its 2 ranks), 8-bit wire, chunked loss, bf16 mixed precision, full
    activation checkpointing, under the collective probe on the emulated NCCL backend
    (``NCCL_RULES``), whose every loss and gradient norm equal the same run's on plain gloo bit
    for bit. From one seed checkpoint, every step's
    loss equals, to bf16 precision, the same layout's with each stage's parameters replicated on
    its 2 ranks instead of sharded (the same ranks read the same batches), and so does the
    gradient norm (FSDP on gloo reduces with SUM and divides: ``cpu_shim.gloo_fsdp_reductions``). Every group -- the FSDP axis's
    2-rank groups and the pipeline's, not only the world -- keeps the init timeout through step
    1, the train timeout after. ``gpu_check``'s FSDP probe (on for the sharded run) times each
    stage's all-gather of its parameters in bf16 and reduce-scatter of their fp32 gradients."""
    log = tmp_path / "probe.log"
    env = {
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "collective_probe"),
                                       os.environ.get("PYTHONPATH", "")]),
        "COLLECTIVE_PROBE_LOG": str(log),
        "COLLECTIVE_PROBE_TIMEOUTS": str(tmp_path / "timeouts"),
        FSDP_PROBE_ENV: "1",
    }  # fmt: skip
    timeouts = ["--comm.init_timeout_seconds", "300", "--comm.train_timeout_seconds", "60"]
    seed = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_checkpoint(2))]
    sharded, output = torchrun(
        4, tmp_path / "fsdp", *PP_FSDP, *seed, "--parallelism.data_parallel_shard_degree", "2",
        *timeouts, env={**env, **NCCL_RULES}, return_output=True,
    )  # fmt: skip
    assert not log.exists(), log.read_text()
    assert "boundary 0 carries bfloat16" in output
    replicated = torchrun(
        4, tmp_path / "replicated", *PP_FSDP, *seed, "--parallelism.data_parallel_shard_degree", "1",
        "--parallelism.data_parallel_replicate_degree", "2",
    )  # fmt: skip
    assert [r["step"] for r in sharded] == [r["step"] for r in replicated] == [1, 2, 3, 4]
    for key in ("loss", "grad_norm"):
        pairs = [(a[key], b[key]) for a, b in zip(sharded, replicated, strict=True)]
        assert all(abs(a - b) <= 2**-8 * abs(b) for a, b in pairs), (key, pairs)
    assert sharded[-1]["loss"] < sharded[0]["loss"]
    on_gloo = torchrun(
        4, tmp_path / "fsdp_gloo", *PP_FSDP, *seed, "--parallelism.data_parallel_shard_degree", "2",
    )  # fmt: skip
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in sharded] == [r[key] for r in on_gloo], key
    for rank in range(4):
        steps = _group_timeouts(tmp_path / "timeouts", rank)
        assert sorted(steps) == [1, 2, 3, 4]
        assert {size for _, size in steps[1]} >= {2, 4}, steps[1]  # mesh axes and the world
        assert {t for t, _ in steps[1]} == {300}, steps[1]
        assert all({t for t, _ in steps[s]} == {60} for s in (2, 3, 4)), steps
    config = load_config(str(TINY), [*PP_FSDP, "--parallelism.data_parallel_shard_degree", "2"],
                         check_environment=False)  # fmt: skip
    fsdp = json.loads((tmp_path / "fsdp" / "fsdp_probe.json").read_text())
    assert [(r["stage"], r["ranks"], r["backend"], r["all_gathers_per_step"]) for r in fsdp] == [
        (0, 2, "nccl_rules", 1), (1, 2, "nccl_rules", 1)]  # fmt: skip (the emulated NCCL)
    for row, plan in zip(fsdp, plan_stages(config), strict=True):
        assert (row["all_gather_bytes"], row["reduce_scatter_bytes"]) == (2 * plan.params,
                                                                          4 * plan.params)
        assert row["all_gather_s"] > 0 and row["reduce_scatter_s"] > 0


def test_gpu_check_runs_in_cpu_mode(tmp_path):
    """The first thing a user runs on a new cluster, in CPU mode: this node's "before the first
    cluster run" checklist as a table, a few real steps of the layout, then per-stage peak
    memory next to the planner, bytes per coordinate, throughput. The check saves nothing into
    the run's checkpoint folder."""
    dump = tmp_path / "run"
    result = subprocess.run(
        ["bash", "scripts/gpu_check.sh", str(TINY), "--steps", "3", "--dump_folder", str(dump),
         "--checkpoint.enable", "true", "--checkpoint.per_node", "true",
         "--transport.link_mbps", "80", "--transport.link_latency_ms", "50"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {line.split(" | ")[0][2:]: line.split(" | ")[1] for line in result.stdout.splitlines()
            if line.startswith("| ") and line.count(" | ") == 2}  # fmt: skip
    assert rows.pop("before the first cluster run") == "verdict", rows
    assert {k: v for k, v in rows.items() if k != "sysctls"} == {
        "driver": "n/a", "toolchain": "n/a", "wandb key": "n/a", "checkpoints": "ok",
        "interfaces": "n/a", "FSDP network": "n/a", "open files": "n/a",
    }, rows  # fmt: skip
    assert rows["sysctls"] in ("ok", "warn"), rows  # this host's TCP settings decide
    assert not list(dump.glob("checkpoint/**/step-*"))
    report = result.stdout[result.stdout.index("gpu check:") :]
    assert "| 0 |" in report and "| 1 |" in report
    assert "4 B per coordinate at boundary 0" in report
    assert "measured compression 16.0x" in report
    assert "subspace leak:" in report and "(exact:" in report
    assert "tokens/s per process" in report
    assert "FSDP stage" not in report  # no sharding: nothing to time


MFU_PEAKS = {
    "NVIDIA H100 80GB HBM3": (989e12, "detected: NVIDIA H100 80GB HBM3"),
    "NVIDIA H200": (989e12, "detected: NVIDIA H200"),
    "NVIDIA L4": (312e12, "TorchTitan's A100 fallback: it has no figure for 'NVIDIA L4'"),
    "cpu": (312e12, "TorchTitan's figure for device 'cpu': no GPU"),
}
"""A device name as TorchTitan reads it, TorchTitan 0.3.0's peak for it (``get_peak_flops``: its
H100 SXM and H200 figures, and its A100 fallback), and how the trainer's line names the source."""


@pytest.mark.parametrize("name", list(MFU_PEAKS))
def test_mfu_without_peak_tflops_uses_the_detected_peak(monkeypatch, tmp_path, name):
    """MFU on a config without peak_tflops uses the detected peak (tested with a faked device
    name): a stand-in for the device module TorchTitan's metrics read names the device, the
    device memory monitor (the metrics processor's, whose name the trainer passes to
    ``mfu_peak``) reads it, and the peak is TorchTitan's figure for it; a set ``[hardware]
    peak_tflops`` wins. ``lspci`` is kept off ``PATH``: on a GPU machine TorchTitan would read
    the device from it instead."""
    import torchtitan.components.metrics as titan_metrics

    from protocol_models.training.hardware import HardwareSettings, mfu_peak

    device = types.SimpleNamespace(
        get_device_name=lambda device=None: name, current_device=lambda: 0,
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=2**30),
        reset_peak_memory_stats=lambda: None, empty_cache=lambda: None,
    )  # fmt: skip
    monkeypatch.setattr(titan_metrics, "device_module", device)
    monkeypatch.setenv("PATH", str(tmp_path))
    detected = titan_metrics.build_device_memory_monitor().device_name
    flops, source = mfu_peak(HardwareSettings().peak_tflops, detected)
    expected, clause = MFU_PEAKS[name]
    assert flops == expected and source.startswith(clause), source
    assert mfu_peak(50.0, detected) == (50e12, "from [hardware] peak_tflops")


def test_cpu_run_states_its_mfu_peak(tmp_path):
    """A real run without ``peak_tflops`` logs which peak its MFU is measured against and where
    that came from, without claiming a GPU, and its logged MFU is measured against that peak."""
    records, output = torchrun(1, tmp_path / "run", "--training.steps", "2", return_output=True)
    assert "MFU is measured against 312 TFLOP/s (TorchTitan's figure for device 'cpu'" in output
    assert "Peak FLOPS used for computing MFU" not in output  # TorchTitan's own, filtered
    for r in records:
        assert 100 * r["tflops"] * 1e12 / r["mfu(%)"] == pytest.approx(312e12, rel=1e-9)
