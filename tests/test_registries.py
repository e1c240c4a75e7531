"""Extension points: a codec or an optimizer is one class plus one registry entry (a boundary
method one entry), and then the config check, the planner's byte and memory figures and the
recipes' tables know it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import TINY

from protocol_models.cluster import plan, planner
from protocol_models.config.run_config import load_config
from protocol_models.model.boundary import BOUNDARIES, BoundaryMethod
from protocol_models.model.model import ModelArch, build_model_config
from protocol_models.tools.errors import ConfigError, require
from protocol_models.training.optimizers import OPTIMIZERS, GuardedOptimizers, OptimizerEntry
from protocol_models.training.protocol import ProtocolSettings
from protocol_models.training.stage_identity import protocol_identity
from protocol_models.wire.codecs import CODECS, Codec, install_in_graph
from recipes import ablation
from recipes.common import arms


class Strided(Codec):
    """Toy codec: every ``rank``-th coordinate of each token, in the wire dtype."""

    name = "toy_strided"
    settings = ("rank",)

    def __init__(self, stride: int):
        self.stride = stride

    @classmethod
    def build(cls, settings, *, dim, protocol_seed):
        return cls(settings.rank)

    @classmethod
    def check(cls, settings, dim, microbatch_tokens):
        require(dim % settings.rank == 0, f"codec.rank = {settings.rank}: must divide {dim}")

    def encode(self, x):
        return [x[..., :: self.stride].contiguous()]

    def decode(self, payload, shape):
        x = payload[0].new_zeros(shape)
        x[..., :: self.stride] = payload[0]
        return x

    def encode_grad(self, g, fwd):
        return self.encode(g)

    def decode_grad(self, payload, fwd, shape):
        return self.decode(payload, shape)

    def spec(self, shape, dtype, direction):
        return [((*shape[:-1], shape[-1] // self.stride), dtype)]

    def payload_bytes(self, shape, dtype, direction):
        return math.prod(shape[:-1]) * shape[-1] // self.stride * dtype.itemsize


class SignSGD(torch.optim.Optimizer):
    """Toy optimizer: ``p <- p - lr sign(grad)``; no state."""

    def __init__(self, params, lr=1e-3, **_ignored):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


@pytest.fixture
def toy_codec(monkeypatch):
    monkeypatch.setitem(CODECS, Strided.name, Strided)  # the one registry entry


@pytest.fixture
def toy_optimizer(monkeypatch):
    entry = OptimizerEntry(factory=SignSGD, group="SignSGD", state_bytes=0)
    monkeypatch.setitem(OPTIMIZERS, "toy_signsgd", entry)  # the one registry entry


def tiny(*overrides: str):
    return load_config(str(TINY), list(overrides), check_environment=False)


def test_a_registered_codec_is_a_mode_everywhere(toy_codec):
    mode = ["--protocol.mode", "toy_strided", "--codec.rank", "4"]
    config = tiny(*mode)
    assert "codec toy_strided(rank=4)" in protocol_identity(config)
    with pytest.raises(ConfigError, match="codec.rank = 3: must divide 64"):
        tiny("--protocol.mode", "toy_strided", "--codec.rank", "3")
    with pytest.raises(ConfigError, match="toy_strided"):  # the allowed modes name it
        tiny("--protocol.mode", "nope")

    # the planner: one fp32 message [1, 64, 64] -> 64 x 16 values; 4x fewer bytes than dense
    assert plan.message_bytes(config) == (64 * 16 * 4, 64 * 16 * 4)
    assert plan.wire_plan(config)["ratio"] == 4
    # the recipes' byte table
    b = arms.wire_bytes(TINY, mode)
    assert b["dense"] / (b["fwd"] + b["bwd"]) == 4

    # in-graph in a single-process run of the 2-stage layout: the hook replaces block 1's output
    protocol = ProtocolSettings(mode="toy_strided")
    model = build_model_config(ModelArch(dim=64, n_layers=4, n_heads=4), protocol, 2).build()
    model.init_states()
    ids = torch.randint(0, 8192, (2, 8))
    clean = model(ids)
    assert install_in_graph(model, Strided(4), n_stages=2, microbatch=1) == [1]
    assert not torch.equal(model(ids), clean)


def test_a_registered_boundary_method_is_a_mode_everywhere(monkeypatch):
    """One ``BoundaryMethod`` entry: the config check, the start-up identity, the wire's size
    model, the planner's added weights and the recipes' byte table know it (its model is
    ``build_model_config``'s business: unknown there, it builds the dense model)."""
    toy = BoundaryMethod(width=lambda dim, k: dim // 2, width_key="w",
                         receiver_weights=lambda dim, protocol: [(dim, 3)])  # fmt: skip
    monkeypatch.setitem(BOUNDARIES, "toy_half", toy)  # the one registry entry
    mode = ["--protocol.mode", "toy_half"]
    config = tiny(*mode)
    assert "mode=toy_half" in protocol_identity(config)
    with pytest.raises(ConfigError, match="toy_half"):  # the allowed modes name it
        tiny("--protocol.mode", "nope")
    assert plan.message_bytes(config) == (64 * 32 * 4, 64 * 32 * 4)  # [1, 64, 32] fp32
    assert [plan.boundary_weights(config, s) for s in (0, 1)] == [0, 64 * 3]
    assert planner.mode_label(config) == "toy_half w=4"
    b = arms.wire_bytes(TINY, mode)
    assert b["dense"] / (b["fwd"] + b["bwd"]) == 2


def test_a_registered_optimizer_is_an_optimizer_everywhere(toy_optimizer):
    config = tiny("--optimizer.name", "toy_signsgd")
    assert [g.optimizer_name for g in config.optimizer.param_groups] == ["SignSGD"]
    with pytest.raises(ConfigError, match="toy_signsgd"):  # the allowed names name it
        tiny("--optimizer.name", "nope")

    model = build_model_config(config.model, config.protocol, 2).build()
    container = GuardedOptimizers(config.optimizer, model_parts=[model])
    assert [type(o) for o in container.optimizers] == [SignSGD]

    # the planner's memory: fp32 weights and grads, no optimizer state
    memory = plan.plan_stages(config)[0].memory
    assert "state 8P/D" in memory and "state 16P/D" not in memory

    # the optimizer study's jobs and table
    assert ("subspace", "toy_signsgd", True, 0) in ablation.first_jobs()
    assert ("dense", "toy_signsgd", False, 0) in ablation.first_jobs()
    curve = [[50, 6.0], [100, 5.0]]
    run = {"final_val_loss": 5.5, "val_curve": curve}
    results = {
        "update_every": 40,
        "update_angle_deg": 5.0,
        "runs": {
            ablation.run_name("subspace", "toy_signsgd", False, 0): run,
            ablation.run_name("subspace", "toy_signsgd", True, 0): run,
            ablation.run_name("dense", "toy_signsgd", False, 0): {"final_val_loss": 5.0,
                                                                  "val_curve": curve},
        },
    }  # fmt: skip
    assert "| toy_signsgd | fixed | 5.500 | dense toy_signsgd | 5.000 | +10.0% | 75 of 300" in (
        ablation.render_table(results)
    )
