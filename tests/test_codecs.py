"""Lossy boundary codecs: bytes on the wire, gradients, error bounds, and the two code paths.

Unit tests run in-process on ``[mb, seq, d]`` tensors; the last test trains the same codec once
pipelined (transport hook, 2 processes) and once in one process (in-graph, ``protocol.stages 2``)
from one seed checkpoint and compares the runs step by step.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY, torchrun

from protocol_models.config.run_config import ConfigError, load_config
from protocol_models.model import subspace
from protocol_models.training.stage_identity import protocol_identity
from protocol_models.wire import codec_for
from protocol_models.wire.codecs import CodecSettings, apply_boundary, build_codec
from protocol_models.wire.sizes import message_bytes

SHAPE = torch.Size([2, 16, 64])  # mb, seq, d
TOKENS, D = 32, 64

# (mode, settings, analytic forward bytes, analytic backward bytes) for an fp32 [2, 16, 64] tensor,
# written from the codecs' definitions in results/README.md (values + int16 indices, bit-packed
# codes + one bf16 scale per token, x P, both SVD factors), independently of their payload_bytes.
CASES = [
    ("topk", CodecSettings(topk=5), TOKENS * 5 * (4 + 2), TOKENS * 5 * (4 + 2)),
    ("topk", CodecSettings(topk=5, topk_backward="straight_through"),
     TOKENS * 5 * (4 + 2), TOKENS * 5 * 4),
    ("quant", CodecSettings(bits=8), TOKENS * (64 + 2), TOKENS * (64 + 2)),
    ("quant", CodecSettings(bits=4), TOKENS * (32 + 2), TOKENS * (32 + 2)),
    ("quant", CodecSettings(bits=2), TOKENS * (16 + 2), TOKENS * (16 + 2)),
    ("lowrank", CodecSettings(rank=8), TOKENS * 8 * 4, TOKENS * 8 * 4),
    ("svd", CodecSettings(rank=3), 3 * (TOKENS + D) * 4, 3 * TOKENS * 4),
]  # fmt: skip
IDS = [f"{m}-{s.topk_backward if m == 'topk' else s.bits if m == 'quant' else s.rank}"
       for m, s, _, _ in CASES]  # fmt: skip


def _codec(mode: str, settings: CodecSettings):
    return build_codec(mode, settings, D, protocol_seed=3)


def _nbytes(payload) -> int:
    return sum(t.numel() * t.element_size() for t in payload)


@pytest.mark.parametrize(("mode", "settings", "fwd_bytes", "bwd_bytes"), CASES, ids=IDS)
def test_payload_bytes_equal_analytic_size(mode, settings, fwd_bytes, bwd_bytes):
    codec = _codec(mode, settings)
    x, g = torch.randn(SHAPE), torch.randn(SHAPE)
    fwd = codec.encode(x)
    bwd = codec.encode_grad(g, fwd)
    assert _nbytes(fwd) == codec.payload_bytes(SHAPE, torch.float32, "fwd") == fwd_bytes
    assert _nbytes(bwd) == codec.payload_bytes(SHAPE, torch.float32, "bwd") == bwd_bytes
    # what a receiver allocates is exactly what is sent
    for payload, direction in ((fwd, "fwd"), (bwd, "bwd")):
        spec = codec.spec(SHAPE, torch.float32, direction)
        assert [(tuple(t.shape), t.dtype) for t in payload] == [(tuple(s), d) for s, d in spec]
    assert codec.decode(fwd, SHAPE).shape == SHAPE
    assert codec.decode_grad(bwd, fwd, SHAPE).shape == SHAPE


@pytest.mark.parametrize(("mode", "settings", "fwd_bytes", "bwd_bytes"), CASES, ids=IDS)
def test_gradient_payload_matches_forward_payload(mode, settings, fwd_bytes, bwd_bytes):
    """The gradient travels in the forward payload's shapes and dtypes; straight-through TopK
    and SVD send only the forward's first tensor's shape (the indices / R are reused)."""
    codec = _codec(mode, settings)
    fwd = codec.encode(torch.randn(SHAPE))
    bwd = codec.encode_grad(torch.randn(SHAPE), fwd)
    reused = mode == "svd" or settings.topk_backward == "straight_through" and mode == "topk"
    expected = fwd[:1] if reused else fwd
    assert [(t.shape, t.dtype) for t in bwd] == [(t.shape, t.dtype) for t in expected]


def test_quant_is_bit_packed():
    codec = _codec("quant", CodecSettings(bits=2))
    packed, scale = codec.encode(torch.randn(SHAPE))
    assert packed.dtype == torch.uint8 and packed.shape[-1] == D // 4
    codes = torch.randint(0, 4, (5, D), dtype=torch.uint8)
    assert torch.equal(codec.unpack(codec.pack(codes)), codes)


def _step(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The grid step of a token whose scale is its absmax rounded up to bf16 (< 2^-7 above)."""
    return 2 * x.abs().amax(-1, keepdim=True) * (1 + 2**-7) / (2**bits - 1)


