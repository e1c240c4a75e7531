"""MAPL (``[protocol] mode = "mapl"``): the r-wide coordinates on the wire, the codec's gradients,
the Stiefel optimizer, the copies' gradient sum, the config check and the planner's figures.
In-process and fast; the pipelined run is in ``test_exactness.py``."""

from __future__ import annotations

import pytest
import torch
from conftest import PLAN_LAYOUT, TINY, config_error
from torch.func import functional_call

from protocol_models.cluster import plan, planner
from protocol_models.config.run_config import load_config
from protocol_models.model.mapl import MaplCodec, orthonormality_error, tangent
from protocol_models.model.model import ModelArch, build_model_config
from protocol_models.training.mapl_sync import BoundarySync
from protocol_models.training.optimizers import GuardedOptimizers, StiefelMuon
from protocol_models.training.protocol import ProtocolSettings
from protocol_models.training.stage_identity import protocol_identity
from protocol_models.wire.meter import WireMeter
from protocol_models.wire.pipeline import split_stage
from protocol_models.wire.sizes import message_bytes

ARCH = ModelArch(dim=64, n_layers=4, n_heads=4, vocab_size=512)


def _model(arch: ModelArch, r: int, stages: int, layers_per_stage=None, anchor_rank: int = 8):
    protocol = ProtocolSettings(
        mode="mapl", k=r, anchor_rank=anchor_rank, layers_per_stage=layers_per_stage
    )
    model = build_model_config(arch, protocol, stages).build()
    torch.manual_seed(0)
    model.init_weights()
    return model


def _codec(dim=16, rank=3, vocab=11, anchor_rank=2, seed=5) -> MaplCodec:
    config = MaplCodec.Config(dim=dim, rank=rank, vocab_size=vocab, anchor_rank=anchor_rank,
                              boundary=0, seed=seed)  # fmt: skip
    codec = config.build()
    codec.init_states()
    return codec


def test_both_sides_of_a_boundary_hold_identical_copies():
    """3 stages of [2, 1, 1] blocks: block 1 encodes for boundary 0, block 2 decodes it and
    encodes boundary 1, block 3 decodes; each pair starts bit-identical, U orthonormal."""
    model = _model(ARCH, 8, 3, [2, 1, 1])
    pairs = {0: ("1", "2"), 1: ("2", "3")}
    for boundary, (sender, receiver) in pairs.items():
        out, into = model.layers[sender].mapl_out, model.layers[receiver].mapl_in
        assert out.boundary == into.boundary == boundary
        for a, b in zip(out.parameters(), into.parameters(), strict=True):
            assert torch.equal(a, b)
        assert tuple(out.projection.shape) == (64, 8)
        assert tuple(out.anchor_tokens.shape) == (512, 8) and tuple(out.anchor_mix.shape) == (8, 64)
        assert orthonormality_error(out.projection) < 1e-5
    assert not torch.equal(
        model.layers["1"].mapl_out.projection, model.layers["2"].mapl_out.projection
    )
    assert build_model_config(ARCH, ProtocolSettings(mode="mapl", k=8), 1).mode == "dense"


