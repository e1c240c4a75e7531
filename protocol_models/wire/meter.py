"""The wire meter: what each stage hands to the wire and how long it waits for it, per boundary
and direction, and the collectives that cross the pipeline's links.

Boundary ``b`` sits between stage ``b`` and stage ``b + 1``. Each stage counts what it sends
(bytes, messages), how long it waited for what it received (from posting the receive to
holding the data: host time on CPU; on CUDA, where the host does not wait, the stall of the
compute stream between two CUDA events, ``mark``) and the collectives it joined over the
pipeline group;
``protocol_models.training.metrics`` agrees the counters over the pipeline group at every log step.
"""

from __future__ import annotations

import time
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
    waits: dict[tuple[str, int], list[tuple[Mark, Mark]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    """When this stage began and ended waiting for each message it received, per (direction,
    boundary): around the pre-posted receive's wait, or (just in time) from posting to holding
    the data (``mark``: host times on CPU, CUDA events on CUDA; ``wait_seconds``)."""
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

    def waited(self, direction: str, boundary: int, began: Mark, ended: Mark) -> None:
        """This stage waited from ``began`` to ``ended`` (``mark``) for a ``direction`` message
        over ``boundary``."""
        self.waits[(direction, boundary)].append((began, ended))

    def wait_seconds(self, key: tuple[str, int]) -> float:
        """Seconds waited for the (direction, boundary) ``key``'s messages since ``reset``; on
        CUDA this synchronizes with the last of their events (read on log steps only)."""
        return sum(elapsed(began, ended) for began, ended in self.waits[key])

    def collective(self, purpose: str, rounds: int) -> None:
        """This stage joined one collective over the pipeline group, of ``rounds`` latency
        rounds, for ``purpose`` (e.g. ``grad_norm``, ``metrics``)."""
        self.collectives[purpose] += 1
        self.collective_rounds += rounds

    def reset(self) -> None:
        for counter in (self.fwd, self.bwd, self.dense, self.sync, self.messages, self.waits,
                        self.collectives):  # fmt: skip
            counter.clear()
        self.collective_rounds = 0


Mark = float | torch.cuda.Event
"""A moment on a device's clock (``mark``)."""


def mark(device: torch.device) -> Mark:
    """Now, as ``device`` waits: the host time on CPU; on CUDA an event recorded on the current
    stream (a receive's ``wait()`` there returns at once and makes the stream wait)."""
    if device.type != "cuda":
        return time.time()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def elapsed(began: Mark, ended: Mark) -> float:
    """Seconds from ``began`` to ``ended`` (two ``mark``s of one device)."""
    if isinstance(began, float):
        return ended - began
    ended.synchronize()
    return began.elapsed_time(ended) / 1e3


def ring_rounds(kind: str, ranks: int) -> int:
    """Latency rounds of a ring collective over ``ranks`` ranks: ``2 (P - 1)`` for an
    ``all_reduce`` (reduce-scatter, then all-gather), ``P - 1`` for an ``all_gather``."""
    return {"all_reduce": 2, "all_gather": 1}[kind] * (ranks - 1)
