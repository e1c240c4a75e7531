"""How concentrated a model's residual stream is: the quantities the subspace method rests on.

The method assumes that what the blocks write into the residual stream upstream of the last
pipeline boundary lies in one k-dimensional subspace shared by all of them. Measured on vectors
``x`` ``[n, d]`` through their second moment ``M = x^T x`` ``[d, d]`` (float64, accumulated batch
by batch, so any number of vectors fits in ``d^2`` numbers):

* ``energy_share(M, k)``: the share of ``sum ||x_i||^2`` in the top-k eigenspace of ``M`` (the
  top-k right singular subspace of ``x``), ``sum_{i<k} l_i / sum_i l_i``. Uncentered: the
  subspace the method sends must hold the vectors themselves, not only their spread. Applied to
  the boundary stream with its per-token table part removed, and to the writers' columns
  (``[wo_1 | w2_1 | ...]``: one subspace for all of them, as the method uses);
* ``principal_basis(M, k)``: that subspace as an orthonormal ``[d, k]`` fp32 basis, columns by
  decreasing eigenvalue, each column's largest-magnitude entry positive (a function of ``M``
  alone): a data-driven U (``[protocol] basis_file``);
* ``effective_rank(W)``: the entropy effective rank of one matrix (a residual writer ``wo`` or
  ``w2`` ``[d, in]``), ``exp(H(p))`` with ``p_i = s_i / sum_j s_j`` over its singular values
  (Roy & Vetterli, 2007): ``min(d, in)`` when they are all equal, 1 at rank one.
"""

from __future__ import annotations

import torch


def second_moment(rows: torch.Tensor) -> torch.Tensor:
    """``rows^T rows`` ``[d, d]`` in float64 for ``rows`` ``[n, d]``."""
    rows = rows.detach().double()
    return rows.T @ rows


def _eigen(moment: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (clamped at 0: a second moment has no negative ones, rounding aside) and
    eigenvectors of ``moment``, by decreasing eigenvalue."""
    values, vectors = torch.linalg.eigh(moment.double())
    return values.flip(0).clamp_min(0), vectors.flip(1)


def energy_share(moment: torch.Tensor, k: int) -> float:
    """Share of the vectors' energy (the trace of their second moment ``moment``) in its top-``k``
    eigenspace."""
    values, _ = _eigen(moment)
    return float(values[:k].sum() / values.sum())


def principal_basis(moment: torch.Tensor, k: int) -> torch.Tensor:
    """The top-``k`` eigenspace of the second moment ``moment`` ``[d, d]`` as an orthonormal
    ``[d, k]`` fp32 basis (see the module docstring for the order and signs)."""
    _, vectors = _eigen(moment)
    top = vectors[:, :k]
    largest = top.abs().argmax(dim=0)
    signs = torch.sign(top[largest, torch.arange(k)])
    return (top * signs).float().contiguous()


def effective_rank(matrix: torch.Tensor) -> float:
    """``exp`` of the entropy of the normalized singular values of ``matrix`` ``[m, n]``."""
    s = torch.linalg.svdvals(matrix.detach().double())
    p = s[s > 0] / s.sum()
    return float(torch.exp(-(p * p.log()).sum()))
