"""A pipelined subspace model computes the same function as the same model in one process.

From one seed checkpoint (TorchTitan's ``create_seed_checkpoint``, written by one process), a
1-process run and an S-stage GPipe run must produce the same loss at every step: the boundaries
carry only k coordinates and the next stage rebuilds the stream from them and the token ids.
The same holds for ResBM, whose stages send their learned h-wide bottleneck, for MAPL, and for
the projected mode, whose full-width stream is projected at the boundary only.
(conftest's ``seed_checkpoint`` and ``seeded_runs`` run them once; the export tests reuse them.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import (
    NCCL_RULES,
    REPO,
    SAMPLES,
    TINY,
    VALIDATE_AT_END,
    assert_same_run,
    torchrun,
)

from protocol_models.config.run_config import load_config
from protocol_models.model.boundary import BOUNDARIES
from protocol_models.training.metrics import read_jsonl
from protocol_models.wire.codecs import CodecSettings, build_codec
from protocol_models.wire.sizes import message_bytes

TINY_STEPS = [1, 2, 3]  # tests/tiny.toml


@pytest.mark.parametrize("stages", [2, 4])
def test_pipelined_losses_equal_single_process(seeded_runs, stages):
    single, piped = (read_jsonl(dump / "metrics.jsonl") for dump in seeded_runs(stages))

    assert piped[-1]["wire/compression_ratio"] == pytest.approx(64 / 4)
    assert_same_run(single, piped, steps=TINY_STEPS)


def test_schedules_agree_under_nccl_rules(tmp_path, seed_checkpoint, seeded_runs):
    """GPipe and 1F1B run the same microbatches through the same stages: same losses; under
    NCCL's point-to-point rules (the NCCL path: a group per boundary and direction, receives
    posted just in time, the batched norm exchange) GPipe equals the gloo path's run bit for bit,
    validation and samples included, and 1F1B validates between two training steps (the
    schedule switches to evaluation and back)."""
    seed = seed_checkpoint(2)
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed)]
    gpipe = torchrun(2, tmp_path / "gpipe", *load, *VALIDATE_AT_END, *SAMPLES, env=NCCL_RULES)
    one_f_one_b = torchrun(
        2, tmp_path / "1f1b", *load, "--parallelism.pipeline_parallel_schedule", "1F1B",
        "--validator.enable", "--validator.freq", "2", "--validator.steps", "2", env=NCCL_RULES,
    )  # fmt: skip
    assert_same_run(gpipe, one_f_one_b, steps=TINY_STEPS)
    gloo = seeded_runs(2)[1]
    assert_same_run(gpipe, read_jsonl(gloo / "metrics.jsonl"), steps=TINY_STEPS, rtol=0)
    validations = [read_jsonl(run / "validation.jsonl") for run in (tmp_path / "gpipe", gloo)]
    loss = "validation_metrics/loss"
    assert [r[loss] for r in validations[0]] == [r[loss] for r in validations[1]]
    assert [r["step"] for r in read_jsonl(tmp_path / "1f1b" / "validation.jsonl")] == [1, 2]


def test_quantized_coordinates_pipelined_equal_in_graph(tmp_path, seed_checkpoint):
    """2-bit coordinates: the pipelined wire (packed payloads at the transport hook, gradients
    stochastically rounded by the receiving stage) equals the in-graph hook of a 1-process run
    (same per-boundary generator, microbatches in schedule order); the wire carries the analytic
    payload."""
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_checkpoint(2))]
    bits = ["--codec.bits", "2"]
    single = torchrun(1, tmp_path / "pp1", "--protocol.stages", "2", *load, *bits)
    piped = torchrun(2, tmp_path / "pp2", *load, *bits)
    assert_same_run(single, piped, steps=TINY_STEPS)

    codec = build_codec("subspace", CodecSettings(bits=2), 64, protocol_seed=7)
    one = message_bytes("subspace", (1, 64, 64), torch.float32, "fwd", k=4, codec=codec)
    assert one == 64 * (4 * 2 // 8 + 2)  # per token: 4 two-bit codes in one byte + a bf16 scale
    for r in piped:  # tests/tiny.toml: 4 microbatches of [1, 64, 64] per step, one boundary
        assert r["wire/fwd_bytes/b0"] == r["wire/bwd_bytes/b0"] == 4 * one
        assert r["wire/compression_ratio"] == pytest.approx(64 * 4 / 3)


def _learned_boundary_runs(tmp_path, seed_checkpoint, *learned: str) -> list[dict]:
    """A learned boundary method (``learned``: its overrides) at width k = 4 under Muon, from one
    seed checkpoint: the 2-process run equals the 1-process run with the boundary in-graph
    (``protocol.stages = 2``). Returns the 2-process records."""
    learned = ("--optimizer.name", "muon", *learned)
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path",
            str(seed_checkpoint(2, *learned))]  # fmt: skip
    single = torchrun(1, tmp_path / "pp1", "--protocol.stages", "2", *load, *learned)
    piped = torchrun(2, tmp_path / "pp2", *load, *learned)
    assert_same_run(single, piped, steps=TINY_STEPS)
    return piped


def test_resbm_pipelined_equal_in_graph(tmp_path, seed_checkpoint):
    """ResBM at h = 4: two processes sending the bottleneck ``b`` ``[1, 64, 4]`` over the wire
    train exactly as one process with the same boundary in-graph; the wire carries ``b`` and its
    gradient, nothing else."""
    piped = _learned_boundary_runs(tmp_path, seed_checkpoint, "--protocol.mode", "resbm")
    one = message_bytes("resbm", (1, 64, 64), torch.float32, "fwd", k=4)
    assert one == 64 * 4 * 4  # per token: h = 4 fp32 values
    for r in piped:  # tests/tiny.toml: 4 microbatches of [1, 64, 64] per step, one boundary
        assert r["wire/fwd_bytes/b0"] == r["wire/bwd_bytes/b0"] == 4 * one
        assert r["wire/compression_ratio"] == pytest.approx(64 / 4)
        assert "wire/sync_bytes" not in r


def test_mapl_pipelined_equal_in_graph(tmp_path, seed_checkpoint):
    """MAPL at r = 4 with 2 residual quantizer stages of 16 codes (U by StiefelMuon): two
    processes, each with its own copy of the boundary's U, P, Q and codebooks -- summing their
    gradients and passing the sender's EMA-refreshed codebooks by P2P before every step -- train
    exactly as one process holding both copies. Forward, the wire carries one byte of packed
    indices per token; backward, the straight-through gradient ``[1, 64, 4]`` fp32; the copies'
    synchronization is metered apart; U stays orthonormal and the codes are in use."""
    rvq = ["--protocol.rvq_stages", "2", "--protocol.rvq_codebook", "16"]
    piped = _learned_boundary_runs(tmp_path, seed_checkpoint, "--protocol.mode", "mapl", *rvq)
    fwd, bwd = 64 * 2 * 4 // 8, 64 * 4 * 4  # per microbatch: 2 x 4-bit indices; 4 fp32 values
    synced = 4 * (64 * 4 + 8192 * 8 + 8 * 64)  # fp32 gradients of U, P, Q (anchor_rank 8)
    for r in piped:  # tests/tiny.toml: 4 microbatches of [1, 64, 64] per step, one boundary
        assert (r["wire/fwd_bytes/b0"], r["wire/bwd_bytes/b0"]) == (4 * fwd, 4 * bwd)
        assert r["wire/compression_ratio"] == pytest.approx(2 * 64 * 64 * 4 / (fwd + bwd))
        assert r["wire/sync_bytes"] == 2 * synced + 2 * 16 * 4 * 4  # + the sender's codebooks
        assert r["mapl/orthonormality"] < 1e-5
        assert 1 < r["mapl/code_perplexity/b0"] <= 16
    protocol = load_config(str(TINY), ["--protocol.mode", "mapl", *rvq],
                           check_environment=False).protocol  # fmt: skip
    sent = BOUNDARIES["mapl"].sync_values(64, 8192, protocol)
    assert 4 * sum(sent) == piped[0]["wire/sync_bytes"]


def test_projected_pipelined_equal_in_graph(tmp_path, seed_checkpoint):
    """``projected`` mode (full-width writers, the stream projected onto ``F + span(U)`` at
    the boundary only) with 8-bit coordinates and stage tables: two processes train exactly as
    one process with the boundary in-graph, and the wire carries the bytes the subspace mode's
    8-bit wire does, forward and backward (the receiving stage's table never crosses)."""
    piped = _learned_boundary_runs(tmp_path, seed_checkpoint, "--protocol.mode", "projected",
                                   "--codec.bits", "8", "--protocol.stage_tables", "true")  # fmt: skip
    codec = build_codec("projected", CodecSettings(bits=8), 64, protocol_seed=7)
    one = message_bytes("projected", (1, 64, 64), torch.float32, "fwd", k=4, codec=codec)
    today = build_codec("subspace", CodecSettings(bits=8), 64, protocol_seed=7)
    assert one == message_bytes("subspace", (1, 64, 64), torch.float32, "fwd", k=4, codec=today)
    assert one == 64 * (4 + 2)  # per token: 4 one-byte codes and a bf16 scale
    for r in piped:  # tests/tiny.toml: 4 microbatches of [1, 64, 64] per step, one boundary
        assert r["wire/fwd_bytes/b0"] == r["wire/bwd_bytes/b0"] == 4 * one


def _validation_loss(nproc: int, dump, seed, *overrides: str) -> float:
    """The validation loss (2 batches) of the tiny model loaded from ``seed``, evaluated forward
    only by ``tests/pipeline_eval.py`` on ``nproc`` processes (one per pipeline stage); the data
    it reads prepared beforehand."""
    args = ["--toml", str(TINY), "--dump_folder", str(dump),
            "--parallelism.pipeline_parallel_degree", str(nproc), "--validator.enable",
            "--validator.steps", "2", "--checkpoint.enable", "--checkpoint.initial_load_path",
            str(seed), *overrides]  # fmt: skip
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), str(REPO / "tests" / "pipeline_eval.py"), *args]  # fmt: skip
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "PROTOCOL_MODELS_DEVICE": "cpu"})  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    (record,) = [json.loads(line) for line in (dump / "validation.jsonl").read_text().splitlines()]
    return record["validation_metrics/loss"]


