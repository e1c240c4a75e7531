"""Residual vector quantization of MAPL's coordinates: L codebooks, indices on the wire.

With ``[protocol] rvq_stages = L`` and ``rvq_codebook = K``, a MAPL boundary sends, per token,
L indices into L codebooks ``C_j`` ``[K, r]`` instead of the r coordinates ``c``: greedily,
``i_1 = argmin_k ||c - C_1[k]||``, then the residual ``c - C_1[i_1]`` against ``C_2``, and so
on; the receiver sums ``c_hat = sum_j C_j[i_j]``. The indices are bit-packed as ``Quant``'s
codes (``log2 K`` bits each: L log2 K / 8 bytes per token). The backward is straight-through:
the gradient of ``c_hat`` crosses back as the gradient of ``c``, r values per token in the wire
dtype.

The codebooks are buffers of the boundary's two ``mapl.MaplCodec`` copies (``codebooks``
``[L, K, r]``). The sender accumulates, per step, how many residuals each code took and their
sum (``MaplCodec.observe``); before the optimizer step ``mapl_sync.BoundarySync`` folds them
into exponential moving averages (EMA k-means, ``[protocol] rvq_decay``) and sends the updated
codebooks to the receiver with the gradient exchange (metered in ``wire/sync_bytes``), so both
sides always decode with the same dictionary.
"""

from __future__ import annotations

import math

import torch

from protocol_models.wire.codecs import Codec, Quant

CODEBOOK_SIZES = (4, 16, 256)
"""Codebook sizes whose indices bit-pack into whole bytes (2, 4 or 8 bits)."""


def quantize(c: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """Greedy residual codes of ``c`` ``[..., r]`` in ``codebooks`` ``[L, K, r]``: the indices
    ``[..., L]`` (int64), computed in fp32."""
    residual = c.float().reshape(-1, c.shape[-1])
    codes = []
    for book in codebooks.float():
        index = torch.cdist(residual, book).argmin(dim=-1)
        residual = residual - book[index]
        codes.append(index)
    return torch.stack(codes, dim=-1).view(*c.shape[:-1], len(codebooks))


def reconstruct(codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """``sum_j C_j[codes[..., j]]``: codes ``[..., L]`` -> ``[..., r]`` (fp32)."""
    books = codebooks.float()
    return sum(books[j][codes[..., j]] for j in range(len(books)))


def residuals(c: torch.Tensor, codes: torch.Tensor, codebooks: torch.Tensor) -> torch.Tensor:
    """The residual each stage quantized: ``[L, tokens, r]`` (fp32), stage j's input."""
    books, flat = codebooks.float(), c.float().reshape(-1, c.shape[-1])
    codes = codes.reshape(-1, len(books))
    out = []
    for j, book in enumerate(books):
        out.append(flat)
        flat = flat - book[codes[:, j]]
    return torch.stack(out)


class ResidualVQ(Codec):
    """The RVQ wire of a MAPL boundary (not a mode of its own: ``wire.codec_for`` gives it to
    ``mapl`` when ``[protocol] rvq_stages`` > 0). Forward: the packed indices, ``L log2 K / 8``
    bytes per token; backward: the gradient, ``r`` values per token in the wire dtype.
    ``attach`` names the blocks whose ``MaplCodec`` copies hold the codebooks."""

    name = "rvq"

    def __init__(self, stages: int, codebook: int):
        self.stages = stages
        self.packer = Quant(int(math.log2(codebook)), seed=0)
        self.sender = self.receiver = None

    @classmethod
    def build(cls, settings, *, dim, protocol_seed):
        raise TypeError("ResidualVQ is built from [protocol] (wire.codec_for), not from [codec]")

    def attach(self, sender_block, receiver_block) -> None:
        """The sender's copy (its codebooks encode and gather statistics) and the receiver's
        (its codebooks decode); None where this process holds no such side."""
        self.sender = sender_block.mapl_out if sender_block is not None else None
        self.receiver = receiver_block.mapl_in if receiver_block is not None else None

    @torch.no_grad()
    def encode(self, x):
        books = self.sender.codebooks
        codes = quantize(x, books)
        if self.sender.training:  # validation and sampling leave the codebooks alone
            self.sender.observe(residuals(x, codes, books), codes)
        return [self.packer.pack(codes.to(torch.uint8))]

    def decode(self, payload, shape):
        codes = self.packer.unpack(payload[0]).long()
        return reconstruct(codes, self.receiver.codebooks).view(shape)

    def encode_grad(self, g, fwd):
        return [g.contiguous()]

    def decode_grad(self, payload, fwd, shape):
        return payload[0]

    def spec(self, shape, dtype, direction):
        if direction == "bwd":
            return [(tuple(shape), dtype)]
        return [((*shape[:-1], self.stages // self.packer.per_byte), torch.uint8)]

    def payload_bytes(self, shape, dtype, direction):
        tokens = math.prod(shape[:-1])
        if direction == "bwd":
            return tokens * shape[-1] * dtype.itemsize
        return tokens * self.stages * self.packer.bits // 8


__all__ = ["CODEBOOK_SIZES", "ResidualVQ", "quantize", "reconstruct", "residuals"]
