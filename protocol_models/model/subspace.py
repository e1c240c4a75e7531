"""The frozen geometry of a Protocol Model: the basis ``U``, the token table ``F`` and the codec.

Every residual-stream vector at a pipeline boundary satisfies ``x = F[ids] + c @ U.T``:

* ``U``  ``[d, k]`` fp32, orthonormal columns, shared by every layer and every stage;
* ``F``  ``[V, d]`` fp32, a frozen N(0, 1) token table present on every stage;
* ``c``  ``[mb, seq, k]``, the only activation that crosses a boundary.

Both buffers come from one explicit CPU generator (U drawn first, then F, block by block), so every
stage of every node rebuilds bit-identical copies from the seed alone; nothing is communicated.
With ``[protocol] basis_file`` U is read from that file instead (``read_basis``; F is still
drawn), the same bytes on every node.
"""

from __future__ import annotations

import hashlib

import torch

from protocol_models.tools.errors import ConfigError

TABLE_BLOCK_ROWS = 4096
"""Rows of ``F`` drawn, hashed and copied to the device at a time (64 MB at d = 4096)."""


def make_basis_and_table(
    seed: int, dim: int, k: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(U [dim, k], F [vocab_size, dim])`` in fp32 on the CPU, deterministic in
    ``seed`` (the small-model form of ``generate``)."""
    basis, table, _ = generate(seed, dim, k, vocab_size)
    return basis, table


def generate(
    seed: int,
    dim: int,
    k: int,
    vocab_size: int,
    *,
    device: torch.device | str = "cpu",
    table_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, bytes]:
    """``(U [dim, k] fp32, F [vocab_size, dim] table_dtype, sha256 of F)``, both on ``device``.

    One explicit CPU generator draws ``U`` first, then ``F`` in blocks of ``TABLE_BLOCK_ROWS``
    rows (the same values as one ``randn`` of the whole table: the CPU generator's stream does
    not depend on how the draws are split). Each block is rounded to ``table_dtype``, hashed
    and copied to ``device``, so host memory holds one block, never the whole table (2.1 GB in
    fp32 at LLaMA-3 8B sizes, on every rank). The digest covers the stored values (as fp32
    bytes, row-major): stages and checkpoints compare it instead of hashing ``F`` again.

    ``U = QR(G)[0]`` with column signs fixed so that ``diag(R) > 0`` (QR's sign convention is not
    guaranteed across LAPACK builds; the fix makes ``U`` a function of ``G`` alone).
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    basis = orthonormalize(torch.randn(dim, k, generator=gen, dtype=torch.float32))
    table = torch.empty(vocab_size, dim, dtype=table_dtype, device=device)
    digest = hashlib.sha256()
    for start in range(0, vocab_size, TABLE_BLOCK_ROWS):
        rows = min(TABLE_BLOCK_ROWS, vocab_size - start)
        block = torch.randn(rows, dim, generator=gen, dtype=torch.float32).to(table_dtype)
        digest.update(block.float().numpy().tobytes())
        table[start : start + rows].copy_(block)
    return basis.contiguous().to(device), table, digest.digest()


BASIS_KEY = "basis"
"""The tensor name of U in a basis file (``[protocol] basis_file``)."""


def read_basis(path: str, dim: int, k: int) -> torch.Tensor:
    """U ``[dim, k]`` fp32 from the safetensors file ``path`` (``[protocol] basis_file``);
    anything else -- no such file, no ``basis`` tensor, another shape or dtype, non-finite
    values, columns that are not orthonormal -- is one ``ConfigError`` line."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    name = f"protocol.basis_file = {path!r}"
    try:
        tensors = load_file(path)
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{name}: not a readable safetensors file ({e})") from None
    basis = tensors.get(BASIS_KEY)
    if basis is None:
        raise ConfigError(f"{name}: no tensor {BASIS_KEY!r} (has {sorted(tensors)})")
    if basis.shape != (dim, k) or basis.dtype != torch.float32:
        raise ConfigError(
            f"{name}: {BASIS_KEY!r} is {basis.dtype} {list(basis.shape)}, expected "
            f"torch.float32 [model.dim, protocol.k] = [{dim}, {k}]"
        )
    if not bool(torch.isfinite(basis).all()):
        raise ConfigError(f"{name}: {BASIS_KEY!r} holds non-finite values")
    error = float((basis.T @ basis - torch.eye(k)).abs().max())
    allowed = leak_tolerance(torch.float32)  # what an exact boundary is held to
    if error > allowed:
        raise ConfigError(
            f"{name}: the columns of {BASIS_KEY!r} are not orthonormal (|U^T U - I| up to "
            f"{error:.2g}, allowed {allowed:.2g})"
        )
    return basis.contiguous()


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


LEAK_ROUNDINGS = 32
"""``leak_tolerance`` in units of the stream dtype's unit roundoff."""


def leak_tolerance(dtype: torch.dtype) -> float:
    """The largest ``leak`` that still means "exact" for a stream computed in ``dtype``.

    The stream ``x`` is itself rounded to ``dtype`` at every residual add, and a rounded vector
    is in ``F[ids] + span(U)`` only up to that rounding: an fp32 stream measures ~6 unit
    roundoffs (~3.5e-7), a bf16 stream ~4 (~1.5e-2 with u = 2^-8). So in bf16 the subspace wire
    is exact up to the rounding a dense bf16 wire also has; the tolerance is 32 unit roundoffs
    (fp32: 1.9e-6, bf16: 0.125), well below the O(0.1-1) leak of a broken constraint.
    """
    return LEAK_ROUNDINGS * torch.finfo(dtype).eps / 2
