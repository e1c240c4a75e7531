"""MAPL's residual vector quantizer (``[protocol] rvq_stages``): packed indices on the wire, the
straight-through backward, EMA k-means codebooks kept identical on both sides, the config check.
In-process and fast; the pipelined run is ``test_exactness.py``'s MAPL test."""

from __future__ import annotations

import pytest
import torch
from conftest import PLAN_LAYOUT, TINY, config_error

from protocol_models.cluster import plan
from protocol_models.config.run_config import load_config
from protocol_models.model.mapl import MaplCodec
from protocol_models.model.model import ModelArch, build_model_config
from protocol_models.training.mapl_sync import BoundarySync
from protocol_models.training.protocol import ProtocolSettings
from protocol_models.training.stage_identity import protocol_identity
from protocol_models.wire import codec_for
from protocol_models.wire.codecs import apply_boundary, install_in_graph
from protocol_models.wire.rvq import ResidualVQ, quantize, reconstruct, residuals
from protocol_models.wire.sizes import message_bytes


def _codec(stages: int, codebook: int, rank: int = 4, decay: float = 0.99) -> MaplCodec:
    config = MaplCodec.Config(dim=16, rank=rank, vocab_size=11, anchor_rank=2, boundary=0,
                              seed=5, rvq_stages=stages, rvq_codebook=codebook,
                              rvq_decay=decay)  # fmt: skip
    codec = config.build()
    codec.init_states()
    return codec


class _Block(torch.nn.Module):
    def __init__(self, sender: MaplCodec, receiver: MaplCodec):
        super().__init__()
        self.mapl_out, self.mapl_in = sender, receiver


def _wire(stages: int, codebook: int, rank: int = 4) -> ResidualVQ:
    codec, copy = _codec(stages, codebook, rank), _codec(stages, codebook, rank)
    rvq = ResidualVQ(stages, codebook)
    rvq.attach(_Block(codec, None), _Block(None, copy))
    return rvq


def test_payload_is_the_packed_indices_and_decodes_to_the_greedy_reconstruction():
    """Forward: ``L log2 K / 8`` bytes per token of uint8 (the analytic size, also
    ``message_bytes``'), unpacking to the greedy codes; decode = ``sum_j C_j[i_j]``.
    Backward: the gradient as it is, r values per token in the wire dtype."""
    for stages, codebook in ((2, 16), (4, 4), (3, 256)):
        rvq = _wire(stages, codebook)
        c = torch.randn(2, 8, 4)
        payload = rvq.encode(c)
        assert [(tuple(t.shape), t.dtype) for t in payload] == rvq.spec(c.shape, c.dtype, "fwd")
        sent = sum(t.numel() * t.element_size() for t in payload)
        analytic = 2 * 8 * stages * {4: 2, 16: 4, 256: 8}[codebook] // 8
        assert sent == rvq.payload_bytes(c.shape, c.dtype, "fwd") == analytic
        assert message_bytes("mapl", (2, 8, 16), c.dtype, "fwd", k=4, codec=rvq) == analytic
        books = rvq.sender.codebooks
        codes = quantize(c, books)
        assert torch.equal(rvq.packer.unpack(payload[0]).long(), codes)
        assert torch.equal(rvq.decode(payload, c.shape), reconstruct(codes, books))
        assert rvq.payload_bytes(c.shape, torch.bfloat16, "bwd") == 2 * 8 * 4 * 2


def test_the_backward_is_straight_through():
    """In-graph (``apply_boundary``): the forward is the reconstruction, the gradient of ``c``
    is exactly the gradient of ``c_hat``."""
    rvq = _wire(2, 16)
    c = torch.randn(2, 8, 4, requires_grad=True)
    out = apply_boundary(c, rvq, microbatch=1)
    torch.testing.assert_close(
        out, reconstruct(quantize(c.detach(), rvq.sender.codebooks), rvq.sender.codebooks)
    )
    g = torch.randn_like(out)
    out.backward(g)
    assert torch.equal(c.grad, g)


def _fitted_error(stages: int, data: torch.Tensor, steps: int = 25) -> float:
    """Relative reconstruction error of ``data`` ``[T, r]`` after ``steps`` EMA k-means
    refreshes of an L-stage, 16-code quantizer."""
    codec = _codec(stages, 16, rank=data.shape[-1], decay=0.5)
    for _ in range(steps):
        codes = quantize(data, codec.codebooks)
        codec.observe(residuals(data, codes, codec.codebooks), codes)
        codec.refresh_codebooks()
    rebuilt = reconstruct(quantize(data, codec.codebooks), codec.codebooks)
    return ((rebuilt - data).norm() / data.norm()).item()