def test_the_stage_output_is_r_coordinates_and_the_wire_carries_their_bytes():
    """Every non-last stage returns ``c`` ``[mb, seq, r]``; the meter counts the analytic
    ``mb seq r itemsize`` each way; the chained stages compute the whole (in-graph) model."""
    r, stages = 8, 3
    model = _model(ARCH, r, stages, [2, 1, 1])
    ids = torch.randint(0, ARCH.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    meter, out = WireMeter(dim=ARCH.dim), ids
    for s in range(stages):
        out = split_stage(model, s, stages)(out, token_ids=ids)
        if s < stages - 1:
            assert out.shape == (2, 16, r)
            meter.record("fwd", s, [out])
    analytic = 2 * 16 * r * 4
    for direction in ("fwd", "bwd"):
        assert message_bytes("mapl", (2, 16, 64), torch.float32, direction, k=r) == analytic
    assert dict(meter.fwd) == {0: analytic, 1: analytic}
    torch.testing.assert_close(out, model(ids, token_ids=ids), rtol=0, atol=0)


@torch.no_grad()
def test_decode_of_encode_keeps_the_span_of_u_around_the_anchor():
    """``x_hat = a + (x - a) U U^T``: exact for ``x - a`` in span(U), and the dropped part is
    orthogonal to span(U)."""
    codec = _codec()
    ids = torch.tensor([[0, 3, 10, 3]])
    u, a = codec.projection, codec.anchor(ids)
    inside = a + torch.randn(1, 4, 3) @ u.T
    torch.testing.assert_close(codec.decode(codec.encode(inside, ids), ids), inside)
    x = torch.randn(1, 4, 16)
    dropped = x - codec.decode(codec.encode(x, ids), ids)
    assert (dropped @ u).abs().max() < 1e-5


class _Boundary(torch.nn.Module):
    """A sender's and a receiver's copy: ``decode(encode(x))``."""

    def __init__(self, sender: MaplCodec, receiver: MaplCodec):
        super().__init__()
        self.sender, self.receiver = sender, receiver

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return self.receiver.decode(self.sender.encode(x, ids), ids)


NAMES = ("projection", "anchor_tokens", "anchor_mix")


def test_round_trip_gradients_match_finite_differences_and_sum_over_the_copies():
    """float64 autograd of ``decode(encode(x))`` against central differences with respect to
    ``x`` and the boundary's U, P, Q (the same tensors on both sides); and that gradient is the
    sum of what the two copies get separately, which is what ``BoundarySync`` gives each."""
    boundary = _Boundary(_codec().double(), _codec().double())
    ids = torch.tensor([[1, 4, 4, 9]])
    shared = [p.detach().clone().requires_grad_() for p in boundary.sender.parameters()]
    x = torch.randn(1, 4, 16, dtype=torch.float64, requires_grad=True)

    def tied(x, *weights):
        mapping = {f"{side}.{n}": w for side in ("sender", "receiver")
                   for n, w in zip(NAMES, weights, strict=True)}  # fmt: skip
        return functional_call(boundary, mapping, (x, ids))

    assert torch.autograd.gradcheck(tied, (x, *shared), eps=1e-6, atol=1e-7, rtol=1e-5)

    weight = torch.randn(1, 4, 16, dtype=torch.float64)
    grads = torch.autograd.grad((tied(x, *shared) * weight).sum(), shared)
    (boundary(x.detach(), ids) * weight).sum().backward()
    BoundarySync([_Layers(boundary)]).sum_gradients()
    for g, sender, receiver in zip(
        grads, boundary.sender.parameters(), boundary.receiver.parameters(), strict=True
    ):
        torch.testing.assert_close(sender.grad, g.float().double(), rtol=1e-6, atol=1e-6)
        assert torch.equal(sender.grad, receiver.grad)


class _Layers(torch.nn.Module):
    """What ``BoundarySync`` reads: ``layers`` whose blocks hold ``mapl_out``/``mapl_in``."""

    def __init__(self, boundary: _Boundary):
        super().__init__()
        blocks = [torch.nn.Module(), torch.nn.Module()]
        blocks[0].mapl_out, blocks[1].mapl_in = boundary.sender, boundary.receiver
        self.layers = torch.nn.ModuleDict({"0": blocks[0], "1": blocks[1]})


def test_stiefel_muon_keeps_u_orthonormal_and_descends():
    """100 StiefelMuon steps on ``||X - X U U^T||^2`` (the variance U fails to capture):
    ``||U^T U - I||_F`` stays below 1e-5 at every step and the loss falls to near the best
    rank-r value (the trailing eigenvalues of ``X^T X``)."""
    torch.manual_seed(0)
    x = torch.randn(256, 32) * torch.linspace(3.0, 0.1, 32)
    codec = _codec(dim=32, rank=4)
    u = codec.projection
    optimizer = StiefelMuon([u], lr=0.05, momentum=0.9)

    def loss() -> torch.Tensor:
        return (x - x @ u @ u.T).square().sum()

    first = loss().item()
    for _ in range(100):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
        assert orthonormality_error(u) < 1e-5
    best = torch.linalg.eigvalsh(x.T @ x)[:-4].sum().item()
    assert loss().item() < best + 0.02 * (first - best)


def test_the_step_direction_is_tangent():
    u = _codec(dim=20, rank=5).projection.detach()
    xi = tangent(u, torch.randn(20, 5))
    sym = u.T @ xi + xi.T @ u  # the tangent space at U: U^T xi skew-symmetric
    assert sym.abs().max() < 1e-5


def test_projections_get_stiefel_muon_and_anchors_the_main_optimizer():
    config = load_config(str(TINY), ["--protocol.mode", "mapl", "--optimizer.name", "muon",
                                     "--protocol.stages", "2"], check_environment=False)  # fmt: skip
    model = build_model_config(config.model, config.protocol, 2).build()
    container = GuardedOptimizers(config.optimizer, model_parts=[model])
    kinds = {
        name: type(opt).__name__
        for opt in container.optimizers
        for group in opt.param_groups
        for name in group["param_names"]
        if "mapl" in name
    }
    assert kinds == {
        f"layers.{layer}.mapl_{side}.{n}": "StiefelMuon" if n == "projection" else "AdamW"
        for layer, side in ((1, "out"), (2, "in"))
        for n in NAMES
    }
    dense = load_config(str(TINY), ["--protocol.mode", "mapl", "--protocol.stages", "1",
                                    "--parallelism.pipeline_parallel_degree", "1"],
                        check_environment=False)  # fmt: skip
    assert all(g.optimizer_name != "StiefelMuon" for g in dense.optimizer.param_groups)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--protocol.anchor_rank", "0"], "protocol.anchor_rank = 0: must be >= 1"),
        (["--protocol.projection_lr", "0"], "protocol.projection_lr = 0.0: must be > 0"),
        (["--protocol.k", "65"], "protocol.k = 65: must be an integer in [1, model.dim = 64]"),
        (["--codec.bits", "4"], "codec.bits = 4: protocol.mode = 'mapl' does not read it"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    assert message in config_error("--protocol.mode", "mapl", *overrides)


def test_stages_with_another_anchor_rank_disagree_at_start_up():
    configs = [
        load_config(str(TINY), ["--protocol.mode", "mapl", "--protocol.anchor_rank", str(m)],
                    check_environment=False)
        for m in (4, 8)
    ]  # fmt: skip
    identities = [protocol_identity(c) for c in configs]
    assert "mode=mapl" in identities[0] and identities[0] != identities[1]


def test_planner_counts_each_sides_copy_and_the_r_wide_message():
    """Against the dense twin: each boundary side adds U (64 x 4) and Q (8 x 64) as matmul
    weights (``6 W`` FLOPs per token) and P (512 x 8) as a table (parameters only), equal to the
    model's; a message is ``mb seq r`` bf16 values."""
    mapl = load_config(None, [*PLAN_LAYOUT, "--protocol.mode", "mapl"], check_environment=False)
    dense = load_config(None, [*PLAN_LAYOUT, "--protocol.mode", "dense"], check_environment=False)
    sides = [1, 2, 1]
    side_matmul, side_table = 64 * 4 + 8 * 64, 512 * 8
    model = build_model_config(mapl.model, mapl.protocol, 3).build()
    plans, twins = plan.plan_stages(mapl), plan.plan_stages(dense)
    for s, (p, t) in enumerate(zip(plans, twins, strict=True)):
        added = sides[s] * (side_matmul + side_table)
        assert p.params == t.params + added
        assert p.fwd_flops - t.fwd_flops == 2 * sides[s] * side_matmul * 32
        stage = split_stage(model, s, 3)
        assert p.params == sum(q.numel() for q in stage.parameters())
    assert plan.message_bytes(mapl) == (2 * 16 * 4 * 2, 2 * 16 * 4 * 2)
    assert plan.wire_plan(mapl)["ratio"] == 64 / 4
    assert planner.mode_label(mapl) == "mapl r=4" and plan.twin(mapl).protocol.mode == "dense"
