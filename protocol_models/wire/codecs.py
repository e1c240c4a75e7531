"""Lossy boundary codecs -- the baselines the subspace codec is compared with.

Selected by ``[protocol] mode`` (``topk``, ``quant``, ``lowrank``, ``svd``: the names in
``CODECS``) with parameters in the TOML table ``[codec]``; every lossy mode trains the
**unconstrained dense** model (no U, no F) and compresses its ``d``-wide boundary tensor ``x``
``[mb, seq, d]``. Each codec turns ``x`` into the real packed payload (a list of tensors, exactly
what crosses the wire) and back, and does the same for the gradient that flows back over the
boundary:

* ``topk``: per token the K largest ``|x_j|`` -- values ``[.., K]`` (wire dtype) and indices
  ``[.., K]`` int16. Backward ``topk``: TopK of the gradient (the same two tensors);
  ``straight_through``: the gradient at the forward's indices (values only).
* ``quant``: per-token absmax ``a``; codes of a ``2^b``-level grid on ``[-a, a]``, bit-packed
  into uint8 ``[.., d b / 8]``, plus ``a`` ``[.., 1]`` (wire dtype). Backward: the same payload
  with stochastic rounding.
* ``lowrank``: ``x P`` ``[.., k]`` with a fixed orthonormal ``P`` ``[d, k]``. Backward: ``g P``.
* ``svd``: per microbatch ``X`` ``[T, d]`` (``T = mb * seq``): ``L = X R`` ``[T, r]`` and ``R``
  ``[d, r]``, the top-r right singular vectors. Backward: ``G R`` ``[T, r]``.

The backward is the gradient of the lossy map ``x -> decode(encode(x))`` wherever that map is
differentiable with the data-dependent choices (TopK mask, ``R``) held fixed: ``mask * g``
(``straight_through``), ``g P P^T`` (``lowrank``), ``g R R^T`` (``svd``). ``quant`` uses the
straight-through estimator of rounding (identity), then compresses ``g`` with stochastic rounding
(unbiased). ``topk`` backward ``topk`` is the paper's baseline: TopK applied independently to the
received gradient -- biased, not the gradient of the forward map. Everything the backward needs
(indices, ``R``) is part of the forward payload, so sender and receiver hold the same state: the
forward payload, kept per microbatch.

Where they run (both paths call the same ``encode``/``decode`` on the same packed tensors):

* **pipelined runs** (one process per stage): at the transport hook, ``WirePipelineStage``
  (``protocol_models.wire.stage``) sends the payload instead of ``x`` and unpacks it into the next
  stage's receive buffer; gradients likewise in the other direction. The wire meter counts the
  payload bytes.
* **single-process runs with** ``protocol.stages = S``: in-graph, ``apply_boundary`` -- an
  autograd function whose forward is ``decode(encode(x))`` and whose backward is
  ``decode_grad(encode_grad(g))``, microbatch by microbatch in the order a pipeline schedule
  runs them -- runs on the output of the last block of each of the first S - 1 stages, through a
  forward hook ``install_in_graph`` registers (the model itself knows nothing of codecs). Each
  boundary gets its own copy of the codec, as each stage process holds its own, so stochastic
  rounding draws the same numbers. The receiver's ``x̂`` and its gradient are the same tensors
  as in the pipelined run, so both give the same losses (tested).

**Quantized subspace coordinates.** ``mode = "subspace"`` (or ``"projected"``: a boundary
method whose entry is ``quantizable``) with ``[codec] bits`` sends the k
coordinates ``c = (x - F[ids]) U`` ``[mb, seq, k]`` through the ``quant`` codec: a per-token
absmax scale (bf16) and ``bits``-bit codes, round-to-nearest forward, unbiased stochastic
rounding of the gradient coordinates backward; ``k b / 8 + 2`` bytes per token instead of
``k itemsize``. In-graph, the hook encodes the stream to ``c``, quantizes it and
rebuilds ``x̂ = F[ids] + ĉ Uᵀ``, as the next stage would (in ``projected`` mode the block
before the boundary already returns ``c``, and the hook quantizes it as it is). Without
``bits`` the wire is exact.

**Adding a codec** is one ``Codec`` subclass decorated with ``@register_codec``: its ``name``
becomes a ``[protocol] mode``, its ``check`` joins the config check, its ``spec`` sizes the
receive buffers and its ``payload_bytes`` the planner's and the recipes' byte figures. It reads
its parameters from ``[codec]`` (``settings`` names the keys, which also join the start-up check
that every stage runs the same codec).
"""