def test_quant_scale_is_the_absmax_rounded_up_to_bf16():
    x = torch.randn(SHAPE) * torch.logspace(-30, 30, SHAPE[1]).view(1, -1, 1)
    _, scale = _codec("quant", CodecSettings(bits=4)).encode(x)
    absmax = x.abs().amax(-1, keepdim=True)
    assert scale.dtype == torch.bfloat16
    assert (scale.float() >= absmax).all() and (scale.float() < absmax * (1 + 2**-7)).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quant_round_to_nearest_within_half_a_step(bits):
    codec = _codec("quant", CodecSettings(bits=bits))
    x = torch.randn(SHAPE) * torch.rand(*SHAPE[:-1], 1) * 10
    x_hat = codec.decode(codec.encode(x), SHAPE)
    assert ((x_hat - x).abs() <= _step(x, bits) / 2).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_gradient_stochastic_rounding_is_unbiased_and_within_one_step(bits):
    codec = _codec("quant", CodecSettings(bits=bits))
    g = torch.randn(1, 4, 64)
    step = _step(g, bits)
    samples = torch.stack([codec.decode_grad(codec.encode_grad(g, []), [], g.shape)
                           for _ in range(2000)])  # fmt: skip
    assert ((samples - g).abs() < step).all()
    # bias of the mean of 2000 draws: std <= step / 2 / sqrt(2000) ~ 0.011 step
    assert ((samples.mean(0) - g).abs() < 0.06 * step).all()
    nearest = codec.decode(codec.encode(g), g.shape)
    assert (samples != nearest).any(), "gradients must not be rounded to nearest"


