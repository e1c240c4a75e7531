"""Subspace updates: the geodesic step, the re-expression, and real pipelined runs that update U
(metrics, bit-identical U on every stage, bit-exact resume across an update)."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, torchrun

from protocol_models.model.model import ModelArch, build_model_config
from protocol_models.model.subspace import leak, leak_tolerance, make_basis_and_table
from protocol_models.training.grassmann import (
    euclidean_grad,
    geodesic_step,
    largest_angle_deg,
    orthonormality,
    reexpress,
)
from protocol_models.training.optimizers import SubspaceAdamW, bind_subspace
from protocol_models.training.protocol import ProtocolSettings

ARCH = ModelArch(dim=64, n_layers=4, n_heads=4, vocab_size=512)


def _trained_model(parametrization: str, optimizer_cls, **optimizer_kwargs):
    """A 2-stage-layout model after 3 optimizer steps (so every optimizer state is non-zero)."""
    settings = ProtocolSettings(k=4, seed=3, update_every=1, parametrization=parametrization)
    model = build_model_config(ARCH, settings, 2).build()
    torch.manual_seed(0)
    model.init_weights()
    optimizer = optimizer_cls(model.parameters(), **optimizer_kwargs)
    if isinstance(optimizer, SubspaceAdamW):
        optimizer.bind(dict(model.constrained_weights()), lambda: model.basis)
    ids = torch.randint(0, ARCH.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        optimizer.zero_grad()
        model.basis.grad = None
        model(ids, token_ids=ids).logsumexp(-1).mean().backward()
        optimizer.step()
    return model, optimizer, ids


def _effective(model, weight: torch.Tensor, kind: str) -> torch.Tensor:
    """What a constrained weight writes into the stream, as a full-width matrix."""
    if not model.factored:
        return weight.detach()
    u = model.basis.detach()
    return u @ weight.detach() if kind == "writer" else weight.detach() @ u.T


def test_geodesic_step_is_orthonormal_and_moves_by_the_requested_angle():
    basis, _ = make_basis_and_table(0, 256, 8, 1)
    gen = torch.Generator().manual_seed(4)
    for _ in range(30):  # many updates: no drift away from orthonormality
        grad = basis @ torch.randn(8, 8, generator=gen) * 100 + torch.randn(256, 8, generator=gen)
        new = geodesic_step(basis, grad, 3.0)
        assert orthonormality(new) < 1e-6
        assert math.isclose(largest_angle_deg(basis, new), 3.0, abs_tol=1e-3)
        basis = new
    assert torch.equal(geodesic_step(basis, basis @ torch.ones(8, 8), 3.0), basis)


def test_geodesic_step_descends():
    """A small step against the Riemannian gradient of f(U) = <C, U> lowers f."""
    basis, _ = make_basis_and_table(1, 32, 4, 1)
    target = torch.randn(32, 4, generator=torch.Generator().manual_seed(5))
    new = geodesic_step(basis, target, 1.0)
    assert (target * new).sum() < (target * basis).sum()


@pytest.mark.parametrize(
    ("parametrization", "optimizer_cls", "kwargs"),
    [
        ("factor", torch.optim.AdamW, {"lr": 1e-2}),
        ("full", SubspaceAdamW, {"lr": 1e-2, "rule": "rowwise"}),
    ],
)
def test_update_changes_the_function_only_by_the_reprojection(
    parametrization, optimizer_cls, kwargs
):
    model, optimizer, ids = _trained_model(parametrization, optimizer_cls, **kwargs)
    grad = euclidean_grad(model)
    assert grad.abs().max() > 0
    before = {id(w): _effective(model, w, kind) for w, kind in model.constrained_weights()}
    moments = {
        id(w): _effective(model, optimizer.state[w]["exp_avg"], kind)
        for w, kind in model.constrained_weights()
    }
    with torch.no_grad():
        loss_before = float(model(ids, token_ids=ids).logsumexp(-1).mean())

    new = geodesic_step(model.basis.detach(), grad, 10.0)
    reexpress(model, [optimizer], new)

    assert torch.equal(model.basis.detach(), new)
    for w, kind in model.constrained_weights():
        projector = new @ new.T
        expected = projector @ before[id(w)] if kind == "writer" else before[id(w)] @ projector
        assert torch.allclose(_effective(model, w, kind), expected, atol=1e-5)
        m = moments[id(w)]
        expected_m = projector @ m if kind == "writer" else m @ projector
        got_m = _effective(model, optimizer.state[w]["exp_avg"], kind)
        assert torch.allclose(got_m, expected_m, atol=1e-6)
    # the boundary stays exact with the new basis: the stream after layer 1 is in F + span(U')
    x = model.tok_embeddings(ids)
    x = (x.float() @ new.T if model.factored else x) + model.token_table[ids]
    for layer in list(model.layers.values())[:2]:
        x = layer(x, None, basis=new)
    assert leak(x, ids, new, model.token_table) < leak_tolerance(torch.float32)
    with torch.no_grad():
        loss_after = float(model(ids, token_ids=ids).logsumexp(-1).mean())
    print(f"{parametrization}: loss change at a 10 degree update {loss_after - loss_before:+.5f}")
    assert loss_after != loss_before  # a 10 degree re-projection is not a no-op


UPDATES = ["--protocol.update_every", "4", "--protocol.update_angle_deg", "5"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "6", "--lr_scheduler.total_steps", "12"]


@pytest.mark.parametrize("optimizer", ["muon", "adamw_rowwise"])
def test_updates_in_a_pipeline_keep_the_boundary_exact_and_resume_bit_exactly(tmp_path, optimizer):
    """2 stages, updates at steps 4, 8 and 12; then the run is resumed from its step-6
    checkpoint (mid-window, with the update of step 8 ahead) and must replay steps 7..12 bit for
    bit."""
    args = ["--optimizer.name", optimizer, "--training.steps", "12", *UPDATES, *CKPT]
    reference = torchrun(2, tmp_path / "run", *args)
    assert [r["step"] for r in reference] == list(range(1, 13))
    updates = {r["step"]: r["subspace/updates"] for r in reference}
    assert updates[3] == 0 and updates[4] == 1 and updates[12] == 3
    assert all(r["subspace/orthonormality"] < 1e-6 for r in reference)
    assert all(r["subspace/leak"] < leak_tolerance(torch.float32) for r in reference)
    assert math.isclose(reference[-1]["subspace/update_angle_deg"], 5.0, abs_tol=1e-3)

    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-12")
    resumed = torchrun(2, tmp_path / "run", *args)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    assert [r["grad_norm"] for r in resumed][6:] == [r["grad_norm"] for r in reference][6:]


def test_resume_with_a_different_token_table_is_refused(tmp_path):
    torchrun(2, tmp_path / "run", "--training.steps", "2", "--checkpoint.enable")
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.launch", "--standalone", "--nproc_per_node", "2",
         "-m", "protocol_models.train", "--toml", str(TINY), "--dump_folder",
         str(tmp_path / "run"), "--training.steps", "4", "--checkpoint.enable",
         "--protocol.seed", "8"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors and "different token table F" in errors[0]
    assert "Traceback" not in result.stderr


def test_rowwise_step_stays_in_the_subspace_with_one_second_moment_per_column():
    basis, _ = make_basis_and_table(2, 32, 4, 1)
    writer = torch.nn.Parameter(basis @ torch.randn(4, 12))
    embedding = torch.nn.Parameter(torch.randn(50, 4) @ basis.T)
    optimizer = SubspaceAdamW([writer, embedding], rule="rowwise", lr=1e-2, weight_decay=0.1)
    optimizer.bind({writer: "writer", embedding: "embedding"}, lambda: basis)
    for seed in range(3):
        gen = torch.Generator().manual_seed(seed)
        writer.grad, embedding.grad = torch.randn(32, 12, generator=gen), torch.randn(50, 32)
        optimizer.step()
    outside = torch.eye(32) - basis @ basis.T
    assert (outside @ writer.detach()).abs().max() < 1e-6
    assert (embedding.detach() @ outside).abs().max() < 1e-6
    assert optimizer.state[writer]["exp_avg_sq_shared"].shape == (12,)
    assert optimizer.state[embedding]["exp_avg_sq_shared"].shape == (50,)


def test_bind_subspace_finds_the_constrained_matrices_of_a_stage():
    model = build_model_config(ARCH, ProtocolSettings(k=4, parametrization="full"), 2).build()
    model.init_weights()

    class Container(list):
        pass

    optimizer = SubspaceAdamW(model.parameters(), rule="project", lr=1e-3)
    bind_subspace(Container([optimizer]), [model])
    names = {n for n, p in model.named_parameters() if p in optimizer.constrained}
    assert names == {
        "tok_embeddings.weight",
        *(f"layers.{i}.{w}.weight" for i in (0, 1) for w in ("attention.wo", "feed_forward.w2")),
    }