from __future__ import annotations

import copy
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, Literal

import torch
from torch import nn

from protocol_models.model import subspace
from protocol_models.model.boundary import BOUNDARIES
from protocol_models.model.layout import stage_layer_ranges
from protocol_models.tools.errors import ConfigError, require
from protocol_models.tools.ranges import AT_LEAST_1, SEED, Ranges

INDEX_DTYPE = torch.int16
"""TopK indices on the wire (``d <= 32768``)."""
Payload = list[torch.Tensor]
Spec = list[tuple[tuple[int, ...], torch.dtype]]


CODECS: dict[str, type[Codec]] = {}
"""The lossy codecs by ``[protocol] mode`` name (filled by ``register_codec``)."""


def register_codec(cls: type[Codec]) -> type[Codec]:
    """Class decorator: make ``cls`` selectable as ``[protocol] mode = cls.name``."""
    CODECS[cls.name] = cls
    return cls


def _check_rank(rank: int, dim: int) -> None:
    require(rank <= dim, f"codec.rank = {rank}: must be an integer in [1, model.dim = {dim}]")


@dataclass(kw_only=True, slots=True)
class CodecSettings:
    """Parameters of the lossy boundary codecs (TOML table ``[codec]``)."""

    topk: int = 21
    """``topk``: values kept per token (fp32 wire: ``6 K`` bytes vs ``4 d``)."""
    topk_backward: Literal["topk", "straight_through"] = "topk"
    """``topk``: TopK of the gradient, or the gradient at the forward's indices."""
    bits: Literal[0, 2, 4, 8] | None = None
    """Bits per coordinate on the wire, bit-packed. ``quant``: of ``x`` (default 8; ``d`` must be
    a multiple of ``8 / bits``); ``subspace``: of the k coordinates (``k`` must be a multiple of
    ``8 / bits``; unset or 0: the exact wire). Other modes refuse 2, 4 or 8; 0 (no quantizer)
    lets a config without a quantizer, such as a dense twin, undo a base config's bits."""
    rank: int = 8
    """``lowrank``: coordinates per token (``P`` is ``[d, rank]``); ``svd``: rank per microbatch."""
    seed: int = 4321
    """Seed of the gradients' stochastic rounding (``quant``); ``lowrank``'s ``P`` is the
    subspace basis of ``protocol.seed`` (the subspace codec without constraint and F)."""

    RANGES: ClassVar[Ranges] = {"topk": AT_LEAST_1, "rank": AT_LEAST_1, "seed": SEED}

    def check(self, mode: str, dim: int, microbatch_tokens: int, k: int) -> None:
        """These settings against ``protocol.mode`` at width ``dim``, subspace rank ``k`` and
        ``microbatch_tokens`` tokens per microbatch (a codec's ``check``)."""
        bits = self.bits
        if bits and "bits" not in self._keys(mode):
            readers = [*(name for name, b in BOUNDARIES.items() if b.quantizable),
                       *(name for name, c in CODECS.items() if "bits" in c.settings)]  # fmt: skip
            raise ConfigError(
                f"codec.bits = {bits}: protocol.mode = {mode!r} does not read it (only "
                f"{' and '.join(repr(r) for r in readers)} do; codec.bits = 0 turns it off)"
            )
        if _quantizable(mode) and bits:
            require(
                k % (8 // bits) == 0,
                f"codec.bits = {bits}: protocol.k = {k} must be a multiple of {8 // bits} to "
                f"bit-pack {bits}-bit coordinates",
            )
        if mode in CODECS:
            CODECS[mode].check(self, dim, microbatch_tokens)

    def identity(self, mode: str) -> str:
        """The settings ``mode``'s codec reads, as the start-up stage check compares them
        ("" for the exact wire)."""
        return ", ".join(f"{key}={getattr(self, key)!r}" for key in self._keys(mode))

    def _keys(self, mode: str) -> tuple[str, ...]:
        """The keys ``mode`` reads: its codec's, or (subspace) ``bits`` and ``seed`` when the
        coordinates are quantized."""
        if mode in CODECS:
            return CODECS[mode].settings
        if _quantizable(mode) and self.bits:
            return Quant.settings
        return ()


def _quantizable(mode: str) -> bool:
    """Whether ``mode`` is a boundary method that ``[codec] bits`` quantizes."""
    return mode in BOUNDARIES and BOUNDARIES[mode].quantizable


def _nbytes(spec: Spec) -> int:
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in spec)