def test_reconstruction_error_falls_with_the_number_of_stages():
    data = torch.randn(2048, 4, generator=torch.Generator().manual_seed(0))
    errors = [_fitted_error(stages, data) for stages in (1, 2, 3, 4)]
    assert all(a > b for a, b in zip(errors, errors[1:], strict=False)), errors
    assert errors[0] < 0.8 and errors[-1] < errors[0] / 2


def test_ema_k_means_moves_a_code_to_the_mean_of_what_it_took():
    """decay 0: one refresh makes each used code the mean of the residuals assigned to it; the
    code usage perplexity counts the codes in use."""
    codec = _codec(1, 4, rank=2, decay=0.0)
    data = codec.codebooks[0, :2].repeat(3, 1) + 0.1 * torch.randn(6, 2)
    codes = quantize(data, codec.codebooks)
    codec.observe(residuals(data, codes, codec.codebooks), codes)
    codec.refresh_codebooks()
    for code in codes.unique():
        torch.testing.assert_close(codec.codebooks[0, code], data[codes[:, 0] == code].mean(0))
    assert codec.code_perplexity().item() == pytest.approx(len(codes.unique()), rel=0.2)


def test_in_graph_copies_decode_with_the_same_codebooks_every_step():
    """A 2-stage model with the quantizer in-graph: before each optimizer step ``BoundarySync``
    refreshes the sender's codebooks from the step's codes and copies them to the receiver's."""
    arch = ModelArch(dim=64, n_layers=4, n_heads=4, vocab_size=512)
    protocol = ProtocolSettings(mode="mapl", k=8, rvq_stages=2, rvq_codebook=16)
    model = build_model_config(arch, protocol, 2).build()
    model.init_weights()
    install_in_graph(model, ResidualVQ(2, 16), 2, 1)
    sender, receiver = model.layers["1"].mapl_out, model.layers["2"].mapl_in
    before = sender.codebooks.clone()
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    model(ids, token_ids=ids).float().logsumexp(-1).mean().backward()
    assert sender.hits.sum() == 2 * 16 * 2  # every token, both stages
    sync = BoundarySync([model])
    sync.sum_gradients()
    assert not torch.equal(sender.codebooks, before)
    assert torch.equal(sender.codebooks, receiver.codebooks)
    assert 1 <= sync.metrics()["mapl/code_perplexity/b0"] <= 16


def test_the_run_builds_the_quantizer_from_protocol_keys():
    rvq = ["--protocol.mode", "mapl", "--protocol.rvq_stages", "2", "--protocol.rvq_codebook", "16"]
    config = load_config(str(TINY), rvq, check_environment=False)
    assert isinstance(codec_for(config), ResidualVQ)
    plain = load_config(str(TINY), rvq[:2], check_environment=False)
    assert codec_for(plain) is None
    assert protocol_identity(config) != protocol_identity(plain)
    planned = load_config(None, [*PLAN_LAYOUT, *rvq], check_environment=False)
    # [2, 16] bf16 microbatches, r = 4: 2 x 4-bit indices forward, 4 bf16 values backward
    assert plan.message_bytes(planned) == (2 * 16 * 1, 2 * 16 * 4 * 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--protocol.rvq_stages", "2"], "protocol.rvq_stages = 2: needs protocol.mode = 'mapl'"),
        (["--protocol.mode", "mapl", "--protocol.rvq_stages", "2", "--protocol.rvq_codebook",
          "32"], "protocol.rvq_codebook = 32: expected one of [4, 16, 256]"),
        (["--protocol.mode", "mapl", "--protocol.rvq_stages", "3", "--protocol.rvq_codebook",
          "16"], "protocol.rvq_stages = 3: must be 0 or a positive multiple of 2"),
        (["--protocol.mode", "mapl", "--protocol.rvq_stages", "1", "--protocol.rvq_decay", "1"],
         "protocol.rvq_decay = 1.0: must be in [0, 1)"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(overrides, message):
    assert message in config_error(*overrides)


def test_only_training_forwards_feed_the_codebooks():
    rvq = _wire(2, 16)
    c = torch.randn(2, 8, 4)
    rvq.sender.eval()
    rvq.encode(c)
    assert rvq.sender.hits.sum() == 0
    rvq.sender.train()
    rvq.encode(c)
    assert rvq.sender.hits.sum() == 2 * 8 * 2
