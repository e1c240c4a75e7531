"""Optimizers keep the boundary exact: unit checks and real 2-stage runs; a frozen embedding
stays frozen."""

from __future__ import annotations

import pytest
import torch
from conftest import torchrun

from protocol_models.hf.checkpoint_files import CheckpointTensors
from protocol_models.hf.fold import EMBEDDING
from protocol_models.model.subspace import leak_tolerance, make_basis_and_table
from protocol_models.training.optimizers import Muon, newton_schulz


def test_newton_schulz_commutes_with_the_basis():
    """NS(U Y) = U NS(Y): Muon on the factors A equals Muon on W = U A with projected gradients."""
    basis, _ = make_basis_and_table(0, 256, 8, 1)
    for shape in [(8, 64), (8, 512)]:  # fewer and more columns than d
        y = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
        assert torch.allclose(newton_schulz(basis @ y), basis @ newton_schulz(y), atol=1e-5)


def test_newton_schulz_orthogonalizes():
    x = newton_schulz(torch.randn(16, 64, generator=torch.Generator().manual_seed(2)))
    singular_values = torch.linalg.svdvals(x)
    assert singular_values.min() > 0.5 and singular_values.max() < 1.5


def test_muon_step_is_the_documented_update():
    w = torch.nn.Parameter(torch.zeros(4, 16))
    w.grad = torch.randn(4, 16, generator=torch.Generator().manual_seed(3))
    Muon([w], lr=0.1, momentum=0.9, nesterov=True).step()
    nesterov = w.grad.lerp(0.1 * w.grad, 0.9)  # buffer after one step: (1 - mu) g
    assert torch.allclose(w.detach(), -0.1 * newton_schulz(nesterov), atol=1e-6)


@pytest.mark.parametrize("name", ["adamw", "adamw_rowwise", "muon", "adamw_project"])
def test_optimizer_keeps_the_subspace_and_learns(tmp_path, name):
    records = torchrun(
        2,
        tmp_path / name,
        "--optimizer.name",
        name,
        "--training.steps",
        "50",
        "--metrics.log_freq",
        "10",
    )
    assert [r["step"] for r in records] == [1, 10, 20, 30, 40, 50]
    assert all(r["subspace/leak"] < leak_tolerance(torch.float32) for r in records)
    assert records[-1]["loss"] < records[0]["loss"] - 1.0


def test_frozen_embedding_keeps_its_initial_values(tmp_path, seed_checkpoint):
    """``model.freeze_embedding`` (the token-table diagnostic): a dense run's embedding ends
    where its seed checkpoint started, while its blocks train."""
    dense = ["--protocol.mode", "dense", "--optimizer.name", "muon"]
    seed = seed_checkpoint(2, *dense)
    torchrun(1, tmp_path / "run", "--protocol.stages", "2", *dense, "--model.freeze_embedding",
             "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed))  # fmt: skip
    block = "layers.0.attention.wo.weight"
    start = CheckpointTensors(seed).load([EMBEDDING, block])
    end = CheckpointTensors(tmp_path / "run" / "checkpoint" / "step-3").load([EMBEDDING, block])
    assert torch.equal(start[EMBEDDING], end[EMBEDDING])
    assert not torch.equal(start[block], end[block])


def test_muon_keeps_the_factor_equivalence_that_torch_muon_rounds_away():
    """Why the plugin keeps its own Muon rather than torch 2.14's ``torch.optim.Muon``: the
    fair-twin argument needs Muon on the factor ``A`` ``[k, in]`` lifted by U to equal Muon on
    ``W = U A`` with the projected gradient ``U G`` (``newton_schulz`` is equivariant under U).
    The plugin orthogonalizes in fp32: the two updates agree to ~3e-5 of the update's norm.
    torch's Newton-Schulz runs in bf16, whose rounding puts small singular values into the
    d - k directions ``U G`` lacks, and the iteration (slope ~3.4 at zero, 5 steps) lifts them
    towards 1: the updates differ by ~30% and ``W`` leaves span(U)."""
    basis, _ = make_basis_and_table(0, 256, 8, 1)
    grad = torch.randn(8, 512, generator=torch.Generator().manual_seed(4))  # wider than d

    def update(optimizer_class, gradient):
        weight = torch.nn.Parameter(torch.zeros(gradient.shape))
        weight.grad = gradient.clone()
        optimizer_class([weight], lr=0.1, momentum=0.0, nesterov=False, weight_decay=0.0).step()
        return weight.detach()

    def mismatch(optimizer_class) -> float:
        lifted = basis @ update(optimizer_class, grad)  # U dA: [256, 512]
        full = update(optimizer_class, basis @ grad)  # dW
        return float((lifted - full).norm() / full.norm())

    assert mismatch(Muon) < 1e-4
    assert mismatch(torch.optim.Muon) > 0.1


def test_writer_lr_scale_steps_the_upstream_writers_only():
    """``optimizer.writer_lr_scale``: Muon's step on ``wo``/``w2`` of the blocks upstream of the
    last boundary is that multiple of its step elsewhere, in the dense twin as in the subspace
    model (the same matrices)."""
    from protocol_models.model.model import ModelArch, build_model_config
    from protocol_models.training.optimizers import bind_writers
    from protocol_models.training.protocol import ProtocolSettings

    arch = ModelArch(dim=64, n_layers=4, n_heads=4, vocab_size=128)
    for mode in ("dense", "subspace"):
        model = build_model_config(arch, ProtocolSettings(mode=mode, k=4), 2).build()
        torch.manual_seed(0)
        model.init_weights()
        matrices = [p for n, p in model.named_parameters() if n.startswith("layers.")
                    and p.ndim == 2]  # fmt: skip
        before = [p.detach().clone() for p in matrices]
        for p in matrices:
            p.grad = torch.randn_like(p)
        steps = []
        for scale in (1.0, 2.0):
            for p, start in zip(matrices, before, strict=True):
                p.data.copy_(start)
            optimizer = Muon(matrices, lr=0.1, momentum=0.0, writer_lr_scale=scale)
            bind_writers([optimizer], [model])
            optimizer.step()
            steps.append([p.detach() - start for p, start in zip(matrices, before, strict=True)])
        writers = {id(w) for w, kind in model.constrained_weights() if kind == "writer"}
        names = [n for n, p in model.named_parameters() if n.startswith("layers.") and p.ndim == 2]
        assert sorted(n for n, p in zip(names, matrices, strict=True) if id(p) in writers) == [
            f"layers.{i}.{w}.weight" for i in (0, 1)
            for w in ("attention.wo", "feed_forward.w2")
        ]  # fmt: skip
        for p, one, two in zip(matrices, *steps, strict=True):
            assert torch.allclose(two, (2.0 if id(p) in writers else 1.0) * one, atol=1e-6)
