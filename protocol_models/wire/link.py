"""A slow-link simulator at the pipeline stage's send/recv hooks (TOML table ``[wan]``).

The model started as ProtocolNanoGPT's (one latency plus bytes / bandwidth per message); measured
against a real shaped link (``recipes/real_link.py``, results/README.md) it gained the TCP/IP
headers and gloo's receiver-driven rendezvous. It is receiver-side and schedule-agnostic:

* each boundary is a full-duplex link: forward messages over boundary ``b`` (stage ``b`` to
  ``b + 1``) and gradients over it (``b + 1`` to ``b``) travel in its two directions, each
  direction a serialization queue of its own;
* a message sent at ``sent_at`` over boundary ``b``, whose receive was posted at ``posted_at``,
  starts at ``max(rendezvous_start(sent_at, posted_at, latency_b), wire_free)``, occupies its
  direction for ``serialization_seconds(bytes)`` (the payload plus the TCP/IP headers of the
  segments it is cut into, at the rate) and is available one latency after it left
  (``arrival``): latency is charged per message in flight, so messages queued back to back
  overlap their latencies, as on a real link;
* ``rendezvous_start``: gloo's TCP transport is receiver-driven. A receive posts a "ready"
  notice to the sender, and the sender writes the payload only once that notice arrived, so a
  message whose receive is posted late leaves one latency after the post, not when it was sent.
  Which receives are posted early is the stage's business (``[transport] prepost_receives``):
  the simulator sees when each was posted;
* collectives that cross the pipeline's links (the gradient-norm all-reduce every step, the
  metrics gathered at log steps) run over the real process group, then wait ``collective``'s
  latency rounds;
* with ``packet_loss``, every message, every receive's ready notice and every collective round
  also pays what TCP's recovery from random loss costs it (``wire.tcp_loss``): each direction
  of each boundary is a TCP connection whose congestion window carries over from message to
  message, and a message's extra time holds its direction as long as it holds the message (a
  byte stream delivers in order). Every rank draws a collective's extra from the same seeded
  sequence, so the ranks stay in step;
* the sender's wall-clock stamp travels in the message (``wire.message``) and is not billed;
* time really passes: the receiving stage sleeps until the message is available, so step time and
  tokens/s are measured, not computed. Validation (eval mode) runs with the link off.

Stamps use ``time.time()``, taken after the sending device is synchronized; across machines that
assumes synchronized clocks (NTP). The simulator is meant for single-machine benchmarks of a
slow-link deployment.
"""

from __future__ import annotations

import math
import time
import zlib
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from protocol_models.tools.errors import require
from protocol_models.tools.ranges import AT_LEAST_0, Range, Ranges
from protocol_models.wire.tcp_loss import TcpFlow


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
    packet_loss: float = 0.0
    """Probability that each packet is lost, each direction of every boundary (0 = none); TCP's
    recovery is modelled (``wire.tcp_loss``)."""

    RANGES: ClassVar[Ranges] = {
        "bandwidth_mbps": Range(low=0, note="0 = unlimited"),
        "latency_ms": AT_LEAST_0,
        "bandwidth_mbps_per_boundary": Range(low=0, note="0 = unlimited"),
        "latency_ms_per_boundary": AT_LEAST_0,
        "packet_loss": Range(low=0, high=0.5, note="a probability per packet; 0 = none"),
    }

    def check_boundaries(self, n_boundaries: int) -> None:
        """The per-boundary lists hold one value per pipeline boundary."""
        for key in ("bandwidth_mbps_per_boundary", "latency_ms_per_boundary"):
            per = getattr(self, key)
            require(
                not per or len(per) == n_boundaries,
                f"wan.{key} = {per}: expected {n_boundaries} values (one per pipeline boundary)",
            )

    @property
    def enabled(self) -> bool:
        return bool(
            self.bandwidth_mbps
            or self.latency_ms
            or any(self.bandwidth_mbps_per_boundary)
            or any(self.latency_ms_per_boundary)
            or self.packet_loss > 0
        )

    def bandwidth_bps(self, boundary: int) -> float:
        """Bits per second over ``boundary``; ``inf`` when unlimited."""
        per = self.bandwidth_mbps_per_boundary
        mbps = per[boundary] if boundary < len(per) else self.bandwidth_mbps
        return mbps * 1e6 if mbps > 0 else float("inf")

    def latency_s(self, boundary: int) -> float:
        per = self.latency_ms_per_boundary
        return (per[boundary] if boundary < len(per) else self.latency_ms) / 1e3

    def max_latency_s(self) -> float:
        """The longest one-way latency of any boundary (what a collective's round waits for)."""
        return max([self.latency_ms, *self.latency_ms_per_boundary]) / 1e3

    def transfer_s(self, boundary: int, nbytes: int) -> float:
        """Time a message occupies the wire (``transfer_seconds``)."""
        return transfer_seconds(nbytes, self.bandwidth_bps(boundary), self.latency_s(boundary))


