"""The link simulator: arrivals follow the wire model, and it changes timing only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO, torchrun

from protocol_models.wire.link import (
    LinkSettings,
    arrival,
    rendezvous_period,
    rendezvous_start,
    tcp_wire_bytes,
    transfer_seconds,
)

LATENCY_MS = 50.0


@pytest.mark.parametrize(
    ("case", "width", "mbps"),
    [("latency-bound", 4, 200.0), ("bandwidth-bound", 250_000, 80.0)],
)
def test_arrivals_follow_the_wire_model(tmp_path, case, width, mbps):
    """3 stages, 1F1B: the middle rank receives activations and gradients, each over its own
    link direction. Re-derive every arrival from the sender stamps and receive posts: never
    earlier, and when the receiver waited, no later than the OS can wake a sleeping process on a
    busy 2-core machine (10% of the transfer, at least 25 ms: half a latency, so a wait that
    charged the latency twice would still fail)."""
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
         str(REPO / "tests" / "link_exchange.py"), str(tmp_path), str(width), str(mbps), str(LATENCY_MS)],
        cwd=REPO, check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    settings = LinkSettings(bandwidth_mbps=mbps, latency_ms=LATENCY_MS)
    latency = LATENCY_MS / 1e3
    message_bytes = 2 * width * 4  # one microbatch: [2, width] fp32
    segments = -(-message_bytes // 1448)  # each with 52 B of TCP/IP headers
    serialize = 8 * (message_bytes + 52 * segments) / (mbps * 1e6)
    for rank in range(3):
        log = json.loads((tmp_path / f"rank{rank}.json").read_text())
        inbound = {0: {"bwd"}, 1: {"fwd", "bwd"}, 2: {"fwd"}}[rank]
        assert {d["direction"] for d in log} == inbound
        wire_free: dict[str, float] = {}
        for d in log:
            assert d["nbytes"] == message_bytes
            assert settings.transfer_s(d["boundary"], d["nbytes"]) == pytest.approx(
                serialize + latency
            )
            start = max(wire_free.get(d["direction"], 0.0), d["sent_at"], d["posted_at"] + latency)
            wire_free[d["direction"]] = start + serialize
            assert d["left_at"] == pytest.approx(start + serialize, abs=1e-6)
            assert d["available_at"] == pytest.approx(start + serialize + latency, abs=1e-6)
            assert d["ready_at"] >= d["available_at"] - 1e-6, "delivered before the model allows"
            if d["waited"]:
                late = max(0.1 * (serialize + latency), 0.025)
                assert d["ready_at"] - d["available_at"] <= late, (case, d)
        assert log and sum(d["waited"] for d in log) >= len(log) // 2


@pytest.mark.parametrize(
    ("payload", "on_wire"),
    [
        (0, 0),
        (1, 53),
        (1448, 1500),
        (1449, 1553),
        (16384, 16384 + 12 * 52),
        (524288, 524288 + 363 * 52),
    ],
)
def test_tcp_wire_bytes_add_one_header_per_segment(payload, on_wire):
    """1448-byte segments (MTU 1500 less IPv4, TCP and timestamp headers), 52 B of headers each."""
    assert tcp_wire_bytes(payload) == on_wire


def test_back_to_back_messages_overlap_their_latencies():
    """Latency is charged per message in flight: the second of two messages sent together
    arrives one serialization after the first, not one more latency."""
    first, left = arrival(sent_at=0.0, posted_at=-1.0, wire_free=0.0, serialize_s=0.01,
                          latency_s=0.05)  # fmt: skip
    second, _ = arrival(sent_at=0.0, posted_at=-1.0, wire_free=left, serialize_s=0.01,
                        latency_s=0.05)  # fmt: skip
    assert (first, second) == pytest.approx((0.06, 0.07))
    late, _ = arrival(sent_at=0.0, posted_at=0.02, wire_free=0.0, serialize_s=0.01,
                      latency_s=0.05)  # fmt: skip
    assert late == pytest.approx(0.02 + 0.05 + 0.01 + 0.05)  # ready notice, then the data


def test_transfer_seconds_bills_headers_then_one_latency():
    assert transfer_seconds(1448, 8e6, 0.025) == pytest.approx(1500 / 1e6 + 0.025)
    assert transfer_seconds(10**6, float("inf"), 0.025) == 0.025


def test_rendezvous_start_waits_for_the_receivers_notice():
    """Posted early: the message leaves when sent; posted late: one latency after the post."""
    assert rendezvous_start(sent_at=10.0, posted_at=9.0, latency_s=0.025) == 10.0
    assert rendezvous_start(sent_at=10.0, posted_at=10.5, latency_s=0.025) == 10.525
    assert rendezvous_period(transfer_s=0.4, latency_s=0.025, receiver_s=0.1) == pytest.approx(
        0.525
    )


def test_link_changes_timing_only(tmp_path):
    """Same seed, link off vs 20 Mbit/s + 20 ms losing 5% of its packets: identical losses, and
    the link and what TCP's recovery from the lost packets costs show up in time."""
    off = torchrun(2, tmp_path / "off", "--training.steps", "4")
    link = ["--wan.bandwidth_mbps", "20", "--wan.latency_ms", "20", "--wan.packet_loss", "0.05"]
    on = torchrun(2, tmp_path / "on", "--training.steps", "4", *link)
    assert [r["loss"] for r in on] == [r["loss"] for r in off]
    assert all(r["wan/wire_s"] > 0 and r["wan/wait_s"] > 0 for r in on)
    assert sum(r["wan/loss_s"] for r in on) > 0
    assert "wan/wire_s" not in off[-1]
