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
(``protocol_models.training.mapl_sync``). ``U_s`` moves on the Stiefel manifold (``tangent``,
``retract``; the optimizer is ``optimizers.StiefelMuon``); the anchor factors are ordinary
parameters.

With residual vector quantization (``[protocol] rvq_stages`` L > 0, ``protocol_models.wire.rvq``)
each copy also holds the codebooks ``[L, K, r]`` and their EMA k-means statistics as buffers;
the sender's copy updates them (``observe`` during the step, ``refresh_codebooks`` before the
optimizer step) and the receiver's is overwritten with the result (``mapl_sync``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torchtitan.protocols.module import Module

from protocol_models.model.subspace import orthonormalize


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
        rvq_stages: int = 0
        """L: codebooks (0: no quantizer, no buffers)."""
        rvq_codebook: int = 256
        """K: codes per codebook."""
        rvq_decay: float = 0.99
        """EMA decay of the k-means statistics."""

    def __init__(self, config: Config):
        super().__init__()
        self.boundary, self.seed, self.anchor_std = config.boundary, config.seed, config.anchor_std
        self.projection = nn.Parameter(torch.empty(config.dim, config.rank))
        self.anchor_tokens = nn.Parameter(torch.empty(config.vocab_size, config.anchor_rank))
        self.anchor_mix = nn.Parameter(torch.empty(config.anchor_rank, config.dim))
        self.rvq_decay = config.rvq_decay
        books = (config.rvq_stages, config.rvq_codebook)
        if config.rvq_stages:
            self.register_buffer("codebooks", torch.empty(*books, config.rank))
            self.register_buffer("code_counts", torch.empty(*books))
            self.register_buffer("code_sums", torch.empty(*books, config.rank))
            self.register_buffer("hits", torch.zeros(*books), persistent=False)
            self.register_buffer("totals", torch.zeros(*books, config.rank), persistent=False)
            self.register_buffer("usage", torch.zeros(*books), persistent=False)
        self.quantized = bool(config.rvq_stages)

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
        if self.quantized:  # C_j ~ N(0, 4^-j): each stage quantizes a smaller residual
            books = torch.randn(self.codebooks.shape, generator=generator)
            books *= 0.5 ** torch.arange(len(books)).view(-1, 1, 1)
            self.codebooks.copy_(books)
            self.code_counts.fill_(1.0)
            self.code_sums.copy_(books)
            self.hits.zero_()
            self.totals.zero_()

    @torch.no_grad()
    def observe(self, residuals: torch.Tensor, codes: torch.Tensor) -> None:
        """Sender, per microbatch: add what each code took -- ``residuals`` ``[L, T, r]`` (stage
        j's input), ``codes`` ``[T, L]`` -- to this step's counts and sums (fp32)."""
        for j, index in enumerate(codes.reshape(-1, len(self.codebooks)).T):
            self.hits[j].index_add_(0, index, torch.ones_like(index, dtype=torch.float32))
            self.totals[j].index_add_(0, index, residuals[j])

    @torch.no_grad()
    def refresh_codebooks(self) -> None:
        """Sender, once per step: EMA k-means, ``n <- decay n + (1 - decay) hits``,
        ``s <- decay s + (1 - decay) totals``, ``C <- s / n``; the step's hits become ``usage``
        and the accumulators restart."""
        decay = self.rvq_decay
        self.code_counts.mul_(decay).add_(self.hits, alpha=1 - decay)
        self.code_sums.mul_(decay).add_(self.totals, alpha=1 - decay)
        self.codebooks.copy_(self.code_sums / self.code_counts.clamp_min(1e-6).unsqueeze(-1))
        self.usage.copy_(self.hits)
        self.hits.zero_()
        self.totals.zero_()

    def code_perplexity(self) -> torch.Tensor:
        """``exp(entropy)`` of the last step's code usage, the mean over the L codebooks (a 0-d
        tensor; K when every code is used equally, 1 when one code takes everything)."""
        p = self.usage / self.usage.sum(dim=-1, keepdim=True).clamp_min(1.0)
        entropy = -(p * p.clamp_min(1e-12).log()).sum(dim=-1)
        return entropy.exp().mean()

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
