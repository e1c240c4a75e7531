"""ResBM (``[protocol] mode = "resbm"``): the bottleneck on the wire, its gradients, the identity
path, the config check and the planner's figures. In-process and fast; the pipelined run is in
``test_exactness.py``."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import PLAN_LAYOUT, TINY, config_error
from torch.func import functional_call

from protocol_models.cluster import plan, planner
from protocol_models.config.run_config import load_config
from protocol_models.model.model import ModelArch, build_model_config
from protocol_models.training.optimizers import BLOCK_MATRICES
from protocol_models.training.protocol import ProtocolSettings
from protocol_models.training.stage_identity import protocol_identity
from protocol_models.wire.meter import WireMeter
from protocol_models.wire.pipeline import split_stage
from protocol_models.wire.sizes import message_bytes

ARCH = ModelArch(dim=64, n_layers=4, n_heads=4, vocab_size=512)


def _model(arch: ModelArch, h: int, stages: int, layers_per_stage=None):
    protocol = ProtocolSettings(mode="resbm", k=h, layers_per_stage=layers_per_stage)
    model = build_model_config(arch, protocol, stages).build()
    torch.manual_seed(0)
    model.init_weights()
    return model


def test_boundary_blocks_hold_the_encoder_and_decoder():
    """3 stages of [2, 1, 1] blocks: block 1 encodes, block 2 (alone on the middle stage)
    decodes and encodes, block 3 decodes; the rest are stock blocks. Muon trains them all."""
    model = _model(ARCH, 8, 3, [2, 1, 1])
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if "coder" in n}
    assert shapes == {
        "layers.1.encoder.weight": (8, 64),
        "layers.2.decoder.weight": (64, 8),
        "layers.2.encoder.weight": (8, 64),
        "layers.3.decoder.weight": (64, 8),
    }
    assert all(re.match(BLOCK_MATRICES, name) for name in shapes)
    assert model.config.mode == "resbm"
    assert build_model_config(ARCH, ProtocolSettings(mode="resbm", k=8), 1).mode == "dense"


def test_the_stage_output_is_the_bottleneck_and_the_wire_carries_its_bytes():
    """Every non-last stage returns ``b`` ``[mb, seq, h]``; what the meter counts is the analytic
    ``mb seq h itemsize`` each way, the dense reference ``mb seq d itemsize``; the chained stages
    compute the whole model."""
    h, stages = 8, 3
    model = _model(ARCH, h, stages, [2, 1, 1])
    ids = torch.randint(0, ARCH.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    meter, out = WireMeter(dim=ARCH.dim), ids
    for s in range(stages):
        out = split_stage(model, s, stages)(out, token_ids=ids)
        if s < stages - 1:
            assert out.shape == (2, 16, h) and out.is_contiguous()
            meter.record("fwd", s, [out])
    analytic = 2 * 16 * h * 4
    assert message_bytes("resbm", (2, 16, ARCH.dim), torch.float32, "fwd", k=h) == analytic
    assert message_bytes("resbm", (2, 16, ARCH.dim), torch.float32, "bwd", k=h) == analytic
    assert dict(meter.fwd) == {0: analytic, 1: analytic}
    assert dict(meter.dense) == {0: 2 * 16 * 64 * 4, 1: 2 * 16 * 64 * 4}
    torch.testing.assert_close(out, model(ids, token_ids=ids), rtol=0, atol=0)


def test_encoder_and_decoder_gradients_match_finite_differences(monkeypatch):
    """float64 autograd of a block that decodes and encodes (a one-block middle stage) against
    central differences, with respect to its input ``b``, its encoder and its decoder. (TorchTitan's
    RoPE rotates in fp32 whatever the input dtype, so it is the identity here.)"""
    arch = ModelArch(dim=16, n_layers=3, n_heads=2, vocab_size=32, ffn_hidden_dim=24)
    block = _model(arch, 3, 3).layers["1"]
    for p in block.parameters():
        p.data = p.data.double()
    monkeypatch.setattr(type(block.attention.rope), "forward", lambda self, q, k, pos: (q, k))
    b = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    names = ("encoder.weight", "decoder.weight")
    trained = (block.encoder.weight, block.decoder.weight)  # moved away from their small init
    weights = [(w.detach() + 0.3 * torch.randn_like(w)).requires_grad_() for w in trained]

    def forward(b, encoder, decoder):
        return functional_call(block, dict(zip(names, (encoder, decoder), strict=True)), (b, None))

    assert forward(b, *weights).shape == (2, 5, 3)
    assert torch.autograd.gradcheck(forward, (b, *weights), eps=1e-6, atol=1e-7, rtol=1e-5)


@torch.no_grad()
def test_identity_path_passes_the_first_h_coordinates_exactly():
    """Encoder zeroed: the sender sends exactly the first h coordinates of its stream after
    attention. Decoder (and the receiver's MLP output) zeroed: the receiver's attention branch
    adds nothing, so its output is ``b`` in the first h coordinates and zeros after them."""
    h = 8
    model = _model(ARCH, h, 2)
    sender, receiver = model.layers["1"], model.layers["2"]
    sender.encoder.weight.zero_()
    x = torch.randn(2, 16, ARCH.dim)
    stream = x + sender.attention(sender.attention_norm(x), None, None)
    b = sender(x, None)
    assert torch.equal(b, stream[..., :h])

    receiver.decoder.weight.zero_()
    receiver.feed_forward.w2.weight.zero_()
    out = receiver(b, None)
    assert torch.equal(out[..., :h], b)
    assert not out[..., h:].any()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--protocol.k", "65"], "protocol.k = 65: must be an integer in [1, model.dim = 64]"),
        (["--protocol.k", "0"], "protocol.k = 0: must be >= 1"),
        (["--codec.bits", "4"], "codec.bits = 4: protocol.mode = 'resbm' does not read it"),
        (["--protocol.update_every", "5"], "subspace updates need protocol.mode = 'subspace'"),
    ],
)
def test_config_errors_name_the_key(overrides, message):
    assert message in config_error("--protocol.mode", "resbm", *overrides)


def test_stages_with_another_bottleneck_width_disagree_at_start_up():
    configs = [
        load_config(str(TINY), ["--protocol.mode", "resbm", "--protocol.k", str(h)],
                    check_environment=False)
        for h in (4, 8)
    ]  # fmt: skip
    identities = [protocol_identity(c) for c in configs]
    assert "mode=resbm" in identities[0] and identities[0] != identities[1]


def test_planner_counts_the_encoder_decoder_and_the_h_wide_message():
    """Against the dense twin on the same layout: the encoder (64 x 4) on stages 0 and 1 and the
    decoder (4 x 64) on stages 1 and 2 add parameters (equal to the meta-device model's) and
    ``6 W`` FLOPs per token; a non-last stage keeps an h-wide output instead of a d-wide one; a
    message is ``mb seq h`` bf16 values."""
    resbm = load_config(None, [*PLAN_LAYOUT, "--protocol.mode", "resbm"], check_environment=False)
    dense = load_config(None, [*PLAN_LAYOUT, "--protocol.mode", "dense"], check_environment=False)
    added = [256, 512, 256]
    plans, twins = plan.plan_stages(resbm), plan.plan_stages(dense)
    tokens, in_flight = 32, 4
    for s, (p, t) in enumerate(zip(plans, twins, strict=True)):
        assert p.params == plan.stage_params(resbm, s, len(p.layers)) == t.params + added[s]
        assert p.fwd_flops - t.fwd_flops == 2 * added[s] * tokens
        assert p.bwd_flops - t.bwd_flops == 4 * added[s] * tokens
        kept = p.memory["activations"] - t.memory["activations"]
        assert kept == (in_flight * tokens * 2 * (4 - 64) if s < 2 else 0)
    assert plan.message_bytes(resbm) == (2 * 16 * 4 * 2, 2 * 16 * 4 * 2)
    assert plan.wire_plan(resbm)["ratio"] == 64 / 4
    assert planner.mode_label(resbm) == "resbm h=4" and plan.twin(resbm).protocol.mode == "dense"
