"""What crosses each boundary: exact byte counts, dense twin, and the subspace invariant."""

from __future__ import annotations

import pytest
import torch
from conftest import read_jsonl, torchrun

from protocol_models.model.subspace import leak_tolerance

# tests/tiny.toml: local_batch_size 4, microbatch 1, seq_len 64, d 64, k 4, fp32
N_MB, MB, SEQ, DIM, K, FP32 = 4, 1, 64, 64, 4, 4


@pytest.mark.parametrize(
    ("stages", "mode", "width"), [(2, "subspace", K), (4, "subspace", K), (2, "dense", DIM)]
)
def test_bytes_per_boundary_are_exact(tmp_path, stages, mode, width):
    records = torchrun(stages, tmp_path / "run", "--protocol.mode", mode, "--training.steps", "2")
    expected = N_MB * MB * SEQ * width * FP32
    for r in records:
        for b in range(stages - 1):
            assert r[f"wire/fwd_bytes/b{b}"] == expected
            assert r[f"wire/bwd_bytes/b{b}"] == expected
        assert r["wire/fwd_bytes"] == r["wire/bwd_bytes"] == expected * (stages - 1)
        assert r["wire/dense_bytes"] == 2 * N_MB * MB * SEQ * DIM * FP32 * (stages - 1)
        assert r["wire/compression_ratio"] == DIM / width
        assert r["loss"] > 0
    assert ("subspace/leak" in records[-1]) == (mode == "subspace")


def test_invariant_holds_after_training(tmp_path):
    """20 AdamW steps move every constrained weight; the stream must stay in F + span(U)."""
    dump = tmp_path / "run"
    records = torchrun(
        2, dump, "--training.steps", "20", "--metrics.enable_wandb", "--metrics.enable_tensorboard",
        env={"WANDB_MODE": "offline"},
    )  # fmt: skip
    assert len(records) == 20
    assert all(r["subspace/leak"] < leak_tolerance(torch.float32) for r in records)
    assert records[-1]["loss"] < records[0]["loss"]
    # the same metrics reached TensorBoard and an offline wandb run
    assert list((dump / "tb").rglob("events.out.tfevents.*"))
    assert list((dump / "wandb").rglob("*.wandb"))
    assert read_jsonl(dump / "metrics.jsonl") == records
