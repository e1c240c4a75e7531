"""The wire meter: bytes each stage hands to the wire, per boundary and direction.

Boundary ``b`` sits between stage ``b`` and stage ``b + 1``. Each stage counts what it sends;
``protocol_models.metrics`` sums the counters over the pipeline group at every log step.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from protocol_models.wire.sizes import message_bytes


@dataclass
class WireMeter:
    """Bytes sent since the last ``reset()``, keyed by boundary index.

    ``dense`` holds what the same messages would have cost with a ``dim``-wide activation of the
    same dtype, i.e. an uncompressed boundary.
    """

    dim: int
    fwd: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    bwd: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    dense: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    sync: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    """Bytes a learned boundary sends to keep its two sides' parameters identical
    (``protocol_models.mapl_sync``), apart from the activations."""

    def record(
        self,
        direction: str,
        boundary: int,
        sent: list[torch.Tensor],
        original: list[torch.Tensor] | None = None,
    ) -> None:
        """Count the tensors ``sent``; ``original``: the uncompressed tensors they encode
        (default: ``sent`` itself), whose last dimension the dense figure widens to ``dim``."""
        counter = getattr(self, direction)
        for tensor in sent:
            counter[boundary] += tensor.numel() * tensor.element_size()
        for tensor in sent if original is None else original:
            wide = (*tensor.shape[:-1], self.dim)
            self.dense[boundary] += message_bytes("dense", wide, tensor.dtype, direction, k=0)

    def reset(self) -> None:
        self.fwd.clear()
        self.bwd.clear()
        self.dense.clear()
        self.sync.clear()