@pytest.mark.parametrize(("k", "bits"), [(4, 2), (8, 4), (40, 4), (6, 8)])
def test_quantized_coordinates_bytes_bounds_and_unbiased_gradients(k, bits):
    """``subspace`` + ``[codec] bits``: k coordinates per token bit-packed plus one scale; the
    forward rounds to nearest, the gradient stochastically and without bias."""
    codec = build_codec("subspace", CodecSettings(bits=bits), D, protocol_seed=3)
    shape = torch.Size([2, 16, k])
    c = torch.randn(shape) * torch.rand(2, 16, 1) * 10
    payload = codec.encode(c)
    analytic = TOKENS * (k * bits // 8 + 2)
    assert (
        _nbytes(payload)
        == analytic
        == message_bytes("subspace", SHAPE, torch.float32, "fwd", k=k, codec=codec)
    )
    assert ((codec.decode(payload, shape) - c).abs() <= _step(c, bits) / 2).all()
    g = torch.randn(1, 4, k)
    g_step = _step(g, bits)
    draws = torch.stack([codec.decode_grad(codec.encode_grad(g, []), [], g.shape)
                         for _ in range(2000)])  # fmt: skip
    assert ((draws - g).abs() < g_step).all()
    assert ((draws.mean(0) - g).abs() < 0.06 * g_step).all()


def test_without_bits_the_subspace_wire_is_exact():
    assert build_codec("subspace", CodecSettings(), D, protocol_seed=3) is None
    assert message_bytes("subspace", SHAPE, torch.float32, "bwd", k=8) == TOKENS * 8 * 4


def test_straight_through_topk_gradient_uses_the_forward_mask():
    x = torch.randn(SHAPE, requires_grad=True)
    g = torch.randn(SHAPE)
    mask = torch.zeros(SHAPE, dtype=torch.bool).scatter(-1, x.abs().topk(5, -1).indices, True)
    st = _codec("topk", CodecSettings(topk=5, topk_backward="straight_through"))
    apply_boundary(x, st).backward(g)
    assert torch.equal(x.grad, torch.where(mask, g, 0.0))
    # the ``topk`` variant keeps the gradient's own top 5 instead
    x.grad = None
    apply_boundary(x, _codec("topk", CodecSettings(topk=5))).backward(g)
    g_mask = torch.zeros(SHAPE, dtype=torch.bool).scatter(-1, g.abs().topk(5, -1).indices, True)
    assert torch.equal(x.grad, torch.where(g_mask, g, 0.0))
    assert not torch.equal(mask, g_mask)


@pytest.mark.parametrize("mode", ["lowrank", "svd"])
def test_projection_backward_is_the_gradient_of_the_lossy_map(mode):
    """lowrank: d/dx of ``x P P^T`` is ``g P P^T``; svd: with ``R`` held fixed, ``g R R^T``."""
    codec = _codec(mode, CodecSettings(rank=4))
    x = torch.randn(SHAPE, requires_grad=True)
    g = torch.randn(SHAPE)
    y = apply_boundary(x, codec)
    y.backward(g)
    if mode == "lowrank":
        p = codec.projection
    else:
        p = codec.encode(x.detach())[1]
    assert torch.allclose(y, x.detach() @ p @ p.T, atol=1e-5)
    assert torch.allclose(x.grad, g @ p @ p.T, atol=1e-5)


def test_subspace_codec_is_exact_and_lowrank_is_not():
    """A stream in F[ids] + span(U) survives the subspace codec to fp32 rounding; the naive
    projection on the same U (no F, no constraint) loses most of it."""
    u, table = subspace.make_basis_and_table(3, D, 8, 100)
    ids = torch.randint(0, 100, SHAPE[:-1])
    x = table[ids] + torch.randn(*SHAPE[:-1], 8) @ u.T
    exact = subspace.decode(subspace.encode(x, ids, u, table), ids, u, table)
    assert ((exact - x).norm() / x.norm()) < 1e-6
    lowrank = _codec("lowrank", CodecSettings(rank=8))
    assert torch.equal(lowrank.projection, u)  # P is the subspace basis of protocol.seed
    naive = lowrank.decode(lowrank.encode(x), SHAPE)
    assert ((naive - x).norm() / x.norm()) > 0.5


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--protocol.mode", "quant", "--codec.bits", "3"], "codec.bits = 3: expected one of"),
        (["--protocol.mode", "topk", "--codec.topk", "0"], "codec.topk = 0: must be >= 1"),
        (["--protocol.mode", "svd", "--codec.rank", "65"], "codec.rank = 65: must be"),
        (["--protocol.mode", "svd", "--codec.rank", "64", "--training.seq_len", "32"],
         "must be <= the 32 tokens of a microbatch"),
        (["--codec.topk_backward", "mask"], "codec.topk_backward = 'mask': expected one of"),
        (["--protocol.mode", "sparse"], "protocol.mode = 'sparse': expected one of"),
        (["--codec.width", "3"], "unknown key 'codec.width'"),
        (["--protocol.k", "3", "--codec.bits", "4"],
         "codec.bits = 4: protocol.k = 3 must be a multiple of 2"),
        (["--protocol.mode", "dense", "--codec.bits", "4"],
         "codec.bits = 4: protocol.mode = 'dense' does not read it"),
        (["--protocol.mode", "quant", "--codec.bits", "0"],
         "codec.bits = 0: protocol.mode = 'quant' needs 2, 4 or 8"),
    ],
)  # fmt: skip
def test_codec_config_errors_are_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(str(TINY), overrides, check_environment=False)
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("mode", ["subspace", "dense"])
def test_bits_zero_is_the_exact_wire(mode):
    """``[codec] bits = 0`` undoes a base config's quantizer (the production configs quantize,
    their dense twins inherit the table): no codec, the same run as without the key."""
    exact = load_config(str(TINY), ["--protocol.mode", mode], check_environment=False)
    zero = load_config(str(TINY), ["--protocol.mode", mode, "--codec.bits", "0"],
                       check_environment=False)  # fmt: skip
    assert codec_for(zero) is None
    assert protocol_identity(zero) == protocol_identity(exact)