class Codec(ABC):
    """Encode a boundary tensor ``x`` ``[mb, seq, d]`` into a packed payload and back.

    ``fwd`` is always the forward payload of the same microbatch (the only state the backward
    needs; both sides of the wire hold it).
    """

    name: ClassVar[str]
    """The ``[protocol] mode`` that selects this codec."""
    settings: ClassVar[tuple[str, ...]] = ()
    """The ``[codec]`` keys it reads."""

    @classmethod
    @abstractmethod
    def build(cls, settings: CodecSettings, *, dim: int, protocol_seed: int) -> Codec:
        """The codec for ``[codec]`` ``settings`` at width ``dim`` (``protocol_seed``: the
        subspace seed, for codecs that derive a fixed basis from it)."""

    @classmethod  # noqa: B027 (a default, not abstract: most codecs have something to check)
    def check(cls, settings: CodecSettings, dim: int, microbatch_tokens: int) -> None:
        """Raise ``ConfigError`` naming the key when ``settings`` cannot work at width ``dim``
        with ``microbatch_tokens`` tokens per microbatch (default: nothing to check)."""

    def attach(self, sender_block: nn.Module | None, receiver_block: nn.Module | None) -> None:  # noqa: B027
        """Bind the codec to the blocks around its boundary, for a codec whose state lives in the
        model (the last block before the boundary, the first after it; None where this process
        holds no such block). Default: stateless, nothing to bind."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> Payload: ...

    @abstractmethod
    def decode(self, payload: Payload, shape: torch.Size) -> torch.Tensor:
        """``x̂`` of ``shape``; the receiver casts it to its buffer's (the wire's) dtype."""

    @abstractmethod
    def encode_grad(self, g: torch.Tensor, fwd: Payload) -> Payload: ...

    @abstractmethod
    def decode_grad(self, payload: Payload, fwd: Payload, shape: torch.Size) -> torch.Tensor: ...

    @abstractmethod
    def spec(self, shape: torch.Size, dtype: torch.dtype, direction: str) -> Spec:
        """Shapes and dtypes of the ``fwd``/``bwd`` payload of a ``shape`` tensor of ``dtype``
        (what a receiver allocates)."""

    @abstractmethod
    def payload_bytes(self, shape: torch.Size, dtype: torch.dtype, direction: str) -> int:
        """Analytic size of the ``fwd``/``bwd`` payload in bytes (the formula in the docs)."""


@register_codec
class TopK(Codec):
    """Per token, the ``K`` largest ``|x_j|``: values (wire dtype) + int16 indices.
    Bytes per token: ``K (itemsize + 2)`` each way (``K itemsize`` backward, straight-through)."""

    name = "topk"
    settings = ("topk", "topk_backward")

    def __init__(self, k: int, backward: str):
        self.k, self.backward = k, backward

    @classmethod
    def build(cls, settings, *, dim, protocol_seed):
        return cls(settings.topk, settings.topk_backward)

    @classmethod
    def check(cls, settings, dim, microbatch_tokens):
        require(
            settings.topk <= min(dim, 32768),
            f"codec.topk = {settings.topk}: must be in [1, model.dim = {dim}] "
            "(indices travel as int16: model.dim <= 32768)",
        )

    def _select(self, x: torch.Tensor) -> Payload:
        index = x.abs().topk(self.k, dim=-1, sorted=False).indices
        return [x.gather(-1, index).contiguous(), index.to(INDEX_DTYPE)]

    def encode(self, x):
        return self._select(x)

    def decode(self, payload, shape):
        values, index = payload
        return values.new_zeros(shape).scatter(-1, index.long(), values)

    def encode_grad(self, g, fwd):
        if self.backward == "straight_through":
            return [g.gather(-1, fwd[1].long()).contiguous()]
        return self._select(g)

    def decode_grad(self, payload, fwd, shape):
        if self.backward == "straight_through":
            return self.decode([payload[0], fwd[1]], shape)
        return self.decode(payload, shape)

    def spec(self, shape, dtype, direction):
        values = (*shape[:-1], self.k)
        if direction == "bwd" and self.backward == "straight_through":
            return [(values, dtype)]
        return [(values, dtype), (values, INDEX_DTYPE)]

    def payload_bytes(self, shape, dtype, direction):
        tokens = math.prod(shape[:-1])
        index = 0 if direction == "bwd" and self.backward == "straight_through" else 2
        return tokens * self.k * (dtype.itemsize + index)


def _bf16_at_least(a: torch.Tensor) -> torch.Tensor:
    """``a`` (fp32, >= 0) as the smallest bf16 value >= ``a`` (relative excess < ``2^-7``)."""
    rounded = a.to(torch.bfloat16)
    up = torch.nextafter(rounded, torch.full_like(rounded, float("inf")))
    return torch.where(rounded.float() < a, up, rounded)


@register_codec
class Quant(Codec):
    """Per-token scale ``a``: the token's absmax rounded up to bf16 (2 bytes whatever the wire
    dtype, within ``2^-7`` of the absmax; bf16 keeps fp32's range, so tiny gradients keep their
    scale). ``2^b`` uniform levels on ``[-a, a]`` (step ``2a / (2^b - 1)``), codes bit-packed
    ``8 / b`` per byte. Forward rounds to nearest (error <= step / 2), gradients round
    stochastically (unbiased, error < step). Bytes per token: ``d b / 8 + 2``."""

    name = "quant"
    settings = ("bits", "seed")

    def __init__(self, bits: int, seed: int):
        self.bits, self.levels = bits, 2**bits - 1
        self.per_byte = 8 // bits
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    @classmethod
    def build(cls, settings, *, dim, protocol_seed):
        return cls(settings.bits or 8, settings.seed)

    @classmethod
    def check(cls, settings, dim, microbatch_tokens):
        require(settings.bits != 0, "codec.bits = 0: protocol.mode = 'quant' needs 2, 4 or 8")
        bits = settings.bits or 8
        require(
            dim % (8 // bits) == 0,
            f"codec.bits = {bits}: model.dim = {dim} must be a multiple of "
            f"{8 // bits} to bit-pack {bits}-bit codes",
        )

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device).manual_seed(self.seed)
        return self._generators[device]

    def _quantize(self, x: torch.Tensor, stochastic: bool) -> Payload:
        scale = _bf16_at_least(x.abs().amax(dim=-1, keepdim=True).float())
        tiny = torch.finfo(torch.float32).tiny
        u = (x.float() / scale.float().clamp_min(tiny) + 1) * (self.levels / 2)
        if stochastic:
            noise = torch.rand(u.shape, generator=self._generator(u.device), device=u.device)
            u = torch.floor(u + noise)
        else:
            u = torch.round(u)
        codes = u.clamp_(0, self.levels).to(torch.uint8)
        return [self.pack(codes), scale.contiguous()]

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes ``[..., n]`` (uint8, each < 2^bits) -> ``[..., n bits / 8]`` uint8."""
        grouped = codes.view(*codes.shape[:-1], -1, self.per_byte)
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=codes.device)
        return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """The inverse of ``pack``."""
        shifts = torch.arange(0, 8, self.bits, dtype=torch.uint8, device=packed.device)
        codes = (packed.unsqueeze(-1) >> shifts) & self.levels
        return codes.flatten(-2)

    def decode(self, payload, shape):
        packed, scale = payload
        codes = self.unpack(packed).float()
        return (codes * (2 / self.levels) - 1) * scale.float()

    def encode(self, x):
        return self._quantize(x, stochastic=False)

    def encode_grad(self, g, fwd):
        return self._quantize(g, stochastic=True)

    def decode_grad(self, payload, fwd, shape):
        return self.decode(payload, shape)

    def spec(self, shape, dtype, direction):
        lead = tuple(shape[:-1])
        return [((*lead, shape[-1] // self.per_byte), torch.uint8), ((*lead, 1), torch.bfloat16)]

    def payload_bytes(self, shape, dtype, direction):
        tokens = math.prod(shape[:-1])
        return tokens * (shape[-1] * self.bits // 8 + torch.bfloat16.itemsize)


@register_codec
class LowRank(Codec):
    """Fixed orthonormal ``P`` ``[d, k]``: send ``x P``, rebuild ``x P P^T``; the gradient is
    ``g P`` then ``P^T`` (exact for this linear map). Bytes per token: ``k itemsize`` each way."""

    name = "lowrank"
    settings = ("rank",)

    def __init__(self, projection: torch.Tensor):
        self.projection = projection

    @classmethod
    def build(cls, settings, *, dim, protocol_seed):
        basis, _ = subspace.make_basis_and_table(protocol_seed, dim, settings.rank, 0)
        return cls(basis)

    @classmethod
    def check(cls, settings, dim, microbatch_tokens):
        _check_rank(settings.rank, dim)

    def _p(self, t: torch.Tensor) -> torch.Tensor:
        if self.projection.device != t.device:
            self.projection = self.projection.to(t.device)
        return self.projection

    def encode(self, x):
        return [(x.float() @ self._p(x)).to(x.dtype).contiguous()]

    def decode(self, payload, shape):
        (c,) = payload
        return (c.float() @ self._p(c).T).to(c.dtype)

    def encode_grad(self, g, fwd):
        return self.encode(g)

    def decode_grad(self, payload, fwd, shape):
        return self.decode(payload, shape)

    def spec(self, shape, dtype, direction):
        return [((*shape[:-1], self.projection.shape[1]), dtype)]

    def payload_bytes(self, shape, dtype, direction):
        return math.prod(shape[:-1]) * self.projection.shape[1] * dtype.itemsize


@register_codec
class TruncatedSVD(Codec):
    """Per microbatch ``X`` ``[T, d]`` (``T = mb * seq``): ``R`` = top-``r`` right singular
    vectors ``[d, r]``, ``L = X R`` ``[T, r]``; rebuild ``L R^T``. The gradient is projected on
    the same ``R``: send ``G R``, rebuild ``G R R^T``. Bytes: ``r (T + d) itemsize`` forward,
    ``r T itemsize`` backward."""

    name = "svd"
    settings = ("rank",)

    def __init__(self, rank: int):
        self.rank = rank

    @classmethod
    def build(cls, settings, *, dim, protocol_seed):
        return cls(settings.rank)

    @classmethod
    def check(cls, settings, dim, microbatch_tokens):
        _check_rank(settings.rank, dim)
        require(
            settings.rank <= microbatch_tokens,
            f"codec.rank = {settings.rank}: must be <= the {microbatch_tokens} tokens of a "
            "microbatch (parallelism.pipeline_parallel_microbatch_size x training.seq_len)",
        )

    def encode(self, x):
        flat = x.reshape(-1, x.shape[-1]).float()
        right = torch.linalg.svd(flat, full_matrices=False).Vh[: self.rank].T
        return [(flat @ right).to(x.dtype).contiguous(), right.to(x.dtype).contiguous()]

    def decode(self, payload, shape):
        left, right = payload
        return (left.float() @ right.float().T).to(left.dtype).reshape(shape)

    def encode_grad(self, g, fwd):
        flat = g.reshape(-1, g.shape[-1]).float()
        return [(flat @ fwd[1].float()).to(g.dtype).contiguous()]

    def decode_grad(self, payload, fwd, shape):
        return self.decode([payload[0], fwd[1]], shape)

    def spec(self, shape, dtype, direction):
        tokens = math.prod(shape[:-1])
        left = ((tokens, self.rank), dtype)
        return [left, ((shape[-1], self.rank), dtype)] if direction == "fwd" else [left]

    def payload_bytes(self, shape, dtype, direction):
        tokens, d = math.prod(shape[:-1]), shape[-1]
        return self.rank * (tokens + (d if direction == "fwd" else 0)) * dtype.itemsize


def build_codec(mode: str, settings: CodecSettings, dim: int, protocol_seed: int) -> Codec | None:
    """The codec of ``[protocol] mode``: a lossy mode's; ``quant`` on the k coordinates for
    ``subspace`` with ``[codec] bits``; None for the exact wire (``dense``, plain ``subspace``)."""
    if _quantizable(mode) and settings.bits:
        return Quant(settings.bits, settings.seed)
    if mode not in CODECS:
        return None
    return CODECS[mode].build(settings, dim=dim, protocol_seed=protocol_seed)


class _Boundary(torch.autograd.Function):
    """Per microbatch: ``decode(encode(x))`` forward, ``decode_grad(encode_grad(g))`` backward,
    both in microbatch order (the order every schedule sends them in)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, codec: Codec, microbatch: int) -> torch.Tensor:
        parts = x.detach().split(microbatch)
        ctx.codec, ctx.microbatch = codec, microbatch
        ctx.payloads = [codec.encode(part) for part in parts]
        ctx.shapes = [part.shape for part in parts]
        return torch.cat(
            [codec.decode(p, shape) for p, shape in zip(ctx.payloads, ctx.shapes, strict=True)]
        ).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        codec, grads = ctx.codec, []
        for part, payload, shape in zip(
            g.split(ctx.microbatch), ctx.payloads, ctx.shapes, strict=True
        ):
            sent = codec.encode_grad(part.contiguous(), payload)
            grads.append(codec.decode_grad(sent, payload, shape))
        return torch.cat(grads).to(g.dtype), None, None


def apply_boundary(x: torch.Tensor, codec: Codec, microbatch: int | None = None) -> torch.Tensor:
    """The in-graph boundary of single-process runs: ``x`` ``[batch, seq, width]`` -> ``x̂``
    (same shape and dtype) with the codec's backward, ``microbatch`` sequences at a time
    (default: the whole batch as one microbatch)."""
    return _Boundary.apply(x, codec, microbatch or x.shape[0])


def install_in_graph(model: nn.Module, codec: Codec, n_stages: int, microbatch: int) -> list[int]:
    """Apply ``codec`` at every stage boundary of an ``n_stages`` layout that lies inside
    ``model`` (a whole model, or a pipeline stage's chunk: then there is none): a forward hook on
    the last block before each boundary replaces its output ``[batch, seq, d]`` by
    ``apply_boundary`` of it -- of its coordinates ``c`` when the model is a subspace model --
    ``microbatch`` sequences at a time as the pipelined stage encodes them (it matters for
    ``svd``), with a copy of ``codec`` per boundary. Returns the ids of the hooked blocks."""
    ranges = stage_layer_ranges(len(model.config.layers), n_stages, model.config.layers_per_stage)
    hooked = [
        r[-1] for r in ranges[:-1] if str(r[-1]) in model.layers and str(r[-1] + 1) in model.layers
    ]
    token_ids: dict[str, torch.Tensor] = {}
    if getattr(model, "subspace", False):

        def remember_ids(module, args, kwargs) -> None:
            token_ids["ids"] = args[0] if module.tok_embeddings is not None else kwargs["token_ids"]

        model.register_forward_pre_hook(remember_ids, with_kwargs=True)

    def boundary_hook(own: Codec):
        def boundary(module, args, output: torch.Tensor) -> torch.Tensor:
            if not token_ids:
                return apply_boundary(output, own, microbatch)
            ids, basis, table = token_ids["ids"], model.basis.detach(), model.token_table
            c = subspace.encode(output, ids, basis, table)
            return subspace.decode(apply_boundary(c, own, microbatch), ids, basis, table)

        return boundary

    for layer_id in hooked:
        own = copy.deepcopy(codec)
        own.attach(model.layers[str(layer_id)], model.layers[str(layer_id + 1)])
        model.layers[str(layer_id)].register_forward_hook(boundary_hook(own))
    return hooked


__all__ = [
    "CODECS",
    "Codec",
    "CodecSettings",
    "LowRank",
    "Quant",
    "TopK",
    "TruncatedSVD",
    "apply_boundary",
    "build_codec",
    "install_in_graph",
    "register_codec",
]
