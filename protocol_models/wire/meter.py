"""The wire meter: what each stage hands to the wire and how long it waits for it, per boundary
and direction, and the collectives that cross the pipeline's links.

Boundary ``b`` sits between stage ``b`` and stage ``b + 1``. Each stage counts what it sends
(bytes, messages), how long it waited for what it received (from posting the receive to
holding the data) and the collectives it joined over the pipeline group;
``protocol_models.training.metrics`` agrees the counters over the pipeline group at every log step.
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
    (``protocol_models.training.mapl_sync``), apart from the activations."""
    messages: dict[tuple[str, int], int] = field(default_factory=lambda: defaultdict(int))
    """Messages sent, per (direction, boundary): one per microbatch and direction."""
    wait_s: dict[tuple[str, int], float] = field(default_factory=lambda: defaultdict(float))
    """Seconds this stage was blocked waiting for the messages it received, per (direction,
    boundary): in the pre-posted receive's wait, or (just in time) from posting to holding the
    data. Host time: on CUDA a wait is queued on the device and the host is rarely blocked."""
    collectives: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    """Collectives over the pipeline group this stage joined, by what they were for."""
    collective_rounds: int = 0
    """Their latency rounds (``ring_rounds``; the norm exchange: 1)."""

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
        self.messages[(direction, boundary)] += 1
        for tensor in sent:
            counter[boundary] += tensor.numel() * tensor.element_size()
        for tensor in sent if original is None else original:
            wide = (*tensor.shape[:-1], self.dim)
            self.dense[boundary] += message_bytes("dense", wide, tensor.dtype, direction, k=0)

    def waited(self, direction: str, boundary: int, seconds: float) -> None:
        """This stage was blocked ``seconds`` waiting for a ``direction`` message over
        ``boundary``."""
        self.wait_s[(direction, boundary)] += seconds

    def collective(self, purpose: str, rounds: int) -> None:
        """This stage joined one collective over the pipeline group, of ``rounds`` latency
        rounds, for ``purpose`` (e.g. ``grad_norm``, ``metrics``)."""
        self.collectives[purpose] += 1
        self.collective_rounds += rounds

    def reset(self) -> None:
        for counter in (self.fwd, self.bwd, self.dense, self.sync, self.messages, self.wait_s,
                        self.collectives):  # fmt: skip
            counter.clear()
        self.collective_rounds = 0


def ring_rounds(kind: str, ranks: int) -> int:
    """Latency rounds of a ring collective over ``ranks`` ranks: ``2 (P - 1)`` for an
    ``all_reduce`` (reduce-scatter, then all-gather), ``P - 1`` for an ``all_gather``."""
    return {"all_reduce": 2, "all_gather": 1}[kind] * (ranks - 1)