def test_stages_must_agree_on_the_codec_in_lossy_modes():
    """The start-up check compares ``protocol_identity`` across stages (tested with processes
    in test_bad_input): in a lossy mode it must include the codec settings, which fix the
    payload shapes; in subspace mode the unused [codec] table must not matter."""

    def identity(*over: str) -> str:
        return protocol_identity(load_config(str(TINY), list(over), check_environment=False))

    topk = ["--protocol.mode", "topk"]
    assert identity(*topk, "--codec.topk", "5") != identity(*topk, "--codec.topk", "6")
    assert "topk=5" in identity(*topk, "--codec.topk", "5")
    assert identity("--codec.topk", "5") == identity("--codec.topk", "6")


@pytest.fixture(scope="module")
def dense_seed_checkpoint(tmp_path_factory):
    """One seed checkpoint of the tiny dense model: every lossy mode trains this model."""
    folder = tmp_path_factory.mktemp("seed") / "run"
    torchrun(
        1, folder, "--protocol.stages", "2", "--protocol.mode", "lowrank",
        "--checkpoint.enable", "--checkpoint.create_seed_checkpoint",
    )  # fmt: skip
    return folder / "checkpoint" / "step-0"


@pytest.mark.parametrize(
    ("codec", "settings"),
    [(["--protocol.mode", "topk", "--codec.topk", "4", "--codec.topk_backward",
       "straight_through"], CodecSettings(topk=4, topk_backward="straight_through"))],
    ids=["topk-straight-through"],
)  # fmt: skip
def test_pipelined_transport_equals_in_graph_codec(tmp_path, dense_seed_checkpoint, codec,
                                                   settings):  # fmt: skip
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(dense_seed_checkpoint)]
    single = torchrun(1, tmp_path / "in_graph", "--protocol.stages", "2", *codec, *load)
    piped = torchrun(2, tmp_path / "transport", *codec, *load)

    assert [r["step"] for r in single] == [r["step"] for r in piped] == [1, 2, 3]
    for a, b in zip(single, piped, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(a[key] - b[key]) <= 2e-6 * abs(a[key]), (key, a[key], b[key])
    # tests/tiny.toml: 4 microbatches of [1, 64, 64] fp32 per step, one boundary
    mode = codec[1]
    c = build_codec(mode, settings, 64, protocol_seed=7)
    shape = torch.Size([1, 64, 64])
    for r in piped:
        assert r["wire/fwd_bytes/b0"] == 4 * c.payload_bytes(shape, torch.float32, "fwd")
        assert r["wire/bwd_bytes/b0"] == 4 * c.payload_bytes(shape, torch.float32, "bwd")
        assert r["wire/dense_bytes"] == 2 * 4 * 64 * 64 * 4
