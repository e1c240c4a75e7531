"""The frozen geometry of a Protocol Model: the basis ``U``, the token table ``F`` and the codec.

Every residual-stream vector at a pipeline boundary satisfies ``x = F[ids] + c @ U.T``:

* ``U``  ``[d, k]`` fp32, orthonormal columns, shared by every layer and every stage;
* ``F``  ``[V, d]`` fp32, a frozen N(0, 1) token table present on every stage;
* ``c``  ``[mb, seq, k]``, the only activation that crosses a boundary.

Both buffers come from one explicit CPU generator (U drawn first, then F), so every stage of every
node rebuilds bit-identical copies from the seed alone; nothing is communicated.
"""

from __future__ import annotations

import torch


def make_basis_and_table(
    seed: int, dim: int, k: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(U [dim, k], F [vocab_size, dim])`` in fp32, deterministic in ``seed``.

    ``U = QR(G)[0]`` with column signs fixed so that ``diag(R) > 0`` (QR's sign convention is not
    guaranteed across LAPACK builds; the fix makes ``U`` a function of ``G`` alone).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    basis = orthonormalize(torch.randn(dim, k, generator=gen, dtype=torch.float32))
    table = torch.randn(vocab_size, dim, generator=gen, dtype=torch.float32)
    return basis.contiguous(), table


def orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``x`` ``[d, k]``: QR with column signs fixed so that
    ``diag(R) > 0``, a function of ``x`` alone."""
    q, r = torch.linalg.qr(x)
    return q * torch.sign(torch.diagonal(r)).unsqueeze(0)


def encode(x: torch.Tensor, ids: torch.Tensor, basis: torch.Tensor, table: torch.Tensor):
    """Coordinates of ``x`` in the subspace: ``c = (x - F[ids]) @ U``.

    ``x`` ``[mb, seq, d]`` -> ``c`` ``[mb, seq, k]``. Computed in fp32 (``x - F`` cancels most of
    the magnitude, bf16 would lose the signal) and cast back to ``x.dtype`` for the wire.
    """
    residual = x.float() - table[ids].float()
    return (residual @ basis.float()).to(x.dtype).contiguous()


def decode(c: torch.Tensor, ids: torch.Tensor, basis: torch.Tensor, table: torch.Tensor):
    """Rebuild the stream ``x = c @ U.T + F[ids]`` ``[mb, seq, d]`` in ``c.dtype``.

    ``ids`` are clamped into the table: pipelining infers shapes once by running a stage on an
    uninitialised buffer, and the kwargs it passes then are real, but the clamp keeps a stray id
    from ever indexing out of range.
    """
    ids = ids.clamp(0, table.shape[0] - 1)
    x = c.float() @ basis.float().T + table[ids].float()
    return x.to(c.dtype)


@torch.no_grad()
def leak(x: torch.Tensor, ids: torch.Tensor, basis: torch.Tensor, table: torch.Tensor):
    """Relative part of ``x - F[ids]`` outside span(U): ``||(I - UU^T) r|| / ||r||`` (a 0-d tensor).

    Zero (to rounding) whenever the subspace invariant holds; this is what ``subspace/leak``
    reports at every boundary.
    """
    residual = x.float() - table[ids].float()
    u = basis.float()
    outside = residual - (residual @ u) @ u.T
    return outside.norm() / residual.norm().clamp_min(torch.finfo(torch.float32).tiny)
