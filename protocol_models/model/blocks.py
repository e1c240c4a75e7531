"""The model's transformer blocks: one class per boundary method.

``ProtocolBlock`` is TorchTitan's llama3 block with its two residual writes optionally confined
to span(U) (``factored``), and two hooks a boundary method overrides: ``receive`` (what the
first block after a boundary makes of the message: the stream and its branches' input) and
``send`` (what the last block before one returns). A method that changes the blocks at a
boundary is one subclass here, named by its ``boundary.BoundaryMethod.block`` entry, whose
``attach`` turns the layer configs on each side of every boundary into its own; the core block
never names a method.

Shapes: ``x`` ``[mb, seq, d]`` is the stream; a message is ``[mb, seq, w]`` with ``w`` the
method's width (``BoundaryMethod.width``); ``token_ids`` ``[mb, seq]``; ``basis`` ``U``
``[d, k]`` and ``table`` ``F`` ``[V, d]`` where the model holds them (else None).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn
from torchtitan.models.common import Embedding, Linear
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.models.llama3.model import Llama3TransformerBlock

from protocol_models.model import subspace
from protocol_models.model.mapl import MaplCodec


def trunc_normal(std: float) -> dict:
    """A weight init: normal at ``std``, truncated at 3 std (a ``param_init`` mapping)."""
    return {"weight": partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std)}


class ProtocolBlock(Llama3TransformerBlock):
    """A llama3 block whose two residual writes can be confined to span(U).

    ``upstream``: the block sits before the last boundary (its writers are the ones the subspace
    constrains; the optimizers' row-wise and projection rules act on them). ``factored``: its
    ``attention.wo`` and ``feed_forward.w2`` output ``k`` coordinates and the block adds
    ``branch @ U.T`` ``[mb, seq, d]`` to the stream."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3TransformerBlock.Config):
        upstream: bool = False
        factored: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.upstream = config.upstream
        self.factored = config.factored

    def writers(self) -> list[nn.Parameter]:
        """The two weights that write into the residual stream (``[out, in]``)."""
        return [self.attention.wo.weight, self.feed_forward.w2.weight]

    def receive(self, x, token_ids, basis, table) -> tuple[torch.Tensor, torch.Tensor]:
        """``(stream, branch input)`` ``[mb, seq, d]`` each from the block's input ``x``."""
        return x, x

    def send(self, h, ffn, token_ids, basis, table) -> torch.Tensor:
        """The block's output from the stream after attention ``h`` and the MLP branch ``ffn``
        (both ``[mb, seq, d]``)."""
        return h + ffn

    def forward(
        self,
        x: torch.Tensor,
        attention_masks,
        positions: torch.Tensor | None = None,
        basis: torch.Tensor | None = None,
        token_ids: torch.Tensor | None = None,
        table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` (the stream, or a message after a boundary) -> the stream (or a message
        before one): ``receive``, attention and MLP with their writes lifted by ``U`` where
        ``factored``, ``send``."""
        stream, branch_in = self.receive(x, token_ids, basis, table)
        attn = self.attention(self.attention_norm(branch_in), attention_masks, positions)
        if self.factored:
            attn = attn @ basis.to(attn.dtype).T
        h = stream + attn
        ffn = self.feed_forward(self.ffn_norm(h))
        if self.factored:
            ffn = ffn @ basis.to(ffn.dtype).T
        return self.send(h, ffn, token_ids, basis, table)

    @classmethod
    def attach(cls, layers: list, ranges: list[range], arch, protocol) -> None:
        """Turn ``layers[i]`` (``ProtocolBlock.Config``) on each side of every boundary of the
        stage ``ranges`` into this method's blocks, for the ``ModelArch`` ``arch`` and the
        ``[protocol]`` settings ``protocol`` (the base block: nothing to turn)."""

    @classmethod
    def _become(cls, config: ProtocolBlock.Config, **extra) -> ProtocolBlock.Config:
        """``config`` as this class's ``Config``, with ``extra`` fields set."""
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        return cls.Config(**{**fields, **extra})


def _boundaries(ranges: list[range]) -> list[tuple[int, int]]:
    """``(last block before, first block after)`` of every boundary between the stage
    ``ranges``."""
    return [(before[-1], after[0]) for before, after in zip(ranges[:-1], ranges[1:], strict=True)]


class ResbmBlock(ProtocolBlock):
    """ResBM (``resbm`` mode, ``h = k``): with an ``encoder`` (``[h, d]``, the last block before
    a boundary) the block returns the bottleneck ``b = enc(silu(ffn)) + h[..., :h]``
    ``[mb, seq, h]``; with a ``decoder`` (``[d, h]``, the first block after one) it takes ``b``,
    feeds ``relu(dec(b))`` to its attention and restarts the stream from ``b`` zero-padded to
    ``d``. A block alone on a middle stage has both."""

    @dataclass(kw_only=True, slots=True)
    class Config(ProtocolBlock.Config):
        encoder: Linear.Config | None = None
        """Sender: ``d -> h``, after the SiLU of the MLP branch."""
        decoder: Linear.Config | None = None
        """Receiver: ``h -> d``, then ReLU, the attention branch's input."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.encoder = config.encoder.build() if config.encoder is not None else None
        self.decoder = config.decoder.build() if config.decoder is not None else None

    def receive(self, x, token_ids, basis, table):
        if self.decoder is None:
            return x, x
        stream = nn.functional.pad(x, (0, self.decoder.out_features - x.shape[-1]))
        return stream, torch.relu(self.decoder(x))

    def send(self, h, ffn, token_ids, basis, table):
        if self.encoder is None:
            return h + ffn
        return self.encoder(nn.functional.silu(ffn)) + h[..., : self.encoder.out_features]

    @classmethod
    def attach(cls, layers, ranges, arch, protocol):
        for sender, receiver in _boundaries(ranges):
            layers[sender] = cls._become(layers[sender], encoder=Linear.Config(
                in_features=arch.dim, out_features=protocol.k,
                param_init=trunc_normal(depth_scaled_std(arch.init_std, sender))))  # fmt: skip
            layers[receiver] = cls._become(layers[receiver], decoder=Linear.Config(
                in_features=protocol.k, out_features=arch.dim,
                param_init=trunc_normal(arch.init_std)))  # fmt: skip


class MaplBlock(ProtocolBlock):
    """MAPL (``mapl`` mode): with ``mapl_out`` the block returns the coordinates ``c``
    ``[mb, seq, r]`` of its output; with ``mapl_in`` it takes ``c`` and rebuilds its input
    ``[mb, seq, d]`` (both read the token ids). Boundary ``b``'s two sides hold copies of one
    codec (``r = k``, ``m = protocol.anchor_rank``, seed ``protocol.seed + b``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ProtocolBlock.Config):
        mapl_out: MaplCodec.Config | None = None
        """Sender: the block's output is encoded to r coordinates."""
        mapl_in: MaplCodec.Config | None = None
        """Receiver: the block's input is rebuilt from r coordinates."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.mapl_out = config.mapl_out.build() if config.mapl_out is not None else None
        self.mapl_in = config.mapl_in.build() if config.mapl_in is not None else None

    def receive(self, x, token_ids, basis, table):
        if self.mapl_in is not None:
            x = self.mapl_in.decode(x, token_ids)
        return x, x

    def send(self, h, ffn, token_ids, basis, table):
        if self.mapl_out is None:
            return h + ffn
        return self.mapl_out.encode(h + ffn, token_ids)

    @classmethod
    def attach(cls, layers, ranges, arch, protocol):
        for b, (sender, receiver) in enumerate(_boundaries(ranges)):
            codec = MaplCodec.Config(
                dim=arch.dim, rank=protocol.k, vocab_size=arch.vocab_size,
                anchor_rank=protocol.anchor_rank, boundary=b, seed=protocol.seed + b,
                anchor_std=arch.init_std, rvq_stages=protocol.rvq_stages,
                rvq_codebook=protocol.rvq_codebook, rvq_decay=protocol.rvq_decay,
            )  # fmt: skip
            layers[sender] = cls._become(layers[sender], mapl_out=codec)
            layers[receiver] = cls._become(layers[receiver], mapl_in=codec)


class TableBlock(ProtocolBlock):
    """Stage tables (``[protocol] stage_tables``, ``dense`` and ``projected`` modes): the first
    block of every stage but the first adds the stage's own learned token table row ``G[ids]``
    ``[mb, seq, d]`` (zero at the start) to the stream it receives. Nothing of it crosses a
    boundary: the stage adds it to what it received, the next stage receives the stream (dense)
    or its projection (projected)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ProtocolBlock.Config):
        stage_table: Embedding.Config | None = None
        """The stage's own token table ``[V, d]``, added to the stream it receives."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.stage_table = config.stage_table.build() if config.stage_table is not None else None

    def receive(self, x, token_ids, basis, table):
        if self.stage_table is not None:
            x = x + self.stage_table(token_ids).to(x.dtype)
        return x, x

    @classmethod
    def attach(cls, layers, ranges, arch, protocol):
        if not protocol.stage_tables:
            return
        for _, receiver in _boundaries(ranges):
            table = Embedding.Config(num_embeddings=arch.vocab_size, embedding_dim=arch.dim,
                                     param_init={"weight": nn.init.zeros_})  # fmt: skip
            layers[receiver] = cls._become(layers[receiver], stage_table=table)


class ProjectedBlock(TableBlock):
    """Projected boundary (``projected`` mode): with ``project_out`` the block returns
    ``c = (x - F[ids]) @ U`` ``[mb, seq, k]``; with ``project_in`` it takes ``c`` and rebuilds
    ``F[ids] + c @ U.T`` ``[mb, seq, d]`` (``subspace.encode``/``decode``, ``U`` detached: it
    never trains here), plus, with a ``stage_table``, the stage's own learned row ``G[ids]``
    (``TableBlock``; the next boundary's projection sends what the stage needs of it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(TableBlock.Config):
        project_out: bool = False
        """Sender: the block's output is sent as its k coordinates around ``F``."""
        project_in: bool = False
        """Receiver: the block's input is rebuilt from k coordinates."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.project_out = config.project_out
        self.project_in = config.project_in

    def receive(self, x, token_ids, basis, table):
        if self.project_in:
            x = subspace.decode(x, token_ids, basis.detach(), table)
        return super().receive(x, token_ids, basis, table)

    def send(self, h, ffn, token_ids, basis, table):
        if not self.project_out:
            return h + ffn
        return subspace.encode(h + ffn, token_ids, basis.detach(), table)

    @classmethod
    def attach(cls, layers, ranges, arch, protocol):
        for sender, receiver in _boundaries(ranges):
            layers[sender] = cls._become(layers[sender], project_out=True)
            layers[receiver] = cls._become(layers[receiver], project_in=True)
        super().attach(layers, ranges, arch, protocol)
