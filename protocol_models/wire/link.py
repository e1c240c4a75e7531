"""A slow-link simulator at the pipeline stage's send/recv hooks (TOML table ``[wan]``).

The model started as ProtocolNanoGPT's (one latency plus bytes / bandwidth per message); measured
against a real shaped link (``recipes/real_link.py``, results/README.md) it gained the TCP/IP
headers and gloo's receiver-driven rendezvous. It is receiver-side and schedule-agnostic:

* each rank has **one inbound wire**, shared by forward activations (from rank - 1) and backward
  gradients (from rank + 1);
* a message sent at ``sent_at`` over boundary ``b``, whose receive was posted at ``posted_at``,
  becomes available at ``start + transfer_seconds(bytes)`` with
  ``start = max(wire_free, rendezvous_start(sent_at, posted_at, latency_b))``, and the wire is
  busy until then (latency is serialized: stop-and-wait per message);
* ``transfer_seconds`` = ``8 * tcp_wire_bytes(bytes) / bandwidth_b + latency_b``: the payload
  plus the TCP/IP headers of the segments it is cut into, then one latency;
* ``rendezvous_start``: gloo's TCP transport is receiver-driven. A receive posts a "ready"
  notice to the sender, and the sender writes the payload only once that notice arrived, so a
  message whose receive is posted late leaves one latency after the post, not when it was sent;
* not modelled: collectives (the gradient-norm and non-finite all-reduces, the metrics agreed at
  log steps) run over the real process group, not through this link;
* the sender's wall-clock stamp travels as an extra 8-byte message that is not billed;
* time really passes: the receiving stage sleeps until the message is available, so step time and
  tokens/s are measured, not computed. Validation (eval mode) runs with the link off.

Stamps use ``time.time()``, taken after the sending device is synchronized; across machines that
assumes synchronized clocks (NTP). The simulator is meant for single-machine benchmarks of a
slow-link deployment.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from protocol_models.errors import require


@dataclass(kw_only=True, slots=True)
class LinkSettings:
    """TOML table ``[wan]``. Off unless a bandwidth or latency is set."""

    bandwidth_mbps: float = 0.0
    """Link bandwidth in Mbit/s (0 = unlimited)."""
    latency_ms: float = 0.0
    """One-way latency per message in ms."""
    bandwidth_mbps_per_boundary: list[float] = field(default_factory=list)
    """Optional per-boundary bandwidths (boundary i joins stages i, i + 1); overrides the above."""
    latency_ms_per_boundary: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        for key in ("bandwidth_mbps", "latency_ms"):
            value = getattr(self, key)
            require(value >= 0, f"wan.{key} = {value}: must be >= 0 (0 = unlimited / none)")

    def check_boundaries(self, n_boundaries: int) -> None:
        """The per-boundary lists hold one non-negative value per pipeline boundary."""
        for key in ("bandwidth_mbps_per_boundary", "latency_ms_per_boundary"):
            per = getattr(self, key)
            require(
                not per or (len(per) == n_boundaries and min(per) >= 0),
                f"wan.{key} = {per}: expected {n_boundaries} non-negative values "
                "(one per pipeline boundary)",
            )

    @property
    def enabled(self) -> bool:
        return bool(
            self.bandwidth_mbps
            or self.latency_ms
            or any(self.bandwidth_mbps_per_boundary)
            or any(self.latency_ms_per_boundary)
        )

    def bandwidth_bps(self, boundary: int) -> float:
        """Bits per second over ``boundary``; ``inf`` when unlimited."""
        per = self.bandwidth_mbps_per_boundary
        mbps = per[boundary] if boundary < len(per) else self.bandwidth_mbps
        return mbps * 1e6 if mbps > 0 else float("inf")

    def latency_s(self, boundary: int) -> float:
        per = self.latency_ms_per_boundary
        return (per[boundary] if boundary < len(per) else self.latency_ms) / 1e3

    def transfer_s(self, boundary: int, nbytes: int) -> float:
        """Time a message occupies the wire (``transfer_seconds``)."""
        return transfer_seconds(nbytes, self.bandwidth_bps(boundary), self.latency_s(boundary))


TCP_MSS_BYTES = 1448
"""Payload bytes per TCP segment on an Ethernet-sized link (MTU 1500 less 20 B of IPv4, 20 B of
TCP and 12 B of TCP timestamp options)."""
TCP_HEADER_BYTES = 52
"""IPv4 + TCP headers (with timestamps, Linux's default) that every segment carries."""


def tcp_wire_bytes(nbytes: float) -> float:
    """Bytes a ``nbytes`` payload occupies on the wire: cut into ``TCP_MSS_BYTES`` segments, each
    with ``TCP_HEADER_BYTES`` of headers (+3.6% for large messages, one header for small ones)."""
    return nbytes + math.ceil(nbytes / TCP_MSS_BYTES) * TCP_HEADER_BYTES


def transfer_seconds(nbytes: float, bandwidth_bps: float, latency_s: float) -> float:
    """The link model's time for one message: ``8 * tcp_wire_bytes(bytes) / bandwidth +
    latency`` (``inf`` bandwidth: latency only). The simulator, the planner and the slow-link
    benchmark use it."""
    return 8 * tcp_wire_bytes(nbytes) / bandwidth_bps + latency_s


def rendezvous_start(sent_at: float, posted_at: float, latency_s: float) -> float:
    """The earliest time (s) a message can start crossing the link under gloo's receiver-driven
    transport: when it was sent, or one latency after its receive was posted (the receiver's
    "ready" notice has to reach the sender first), whichever is later. So a receiver that posts
    after the send pays two latencies from its post, one when it posted early enough."""
    return max(sent_at, posted_at + latency_s)


def rendezvous_period(transfer_s: float, latency_s: float, receiver_s: float) -> float:
    """Seconds per microbatch of a link and the stage behind it when that stage posts its next
    receive only after computing the previous microbatch (a pipeline schedule does), and the
    sender is ahead: the ready notice (one latency), the transfer, then the stage's compute."""
    return latency_s + transfer_s + receiver_s


@dataclass
class Delivery:
    """One simulated message, as the receiver saw it (seconds since the epoch)."""

    direction: str
    boundary: int
    nbytes: int
    sent_at: float
    posted_at: float
    """When the receiver posted its receive (the message's recv op was built)."""
    available_at: float
    ready_at: float
    """When the receiver went on; equals ``available_at`` (plus sleep jitter) when it waited."""
    waited: bool


class SimulatedLink:
    """The inbound wire of one rank. Stages register expected messages when they build their
    recv ops and wait for them right before consuming them (``forward_one_chunk`` /
    ``backward_one_chunk``)."""

    def __init__(self, settings: LinkSettings):
        self.settings = settings
        self.wire_free = 0.0
        self.wait_s = 0.0
        self.wire_s = 0.0
        self.log: list[Delivery] = []
        self._pending: dict[tuple[str, int], tuple[int, int, float, torch.Tensor]] = {}

    def reset_counters(self) -> None:
        """Start a new accounting window (the wire's state carries over)."""
        self.wait_s = self.wire_s = 0.0
        self.log.clear()

    @staticmethod
    def stamp_op(data_op: dist.P2POp) -> dist.P2POp:
        """The unbilled 8-byte send of the sender's clock, to the data message's peer.

        On an accelerator the data is produced asynchronously: the device is synchronized
        first, so the stamp is the time the message is ready to leave, not the (earlier) time
        its kernels were queued. (The simulator exists for benchmarks; the sync is its cost.)"""
        tensor = data_op.tensor
        if tensor.device.type != "cpu":
            torch.accelerator.synchronize(tensor.device)
        stamp = torch.tensor([time.time()], dtype=torch.float64, device=tensor.device)
        return dist.P2POp(dist.isend, stamp, data_op.peer, data_op.group)

    def expect_op(
        self, direction: str, chunk: int, boundary: int, data_ops: list[dist.P2POp]
    ) -> dist.P2POp:
        """The matching receive of the stamp; remembers the message, and when its receive is
        posted (now: the schedule posts the ops right after building them), for ``wait``."""
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in data_ops)
        stamp = torch.zeros(1, dtype=torch.float64, device=data_ops[-1].tensor.device)
        self._pending[(direction, chunk)] = (boundary, nbytes, time.time(), stamp)
        return dist.P2POp(dist.irecv, stamp, data_ops[-1].peer, data_ops[-1].group)

    def wait(self, direction: str, chunk: int) -> None:
        """Sleep until message ``(direction, chunk)`` is available on this rank's wire
        (no-op when this stage received nothing for it, e.g. the first stage's forward)."""
        if (direction, chunk) not in self._pending:
            return
        boundary, nbytes, posted_at, stamp = self._pending.pop((direction, chunk))
        sent_at = float(stamp.item())  # the receiver sleeps on the host: one read per message
        latency = self.settings.latency_s(boundary)
        start = max(self.wire_free, rendezvous_start(sent_at, posted_at, latency))
        transfer = self.settings.transfer_s(boundary, nbytes)
        self.wire_free = start + transfer
        self.wire_s += transfer
        now = time.time()
        waited = self.wire_free > now
        if waited:
            time.sleep(self.wire_free - now)
            self.wait_s += self.wire_free - now
        self.log.append(
            Delivery(
                direction,
                boundary,
                nbytes,
                sent_at,
                posted_at,
                self.wire_free,
                time.time(),
                waited,
            )
        )

    def discard(self, direction: str, chunk: int) -> None:
        """Forget an expected message without delay (eval passes run with the link off)."""
        self._pending.pop((direction, chunk), None)
