"""In-process checks of the model and codec: exact reconstruction, k-dim wire both ways."""

from __future__ import annotations

import pytest
import torch

from protocol_models.model import subspace
from protocol_models.model.layout import stage_layer_ranges
from protocol_models.model.model import (
    ModelArch,
    build_model_config,
)
from protocol_models.tools.errors import DataError
from protocol_models.training.protocol import ProtocolSettings
from protocol_models.wire.pipeline import split_stage

ARCH = ModelArch(dim=64, n_layers=4, n_heads=4, vocab_size=512)


def _model(mode: str, stages: int, k: int = 4):
    """``mode`` may end in ``+tables`` (``projected`` or ``dense`` with ``stage_tables``)."""
    mode, tables = mode.removesuffix("+tables"), mode.endswith("+tables")
    protocol = ProtocolSettings(mode=mode, k=k, seed=3, stage_tables=tables)
    model = build_model_config(ARCH, protocol, stages).build()
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights()
        for p in model.parameters():  # move every factor away from its (small) init
            p.add_(0.05 * torch.randn_like(p))
    return model


def _ids(seed=1, batch=2, seq=16):
    return torch.randint(
        0, ARCH.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


def test_basis_and_table_are_a_function_of_the_seed():
    u1, f1 = subspace.make_basis_and_table(5, 64, 8, 100)
    u2, f2 = subspace.make_basis_and_table(5, 64, 8, 100)
    u3, _ = subspace.make_basis_and_table(6, 64, 8, 100)
    assert torch.equal(u1, u2) and torch.equal(f1, f2) and not torch.equal(u1, u3)
    assert torch.allclose(u1.T @ u1, torch.eye(8), atol=1e-6)


def test_codec_is_lossless_exactly_on_the_subspace():
    basis, table = subspace.make_basis_and_table(0, 64, 8, 100)
    ids = _ids(seq=10) % 100
    on = table[ids] + torch.randn(2, 10, 8) @ basis.T
    off = on + 0.1 * torch.randn(2, 10, 64)
    c = subspace.encode(on, ids, basis, table)
    assert c.shape == (2, 10, 8)
    assert torch.allclose(subspace.decode(c, ids, basis, table), on, atol=1e-5)
    assert subspace.leak(on, ids, basis, table) < 1e-6
    assert subspace.leak(off, ids, basis, table) > 1e-2
    assert not torch.allclose(
        subspace.decode(subspace.encode(off, ids, basis, table), ids, basis, table), off, atol=1e-3
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_planted_leak_in_one_token_trips_the_bound(dtype):
    """A planted leak in one token of one microbatch trips the bound: a stream exactly in
    F + span(U) (8 sequences of 128 tokens, one token exactly at its anchor) reads below the
    tolerance; one token pushed off the subspace by 4x the tolerance (relative to that token's
    stream) reads above it, although the whole-microbatch ratio ||(I - UU^T) r|| / ||r|| that
    ``leak`` measured before stays below the tolerance: the other 1023 tokens dilute it."""
    basis, table = subspace.make_basis_and_table(0, 64, 4, 512)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 512, (8, 128), generator=gen)
    c = 3 * torch.randn(8, 128, 4, generator=gen)
    c[0, 0] = 0  # a token whose residual is zero: no 0/0
    exact = (table[ids] + c @ basis.T).to(dtype)
    bound = subspace.leak_tolerance(dtype)
    assert subspace.leak(exact, ids, basis, table) < bound

    off = torch.randn(64, generator=gen)
    off -= basis @ (basis.T @ off)  # orthogonal to span(U)
    planted = exact.float()
    planted[5, 77] += 4 * bound * planted[5, 77].norm() * off / off.norm()
    planted = planted.to(dtype)
    residual = planted.float() - table[ids]
    outside = residual - residual @ basis @ basis.T
    assert outside.norm() / residual.norm() < bound  # the whole microbatch: diluted
    assert subspace.leak(planted, ids, basis, table) > bound


def test_decode_refuses_an_id_outside_the_table():
    """An id outside [0, V) is one ``DataError`` line naming it and V, not a clamped row."""
    basis, table = subspace.make_basis_and_table(0, 64, 4, 100)
    c = torch.randn(1, 3, 4)
    for bad in (100, -1):
        ids = torch.tensor([[3, bad, 5]])
        with pytest.raises(DataError) as err:
            subspace.decode(c, ids, basis, table)
        assert str(err.value) == (f"token id {bad} is outside the token table F: ids must be in "
                                  "[0, model.vocab_size = 100)")  # fmt: skip


def test_stage_ranges_cover_all_layers():
    assert [list(r) for r in stage_layer_ranges(8, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [len(r) for r in stage_layer_ranges(4, 4)] == [1, 1, 1, 1]
    assert [list(r) for r in stage_layer_ranges(8, 3, [4, 3, 1])] == [
        [0, 1, 2, 3], [4, 5, 6], [7],
    ]  # fmt: skip


def test_explicit_split_reaches_the_constraint_and_the_pipeline_split():
    """``layers_per_stage`` decides both which blocks are constrained (all but the last
    stage's) and which blocks each stage runs."""
    protocol = ProtocolSettings(mode="subspace", k=4, seed=3, layers_per_stage=[3, 1])
    model = build_model_config(ARCH, protocol, 2).build()
    assert [block.factored for block in model.layers.values()] == [True, True, True, False]
    parts = [split_stage(model, s, 2) for s in range(2)]
    assert [list(part.layers) for part in parts] == [["0", "1", "2"], ["3"]]


@pytest.mark.parametrize("mode", ["subspace", "dense", "projected"])
def test_constraint_layout(mode):
    model = _model(mode, stages=2)
    for layer_id, block in model.layers.items():
        constrained = mode == "subspace" and int(layer_id) < 2
        assert block.upstream == (int(layer_id) < 2)
        assert block.factored == constrained
        width = 4 if constrained else ARCH.dim
        assert block.attention.wo.weight.shape[0] == width
        assert block.feed_forward.w2.weight.shape[0] == width
    assert model.tok_embeddings.weight.shape[1] == (4 if mode == "subspace" else ARCH.dim)
    assert model.lm_head.weight.shape == (ARCH.vocab_size, ARCH.dim)


@pytest.mark.parametrize(
    ("mode", "stages"),
    [("subspace", 2), ("subspace", 4), ("dense", 2), ("resbm", 2), ("resbm", 4),
     ("projected", 2), ("projected", 4), ("projected+tables", 4), ("dense+tables", 4)],  # fmt: skip
)
def test_chained_stages_equal_the_whole_model(mode, stages):
    """Forward through stages, passing only the wire tensor; backward with the wire gradient.
    Logits and every parameter gradient must match the unsplit model."""
    whole = _model(mode, stages)
    ids = _ids()
    whole(ids, token_ids=ids).logsumexp(-1).mean().backward()

    parts = [split_stage(whole, s, stages) for s in range(stages)]
    for p in parts:
        p.zero_grad()
        p.in_microbatch = True  # as the pipeline stage marks a step's microbatches
    wire_inputs, out = [], ids
    for s, part in enumerate(parts):
        if s > 0:
            out = out.detach().requires_grad_()
            wire_inputs.append(out)
        out = part(out, token_ids=ids)
        if s < stages - 1:
            assert out.shape == (2, 16, ARCH.dim if mode.startswith("dense") else 4)
    loss = out.logsumexp(-1).mean()
    # backward stage by stage, as the pipeline does: only the wire gradient crosses
    grad = torch.autograd.grad(loss, [wire_inputs[-1], *parts[-1].parameters()], allow_unused=True)
    for p, g in zip(parts[-1].parameters(), grad[1:], strict=True):
        p.grad = g
    wire_grad = grad[0]
    for s in range(stages - 2, -1, -1):
        assert wire_grad.shape == wire_inputs[s].shape  # the gradient is k-dim (h-dim) too
        outputs = parts[s](wire_inputs[s - 1] if s > 0 else ids, token_ids=ids)
        inputs = ([wire_inputs[s - 1]] if s > 0 else []) + list(parts[s].parameters())
        grads = torch.autograd.grad(outputs, inputs, grad_outputs=wire_grad, allow_unused=True)
        for p, g in zip(parts[s].parameters(), grads[1 if s > 0 else 0 :], strict=True):
            p.grad = g
        wire_grad = grads[0] if s > 0 else None

    whole_grads = dict(whole.named_parameters())
    for part in parts:
        for name, p in part.named_parameters():
            ref = whole_grads[name].grad
            assert torch.allclose(p.grad, ref, rtol=1e-4, atol=1e-6), name
    if mode == "subspace":
        assert all(
            part.pop_boundary_leak() < subspace.leak_tolerance(torch.float32) for part in parts[:-1]
        )


def test_projected_boundary_rebuilds_the_projection_of_the_stream():
    """``projected`` mode: the block after the boundary sees ``F + U U^T (x - F)`` of the stream
    ``x`` the block before it computed (full width: off span(U) too), from k coordinates."""
    model = _model("projected", stages=2)
    ids = _ids()
    seen = {}
    model.layers["2"].attention_norm.register_forward_pre_hook(
        lambda module, args: seen.setdefault("rebuilt", args[0])
    )
    model(ids, token_ids=ids)
    sender = model.layers["1"]
    sender.project_out = False  # the same forward, without the projection: the stream x
    x = model._stream_in(ids, ids)
    for layer in ("0", "1"):
        x = model.layers[layer](x, None, None, basis=model.basis, token_ids=ids,
                                table=model.token_table)  # fmt: skip
    u, anchor = model.basis, model.token_table[ids]
    expected = anchor + (x - anchor) @ u @ u.T
    assert torch.allclose(seen["rebuilt"], expected, atol=1e-5)
    assert subspace.leak(x, ids, u, model.token_table) > 0.5  # the writers leave span(U)
    assert subspace.leak(seen["rebuilt"], ids, u, model.token_table) < 1e-6


def test_bf16_wire_is_exact_up_to_one_bf16_rounding():
    """A bf16 stream (what a dense bf16 wire sends) crosses the subspace wire as bf16
    coordinates and is rebuilt within one bf16 unit roundoff of its norm, per token: the
    rounding a dense bf16 wire also has. Its leak is far above fp32's and within the bf16 bound."""
    basis, table = subspace.make_basis_and_table(0, 256, 8, 100)
    ids = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    c = 3 * torch.randn(2, 16, 8, generator=torch.Generator().manual_seed(1))
    x = (table[ids] + c @ basis.T).bfloat16()
    wire = subspace.encode(x, ids, basis, table)
    assert wire.dtype == torch.bfloat16 and wire.shape == (2, 16, 8)
    rebuilt = subspace.decode(wire, ids, basis, table)
    error = (rebuilt.float() - x.float()).norm(dim=-1) / x.float().norm(dim=-1)
    assert error.max() <= torch.finfo(torch.bfloat16).eps / 2
    assert subspace.leak_tolerance(torch.float32) < subspace.leak(x, ids, basis, table)
    assert subspace.leak(x, ids, basis, table) < subspace.leak_tolerance(torch.bfloat16)


def test_dense_twin_with_stage_tables_has_the_projected_models_parameters():
    """The fair twin of ``projected`` with stage tables: ``dense`` with the same tables holds the
    same parameters, name for name and shape for shape (the projection adds none), a zero
    ``[V, d]`` table on the first block of every stage but the first; without tables the
    dense model holds none."""
    shapes = {}
    for mode in ("projected+tables", "dense+tables"):
        model = build_model_config(ARCH, ProtocolSettings(
            mode=mode.removesuffix("+tables"), k=4, seed=3, stage_tables=True), 4).build()  # fmt: skip
        shapes[mode] = {n: tuple(p.shape) for n, p in model.named_parameters()}
    assert shapes["projected+tables"] == shapes["dense+tables"]
    tables = {n: s for n, s in shapes["dense+tables"].items() if "stage_table" in n}
    assert tables == {f"layers.{i}.stage_table.weight": (ARCH.vocab_size, ARCH.dim)
                      for i in (1, 2, 3)}  # fmt: skip
    plain = build_model_config(ARCH, ProtocolSettings(mode="dense", k=4, seed=3), 4).build()
    assert not [n for n, _ in plain.named_parameters() if "stage_table" in n]