def test_flex_attention_evaluates_through_the_pipeline(tmp_path, seed_checkpoint):
    """Flex attention through the pipeline, forward only (Inductor-CPU compiles flex's forward,
    not its backward): from one seed checkpoint, a 2-stage pipelined validation over documents
    of a few tokens each -- each microbatch's BlockMask (causal within each packed document) and
    the documents' positions reach both stages as kwargs through ``WirePipelineStage``, the
    schedule's metadata inference included -- equals the same model's validation in one
    process, and differs from causal SDPA's over the whole row (the masks took effect). Only a
    GPU run checks flex's backward, its Triton kernels at max-autotune and how long the first
    step's compile takes."""
    seed = seed_checkpoint(2)
    lines = tmp_path / "short_documents.txt"
    lines.write_text("".join(f"Line {i} of a made-up play, spoken by player {i % 7}.\n"
                             for i in range(400)))  # fmt: skip
    short = ["--dataloader.validation_files", str(lines), "--dataloader.sample_by", "line",
             "--protocol.stages", "2"]  # fmt: skip
    flex = [*short, "--model.attention", "flex"]
    subprocess.run([sys.executable, "-m", "protocol_models.prepare", "--toml", str(TINY),
                    "--validator.enable", *short], cwd=REPO, check=True, capture_output=True)  # fmt: skip
    piped = _validation_loss(2, tmp_path / "piped", seed, *flex)
    single = _validation_loss(1, tmp_path / "single", seed, *flex)
    causal = _validation_loss(1, tmp_path / "sdpa", seed, *short)
    assert abs(piped - single) <= 2e-6 * abs(single), (piped, single)
    # an untrained model's loss is near ln(V) whatever it attends to: the masks move it by ~3e-4
    assert abs(causal - single) > 1e-4, (causal, single)
