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

from protocol_models.tools.errors import ConfigError, DataError

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

    ``ids`` ``[mb, seq]`` must index ``F`` (``0 <= id < V``), and nothing clamps them: a clamp
    would turn a wrong id into a wrong row without a word. No caller passes a stray id: when
    pipelining infers shapes by running a stage on an uninitialised ``c``, the kwargs it passes
    are the step's real ones (detached copies). The refusal adds no host sync: ids on the CPU
    are checked here (``check_ids``); on an accelerator, reading them back would stall every
    microbatch, so the gather's own bounds check refuses an id outside ``[-V, V)`` (a
    device-side assert; a negative id within it indexes from the end, as in Python).
    """
    if ids.device.type == "cpu":
        check_ids(ids, table.shape[0])
    x = c.float() @ basis.float().T + table[ids].float()
    return x.to(c.dtype)


def check_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse token ids (CPU, any shape) outside ``[0, vocab_size)``: one ``DataError`` line
    naming the first such id."""
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.numel():
        raise DataError(
            f"token id {int(bad[0])} is outside the token table F: ids must be in "
            f"[0, model.vocab_size = {vocab_size})"
        )


@torch.no_grad()
def leak(x: torch.Tensor, ids: torch.Tensor, basis: torch.Tensor, table: torch.Tensor):
    """The largest part of one token's residual ``r = x - F[ids]`` outside span(U), relative
    to that token: ``max over tokens t of ||(I - UU^T) r_t|| / max(||r_t||, ||x_t||)``, for
    ``x`` ``[mb, seq, d]``; a 0-d fp32 tensor on ``x``'s device (no host sync: the trainer
    reads it at log steps only).

    Zero (to rounding) whenever the subspace invariant holds; this is what ``subspace/leak``
    reports at every boundary. Per token, so a violation confined to a few tokens is not
    diluted by the rest of the microbatch, as one ratio over the whole microbatch would be.
    The floor ``||x_t||`` on ``||r_t||``: the stream is rounded to its dtype at every residual
    add, an error of about ``u ||x_t||`` that lies mostly outside span(U), so against a
    residual much smaller than its stream that rounding would read as a leak (against
    ``||r_t||`` alone, the exact runs ``leak_tolerance`` cites measure up to 3.7e-6 in fp32 and
    0.20 in bf16, a broken constraint's size). The scale is never 0:
    ``max(||r_t||, ||x_t||) >= ||F[id_t]|| / 2`` and no row of ``F`` is 0.
    """
    stream = x.float()
    residual = stream - table[ids].float()
    u = basis.float()
    outside = residual - (residual @ u) @ u.T
    scale = torch.maximum(residual.norm(dim=-1), stream.norm(dim=-1))
    return (outside.norm(dim=-1) / scale).max()


LEAK_MEASURED = {torch.float32: 4.2e-7, torch.bfloat16: 7.1e-3}
"""The largest ``leak`` measured on exact runs, per stream dtype (``leak_tolerance``)."""
LEAK_MARGIN = 4.0
"""``leak_tolerance`` over ``LEAK_MEASURED``."""


def leak_tolerance(dtype: torch.dtype) -> float:
    """The largest ``leak`` that still means "exact" for a stream computed in ``dtype``
    (float32 or bfloat16, the values of ``[training] mixed_precision_param``; KeyError for any
    other): ``LEAK_MARGIN`` (4) x the largest leak measured on exact runs.

    Measured on CPU (torch 2.14) with this ``leak``: ``tests/tiny.toml`` (d 64, k 4, 4 layers, 4
    microbatches of 1 x 64 tokens) trained 30 steps with a log every step, in fp32 and with
    ``--training.mixed_precision_param bfloat16``, as 2-stage pipelines with adamw, muon,
    adamw_rowwise and ``protocol.update_every 2`` (bf16 also with ``protocol.table_dtype
    bfloat16``) and a 3-stage one (fp32 with 8-bit coordinates; bf16). The largest per-token
    leak over all steps: fp32 4.2e-7 (7 unit roundoffs of 2^-24, from the fp32 arithmetic of
    the residual and its projection; median 1.7e-7), bf16 7.1e-3 (1.8 unit roundoffs of 2^-8,
    the stream's own rounding; median 5.4e-3). So the tolerance is fp32 1.7e-6 and bf16
    0.028: a bf16 stream is exact up to the rounding a dense bf16 wire also has, and a broken
    constraint (O(0.1-1)) is far above either.
    """
    return LEAK_MARGIN * LEAK_MEASURED[dtype]
