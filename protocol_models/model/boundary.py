"""The boundary methods: what a non-last pipeline stage's forward returns.

A ``[protocol] mode`` is either a boundary method (an entry of ``BOUNDARIES``: the model decides
what crosses each boundary, and the wire carries the stage output as it is) or a lossy codec
(``protocol_models.wire.codecs.CODECS``: the dense model, compressed on the wire). An entry says
what the rest of the plugin needs to know without building the model: how wide a boundary
message is (the wire's size model, the planner's kept activations, the GPU check) and which
weight matrices the method adds at each boundary (the planner's closed-form parameters and
FLOPs), and which block class builds its boundaries (``build_model_config``).

* ``subspace``: the k coordinates ``c`` ``[mb, seq, k]`` of the stream in span(U) (the
  constrained writers are narrower, which the planner counts itself);
* ``projected``: the same k coordinates ``c = (x - F[t]) U`` of a stream whose writers are full
  width: only the boundary projects it (``F[t] + U U^T (x - F[t])`` crosses);
* ``dense``: the stream ``x`` ``[mb, seq, d]``;
* ``resbm``: a learned bottleneck ``b`` ``[mb, seq, h]`` with ``h = [protocol] k`` (Residual
  Bottleneck Models, Aboudib et al., arXiv 2604.11947): an encoder ``d -> h`` ends the last block
  before each boundary, a decoder ``h -> d`` starts the first block after it;
* ``mapl``: the coordinates ``c = (x - P[t] Q) U`` ``[mb, seq, r]``, ``r = [protocol] k`` (MAPL,
  Janson et al., arXiv 2606.05484): each side holds its copy of the projection ``U`` ``[d, r]``,
  the anchor mixing ``Q`` ``[m, d]`` and the anchor table ``P`` ``[V, m]`` (a lookup),
  ``m = [protocol] anchor_rank``.

**Adding a boundary method** is one entry here (``register_boundary``) plus its block class in
``protocol_models.model.blocks`` (the entry's ``block``); its name becomes a ``[protocol] mode``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from protocol_models.model.blocks import (
    MaplBlock,
    ProjectedBlock,
    ProtocolBlock,
    ResbmBlock,
    TableBlock,
)


class ProtocolSettings(Protocol):
    """What the entries read of the ``[protocol]`` settings (``protocol.ProtocolSettings``)."""

    k: int
    anchor_rank: int
    rvq_stages: int
    rvq_codebook: int
    stage_tables: bool


Shapes = list[tuple[int, int]]
"""Weight matrices as ``(fan_in, fan_out)``."""


def _no_weights(dim: int, protocol: ProtocolSettings) -> Shapes:
    return []


def _no_lookups(vocab: int, protocol: ProtocolSettings) -> int:
    return 0


def _no_sync(dim: int, vocab: int, protocol: ProtocolSettings) -> tuple[int, int]:
    return 0, 0


@dataclass(frozen=True, kw_only=True)
class BoundaryMethod:
    """One boundary method: its message width and the weights it adds at each boundary."""

    width: Callable[[int, int], int]
    """Features per token of a boundary message (either direction): ``width(d, k)``."""
    width_key: str | None = None
    """How the method names ``[protocol] k`` in labels (``k``, ``h``); None: it ignores k."""
    sender_weights: Callable[[int, ProtocolSettings], Shapes] = _no_weights
    """``(d, protocol) ->`` the matrices it adds to the last block before a boundary."""
    receiver_weights: Callable[[int, ProtocolSettings], Shapes] = _no_weights
    """``(d, protocol) ->`` the matrices it adds to the first block after a boundary."""
    lookups: Callable[[int, ProtocolSettings], int] = _no_lookups
    """``(V, protocol) ->`` table parameters (read by token id, no FLOPs) it adds on each side
    of a boundary."""
    receiver_lookups: Callable[[int, int, ProtocolSettings], int] = lambda v, d, protocol: 0
    """``(V, d, protocol) ->`` table parameters it adds on the receiving side of a boundary
    only (``projected`` or ``dense`` with ``stage_tables``: the stage's own ``[V, d]`` token
    table)."""
    sync_values: Callable[[int, int, ProtocolSettings], tuple[int, int]] = _no_sync
    """``(d, V, protocol) ->`` fp32 values a boundary's two stages exchange once per step apart
    from the activation wire (whatever the batch): ``(sender to receiver, receiver to sender)``,
    sent at the same time."""
    exportable: bool = True
    """Whether a trained model folds into an ordinary LLaMA (``protocol_models.export``)."""
    anchored: bool = False
    """Whether its model holds the frozen ``U`` and ``F`` (``protocol.seed``, ``basis_file``)."""
    quantizable: bool = False
    """Whether ``[codec] bits`` quantizes its messages (k coordinates around ``F``: the
    ``quant`` codec on ``c``, ``protocol_models.wire.codecs``)."""
    block: type[ProtocolBlock] = ProtocolBlock
    """Its blocks (``protocol_models.model.blocks``): ``block.attach`` makes the blocks on each
    side of every boundary; the base block changes none (the stage's own encode and decode,
    ``subspace`` mode, or the plain stream, ``dense``)."""


BOUNDARIES: dict[str, BoundaryMethod] = {}
"""The boundary methods by ``[protocol] mode`` name (filled by ``register_boundary``)."""


def register_boundary(name: str, entry: BoundaryMethod) -> None:
    """Make ``entry`` selectable as ``[protocol] mode = name``."""
    BOUNDARIES[name] = entry


def anchored(mode: str) -> bool:
    """Whether ``mode``'s model holds the frozen ``U`` and ``F`` (``BoundaryMethod.anchored``)."""
    return mode in BOUNDARIES and BOUNDARIES[mode].anchored