TCP_MSS_BYTES = 1448
"""Payload bytes per TCP segment on an Ethernet-sized link (MTU 1500 less 20 B of IPv4, 20 B of
TCP and 12 B of TCP timestamp options)."""
TCP_HEADER_BYTES = 52
"""IPv4 + TCP headers (with timestamps, Linux's default) that every segment carries."""


READY_NOTICE_BYTES = 64
"""Rough size of gloo's ready notice (one segment): what a receive posts to its sender."""


def tcp_segments(nbytes: float) -> int:
    """TCP segments a ``nbytes`` payload is cut into (at least one)."""
    return max(1, math.ceil(nbytes / TCP_MSS_BYTES))


def segment_seconds(bandwidth_bps: float) -> float:
    """Seconds one full segment (payload and headers) occupies a link (0 when unlimited)."""
    return serialization_seconds(TCP_MSS_BYTES, bandwidth_bps)


def tcp_wire_bytes(nbytes: float) -> float:
    """Bytes a ``nbytes`` payload occupies on the wire: cut into ``TCP_MSS_BYTES`` segments, each
    with ``TCP_HEADER_BYTES`` of headers (+3.6% for large messages, one header for small ones)."""
    return nbytes + math.ceil(nbytes / TCP_MSS_BYTES) * TCP_HEADER_BYTES


def serialization_seconds(nbytes: float, bandwidth_bps: float) -> float:
    """Seconds a ``nbytes`` payload occupies the link: its bytes and TCP/IP headers at the rate
    (``inf`` bandwidth: 0)."""
    return 8 * tcp_wire_bytes(nbytes) / bandwidth_bps


def transfer_seconds(nbytes: float, bandwidth_bps: float, latency_s: float) -> float:
    """One message on an idle link whose receive was posted in time: ``serialization_seconds +
    latency``. The planner and the slow-link benchmark use it."""
    return serialization_seconds(nbytes, bandwidth_bps) + latency_s


def rendezvous_start(sent_at: float, posted_at: float, latency_s: float) -> float:
    """The earliest time (s) a message can start crossing the link under gloo's receiver-driven
    transport: when it was sent, or one latency after its receive was posted (the receiver's
    "ready" notice has to reach the sender first), whichever is later. So a receiver that posts
    after the send pays two latencies from its post, one when it posted early enough."""
    return max(sent_at, posted_at + latency_s)


def arrival(
    sent_at: float, posted_at: float, wire_free: float, serialize_s: float, latency_s: float
) -> tuple[float, float]:
    """``(available_at, wire_free)`` of one message on one direction of one link: it starts at
    ``rendezvous_start`` or when the messages ahead of it have left (``wire_free``), occupies the
    link for ``serialize_s``, and arrives one latency after it left. Latency is charged per
    message in flight: messages queued back to back overlap their latencies."""
    start = max(rendezvous_start(sent_at, posted_at, latency_s), wire_free)
    left = start + serialize_s
    return left + latency_s, left


def rendezvous_period(transfer_s: float, latency_s: float, receiver_s: float) -> float:
    """Seconds per microbatch of a link and the stage behind it when that stage posts its next
    receive only after computing the previous microbatch (torch's schedules do, without
    ``[transport] prepost_receives``), and the sender is ahead: the ready notice (one latency),
    the transfer, then the stage's compute."""
    return latency_s + transfer_s + receiver_s


@dataclass
class Delivery:
    """One simulated message, as the receiver saw it (seconds since the epoch)."""

    direction: str
    boundary: int
    nbytes: int
    sent_at: float
    posted_at: float
    """When the receiver posted its receive."""
    left_at: float
    """When its last byte left the sender (the link direction is free again)."""
    available_at: float
    ready_at: float
    """When the receiver went on; equals ``available_at`` (plus sleep jitter) when it waited."""
    waited: bool


