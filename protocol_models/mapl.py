"""MAPL's boundary codec: a learned orthonormal projection plus factorized anchor embeddings.

Manifold Aware Projection Learning (Janson, Oyallon, Belilovsky, arXiv 2606.05484). At boundary
``s`` a token ``t`` with stream ``x`` ``[d]`` crosses as ``r`` coordinates::

    a_s(t) = P_s[t] Q_s            (P_s [V, m], Q_s [m, d]: the anchor, m << d)
    c      = (x - a_s(t)) U_s      (U_s [d, r], U_s^T U_s = I: what crosses, r = [protocol] k)
    x_hat  = c U_s^T + a_s(t)      (the receiver's rebuild; the part of x - a outside span(U_s)
                                    is dropped)

The sender (last block before the boundary) and the receiver (first block after it) each hold
a ``MaplCodec``: two copies of ``U_s``, ``P_s``, ``Q_s``, initialised identically from the
boundary's seed and kept identical by summing their gradients before every optimizer step
(``protocol_models.mapl_sync``). ``U_s`` moves on the Stiefel manifold (``tangent``,
``retract``; the optimizer is ``optimizers.StiefelMuon``); the anchor factors are ordinary
parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols.module import Module

from protocol_models.subspace import orthonormalize


def tangent(u: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The projection of ``g`` ``[d, r]`` onto the tangent space of the Stiefel manifold at
    ``u`` ``[d, r]`` (orthonormal columns): ``g - u sym(u^T g)``."""
    ug = u.T @ g
    return g - u @ ((ug + ug.T) / 2)


def retract(y: torch.Tensor) -> torch.Tensor:
    """The QR retraction: orthonormal columns spanning ``y`` ``[d, r]``, computed in float64
    (``U^T U = I`` to fp32 rounding however many steps a run takes), returned in ``y.dtype``."""
    return orthonormalize(y.double()).to(y.dtype)


def orthonormality_error(u: torch.Tensor) -> torch.Tensor:
    """``||U^T U - I||_F`` of ``u`` ``[d, r]`` as a 0-d fp32 tensor on ``u``'s device."""
    u = u.detach().float()
    return torch.linalg.matrix_norm(u.T @ u - torch.eye(u.shape[1], device=u.device))


def _fill(param: nn.Parameter, value: torch.Tensor) -> None:
    """Copy the full tensor ``value`` into ``param`` (a DTensor gets its own placements)."""
    if isinstance(param, DTensor):
        value = distribute_tensor(value, param.device_mesh, param.placements)
    param.copy_(value.to(param.device, param.dtype))


class MaplCodec(Module):
    """One side's copy of a MAPL boundary: ``projection`` U ``[d, r]``, ``anchor_tokens`` P
    ``[V, m]``, ``anchor_mix`` Q ``[m, d]``."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        dim: int
        rank: int
        """r, the coordinates that cross (``[protocol] k``)."""
        vocab_size: int
        anchor_rank: int
        """m, the inner width of the anchor factorization (``[protocol] anchor_rank``)."""
        boundary: int
        """Which boundary (0: between stages 0 and 1); the sync pairs the copies by it."""
        seed: int
        """Both copies draw U, P, Q from this seed, so they start identical."""
        anchor_std: float = 0.02

    def __init__(self, config: Config):
        super().__init__()
        self.boundary, self.seed, self.anchor_std = config.boundary, config.seed, config.anchor_std
        self.projection = nn.Parameter(torch.empty(config.dim, config.rank))
        self.anchor_tokens = nn.Parameter(torch.empty(config.vocab_size, config.anchor_rank))
        self.anchor_mix = nn.Parameter(torch.empty(config.anchor_rank, config.dim))

    @torch.no_grad()
    def _init_self_parameters(self) -> None:
        """U: QR of a Gaussian; P ~ N(0, 1); Q ~ N(0, anchor_std^2); all from ``seed`` on the
        CPU, so every copy of the boundary gets the same values on any device."""
        generator = torch.Generator().manual_seed(self.seed)
        d, r = self.projection.shape
        (v, m) = self.anchor_tokens.shape
        _fill(self.projection, retract(torch.randn(d, r, generator=generator)))
        _fill(self.anchor_tokens, torch.randn(v, m, generator=generator))
        _fill(self.anchor_mix, torch.randn(m, d, generator=generator) * self.anchor_std)

    def anchor(self, ids: torch.Tensor) -> torch.Tensor:
        """``a(t) = P[t] Q``: ids ``[mb, seq]`` -> ``[mb, seq, d]``."""
        return nn.functional.embedding(ids, self.anchor_tokens) @ self.anchor_mix

    def encode(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The sender: ``c = (x - a(ids)) U``, ``x`` ``[mb, seq, d]`` -> ``[mb, seq, r]``."""
        return (x - self.anchor(ids).to(x.dtype)) @ self.projection.to(x.dtype)

    def decode(self, c: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The receiver: ``x_hat = c U^T + a(ids)``, ``c`` ``[mb, seq, r]`` -> ``[mb, seq, d]``."""
        return c @ self.projection.to(c.dtype).T + self.anchor(ids).to(c.dtype)


__all__ = ["MaplCodec", "orthonormality_error", "retract", "tangent"]
