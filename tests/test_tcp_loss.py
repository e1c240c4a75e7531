"""The packet-loss model (``wire.tcp_loss``): lossless it is the link model; a lost segment costs
what Linux's recovery costs; a bulk flow settles at the loss-limited rate; the planner's figure
follows."""

from __future__ import annotations

import math
import re

import pytest

from protocol_models.cluster.network import Link
from protocol_models.cluster.plan import message_seconds
from protocol_models.wire.link import segment_seconds, serialization_seconds
from protocol_models.wire.tcp_loss import RTO_FLOOR_S, TcpFlow, expected_extra_s

LATENCY_S = 0.05
SEGMENT_S = segment_seconds(80e6)


class Scripted(TcpFlow):
    """A flow whose segments are lost exactly at the given draws (0-based, in sending order)."""

    def __init__(self, lost_draws: set[int]):
        super().__init__(loss=0.5, latency_s=LATENCY_S, segment_s=SEGMENT_S)
        self.lost_draws, self.draws = lost_draws, 0

    def _lost(self) -> bool:
        self.draws += 1
        return self.draws - 1 in self.lost_draws


def test_without_loss_a_message_costs_its_serialization_and_one_latency():
    flow = TcpFlow(0.0, LATENCY_S, SEGMENT_S)
    assert flow.send(8) == pytest.approx(8 * SEGMENT_S + LATENCY_S)
    assert flow.extra_s(8) == 0.0
    assert expected_extra_s(300, 0.0, LATENCY_S, SEGMENT_S) == 0.0


def test_a_lost_segment_with_a_later_one_delivered_costs_one_round_trip():
    """Segment 3 of 8 lost: SACK finds it, the resend goes one round trip later (to within the
    message's serialization)."""
    assert Scripted({2}).extra_s(8) == pytest.approx(2 * LATENCY_S, abs=8 * SEGMENT_S)


def test_a_timeout_restarts_the_window_but_keeps_the_episode_threshold():
    """A lone segment lost and its probe lost: the window restarts at one segment, the slow-start
    threshold stays at 0.7 of the window before the loss (not cut again by the timeout)."""
    flow = Scripted({0, 1})
    flow.cwnd = 100.0
    flow.send(1)
    assert flow.cwnd == 1.0 and flow.ssthresh == pytest.approx(70.0)


def test_a_lost_tail_waits_for_the_probe_and_a_lost_probe_for_the_timeout():
    """A lone segment lost: the probe fires at the RTO (one segment outstanding); the probe lost
    too: one more RTO. The last of 8 lost: the probe's timer restarts when the other 7 are
    acknowledged, one round trip after the send, and fires one RTO later (one outstanding)."""
    rto, one = 2 * LATENCY_S + RTO_FLOOR_S, pytest.approx
    assert Scripted({0}).extra_s(1) == one(rto, abs=2 * SEGMENT_S)
    assert Scripted({0, 1}).extra_s(1) == one(2 * rto, abs=2 * SEGMENT_S)
    assert Scripted({7}).extra_s(8) == one(2 * LATENCY_S + rto, abs=2 * SEGMENT_S)


@pytest.mark.parametrize("loss", [0.01, 0.02])
def test_a_bulk_flow_settles_near_the_loss_limited_rate(loss):
    """10 MB over an 80 Mbit/s + 100 ms round trip link, after 10 MB that let the window settle
    from its warm start: within 25% of Mathis et al.'s ``MSS / RTT x sqrt(3 / 2p)`` (1.4 Mbit/s
    at 1%), whatever the link's rate."""
    flow = TcpFlow(loss, LATENCY_S, SEGMENT_S, seed=1)
    segments = 10_000_000 // 1448
    flow.send(segments)
    rate = 8 * 1448 * segments / flow.send(segments)
    mathis = 8 * 1448 / (2 * LATENCY_S) * math.sqrt(1.5 / loss)
    assert rate == pytest.approx(mathis, rel=0.25)
    assert rate < 80e6 / 20


def test_a_seeded_flow_repeats():
    flows = [TcpFlow(0.02, LATENCY_S, SEGMENT_S, seed=3) for _ in range(2)]
    runs = [[flow.send(12) for _ in range(50)] for flow in flows]
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_the_planner_adds_the_mean_loss_cost_to_each_message():
    """A 512 kB message over 80 Mbit/s + 50 ms: its serialization without loss; at 1% loss
    the loss-limited rate's several seconds; a 16 kB one at 1% about one round trip more."""
    clean, lossy = Link(80.0, 50.0), Link(80.0, 50.0, loss=0.01)
    assert message_seconds(524_288, clean, replicas=1) == serialization_seconds(524_288, 80e6)
    assert 2.0 < message_seconds(524_288, lossy, replicas=1) < 4.5
    small = message_seconds(16_384, lossy, replicas=1) - message_seconds(16_384, clean, 1)
    assert 0.03 < small < 0.2


def test_the_planner_prices_a_lossy_link_and_says_it_models_cubic(capsys):
    """``--packet-loss 0.01`` on the 2-region 2B plan: the network line names the loss, the
    crossing boundary's messages cost more than on the clean link, and the report says the
    figure is CUBIC's while the config check asks for BBR at this loss."""
    from conftest import REPO

    from protocol_models.cluster.planner import main as plan_main

    toml = str(REPO / "configs/llama3_2b_protocol.toml")
    link = ["--regions", "4,4", "--bandwidth-mbps", "80", "--latency-ms", "50"]
    steps = []
    for loss in ("0", "0.01"):
        assert plan_main(["--toml", toml, *link, "--packet-loss", loss]) == 0
        out = capsys.readouterr().out
        steps.append(float(re.search(r"\| = predicted step time \| [\d.]+ s \| ([\d.]+) s", out)[1]))
    assert "at 80 Mbit/s + 50 ms, 1% packet loss" in out
    assert "the steps above are TCP CUBIC's" in out and "asks for BBR" in out
    assert steps[1] > steps[0]