class SimulatedLink:
    """The inbound link directions of one rank: forward messages over boundary ``s - 1`` and
    gradients over boundary ``s``, each a direction of its own full-duplex link. The stage hands
    every message it consumes to ``deliver`` (with the sender's stamp and when its receive was
    posted), which sleeps until the model says it has arrived."""

    def __init__(self, settings: LinkSettings):
        self.settings = settings
        self.wire_free: dict[tuple[str, int], float] = {}
        self.flows: dict[tuple[str, int], TcpFlow] = {}
        """The TCP connection of each inbound direction, and of each ready notice's way back
        (``"<direction> notice"``), under ``packet_loss``."""
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.collective_flow = TcpFlow(
            settings.packet_loss, settings.max_latency_s(), segment_seconds(math.inf), seed=0
        )
        """The small messages of the collectives over the slowest boundary: one seeded
        sequence, the same on every rank."""
        self.wait_s = 0.0
        self.wire_s = 0.0
        self.loss_s = 0.0
        """What ``packet_loss`` added: to the messages (also in ``wire_s``), to the ready
        notices (a delay only where a receive was posted late) and to the collectives (also in
        ``collective_s``)."""
        self.collective_s = 0.0
        self.log: list[Delivery] = []

    def reset_counters(self) -> None:
        """Start a new accounting window (the links' state carries over)."""
        self.wait_s = self.wire_s = self.collective_s = self.loss_s = 0.0
        self.log.clear()

    def _flow(self, key: tuple[str, int]) -> TcpFlow:
        """The TCP connection ``key`` (direction or ``"<direction> notice"``, boundary) into this
        rank, made on first use, seeded by its key and this rank (every connection of the run
        loses packets of its own)."""
        if key not in self.flows:
            boundary = key[1]
            self.flows[key] = TcpFlow(
                self.settings.packet_loss,
                self.settings.latency_s(boundary),
                segment_seconds(self.settings.bandwidth_bps(boundary)),
                seed=zlib.crc32(repr((key, self.rank)).encode()),
            )
        return self.flows[key]

    def _loss_extra(self, key: tuple[str, int], nbytes: int) -> float:
        """Seconds packet loss adds to ``nbytes`` over connection ``key`` (0 without loss)."""
        if self.settings.packet_loss <= 0:
            return 0.0
        extra = self._flow(key).extra_s(tcp_segments(nbytes))
        self.loss_s += extra
        return extra

    @staticmethod
    def stamp(device: torch.device) -> torch.Tensor:
        """The sender's clock ``[1]`` float64, packed into the message it goes with.

        On an accelerator the data is produced asynchronously: the current stream is
        synchronized first, so the stamp is the time the message is ready to leave, not the
        (earlier) time its kernels were queued. Only that stream: a device-wide wait would also
        wait for the NCCL receives this stage has posted ahead, whose senders may need this very
        message first. (The simulator exists for benchmarks; the sync is its cost.)"""
        if device.type != "cpu":
            torch.accelerator.current_stream(device).synchronize()
        return torch.tensor([time.time()], dtype=torch.float64, device=device)

    def deliver(
        self, direction: str, boundary: int, nbytes: int, stamp: torch.Tensor, posted_at: float
    ) -> None:
        """Sleep until the ``nbytes`` message ``stamp`` came with is available (``arrival``)."""
        sent_at = float(stamp.item())  # the receiver sleeps on the host: one read per message
        latency = self.settings.latency_s(boundary)
        key = (direction, boundary)
        hold = serialization_seconds(nbytes, self.settings.bandwidth_bps(boundary))
        hold += self._loss_extra(key, nbytes)  # the message holds its connection while it heals
        posted_at += self._loss_extra((f"{direction} notice", boundary), READY_NOTICE_BYTES)
        available, left = arrival(sent_at, posted_at, self.wire_free.get(key, 0.0), hold, latency)
        self.wire_free[key] = left
        self.wire_s += hold + latency
        now = time.time()
        waited = available > now
        if waited:
            time.sleep(available - now)
            self.wait_s += available - now
        self.log.append(
            Delivery(
                direction, boundary, nbytes, sent_at, posted_at, left, available, time.time(),
                waited,
            )
        )

    def collective(self, rounds: int) -> None:
        """Sleep ``rounds`` one-way latencies of the slowest boundary: what a collective over the
        pipeline's links adds to its cost on one machine. Called on every rank right after the
        collective returned (it synchronized them), so the ranks stay in step."""
        wait = rounds * self.settings.max_latency_s() + self._collective_loss(rounds)
        self.collective_s += wait
        time.sleep(wait)

    def _collective_loss(self, rounds: int) -> float:
        """What packet loss adds to ``rounds`` rounds of small messages over the slowest
        boundary, drawn from ``collective_flow``, whose sequence every rank shares."""
        if self.settings.packet_loss <= 0:
            return 0.0
        extra = sum(self.collective_flow.extra_s(1) for _ in range(rounds))
        self.loss_s += extra
        return extra

    def exchange(self, last_sent_at: float) -> None:
        """Sleep until the last of the values other stages sent at ``last_sent_at`` (their
        clocks) has crossed the slowest boundary (``wire.norm_exchange``)."""
        wait = last_sent_at + self.settings.max_latency_s() - time.time()
        wait += self._collective_loss(1)
        if wait > 0:
            self.collective_s += wait
            time.sleep(wait)