def label(mode: str, k: int) -> str:
    """``mode`` with its width, as tables print it: ``subspace k=8``, ``resbm h=8``, ``dense``,
    a codec's name."""
    key = BOUNDARIES[mode].width_key if mode in BOUNDARIES else None
    return f"{mode} {key}={k}" if key else mode


register_boundary(
    "subspace",
    BoundaryMethod(width=lambda dim, k: k, width_key="k", anchored=True, quantizable=True),
)
register_boundary(
    "projected",
    BoundaryMethod(
        width=lambda dim, k: k,
        width_key="k",
        anchored=True,
        quantizable=True,
        exportable=False,
        receiver_lookups=lambda v, d, protocol: v * d if protocol.stage_tables else 0,
        block=ProjectedBlock,
    ),
)
register_boundary(
    "dense",
    BoundaryMethod(
        width=lambda dim, k: dim,
        receiver_lookups=lambda v, d, protocol: v * d if protocol.stage_tables else 0,
        block=TableBlock,
    ),
)
register_boundary(
    "resbm",
    BoundaryMethod(
        width=lambda dim, k: k,
        width_key="h",
        sender_weights=lambda dim, protocol: [(dim, protocol.k)],
        receiver_weights=lambda dim, protocol: [(protocol.k, dim)],
        exportable=False,
        block=ResbmBlock,
    ),
)


def _mapl_weights(dim: int, protocol: ProtocolSettings) -> Shapes:
    """One side's projection ``U`` ``[d, r]`` and anchor mixing ``Q`` ``[m, d]``."""
    return [(dim, protocol.k), (protocol.anchor_rank, dim)]


def _mapl_lookups(vocab: int, protocol: ProtocolSettings) -> int:
    """One side's anchor table ``P`` ``[V, m]``."""
    return vocab * protocol.anchor_rank


def _mapl_sync(dim: int, vocab: int, protocol: ProtocolSettings) -> tuple[int, int]:
    """Each side sends its gradients of ``U``, ``Q`` and ``P`` (dense); with RVQ the sender also
    sends its refreshed codebooks ``[L, K, r]`` (``protocol_models.training.mapl_sync``)."""
    grads = sum(i * o for i, o in _mapl_weights(dim, protocol)) + _mapl_lookups(vocab, protocol)
    return grads + protocol.rvq_stages * protocol.rvq_codebook * protocol.k, grads


register_boundary(
    "mapl",
    BoundaryMethod(
        width=lambda dim, k: k,
        width_key="r",
        sender_weights=_mapl_weights,
        receiver_weights=_mapl_weights,
        lookups=_mapl_lookups,
        sync_values=_mapl_sync,
        exportable=False,
        block=MaplBlock,
    ),
)


__all__ = ["BOUNDARIES", "BoundaryMethod", "anchored", "label", "register_boundary"]
