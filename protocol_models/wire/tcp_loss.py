"""TCP under random packet loss: what lost packets cost a pipeline message (the loss model of the
link simulator, ``[wan] packet_loss``, and of the planner, ``--packet-loss``).

A message crosses one direction of one TCP connection (gloo's pair, NCCL's socket). Without loss
it occupies the link for its serialization and arrives one latency later (``wire.link``). When
each packet is lost independently with probability ``p`` (random loss on a long path, not a full
queue's drops), Linux's TCP (CUBIC, SACK, RACK and tail-loss probes, no slow start after idle as
``wire.transport.tcp_fixes`` recommends) pays in three ways, which ``TcpFlow`` plays out round
trip by round trip:

* the window: each round trip that loses new data multiplies the congestion window by ``BETA``
  (CUBIC's 0.7; a lost resend belongs to the episode it repairs); a round trip without a loss
  grows it by ``ALPHA`` = 3 (1 - BETA) / (1 + BETA) ~ 0.53 segments (CUBIC's Reno-friendly
  region, which governs at windows of tens of segments and round trips of ~100 ms), and only
  when the window limited the sender (Linux's congestion window validation: a sender with
  nothing more to send does not grow it; in slow start it doubles up to twice what is in
  flight). The connection starts warm, at twice the bandwidth-delay product, as the lossless
  link model assumes. Below the bandwidth-delay product a message of ``n`` segments takes
  ``n / W`` round trips: a bulk flow settles near ``sqrt(3 / (2 p))`` segments per round trip
  (Mathis et al., 1997), ~1.4 Mbit/s at 1% loss and a 100 ms round trip, whatever the link's
  rate;
* recovery: a lost segment with a later one delivered is found by SACK and sent again one round
  trip later; a lost tail (nothing after it delivered) waits for the tail-loss probe
  (``probe_timeout``: two round trips, or the retransmission timeout when one segment is
  outstanding), timed from the last ACK of the segments delivered before it;
* timeouts: a lost probe or resend waits for the retransmission timeout (``rto_s``: the round
  trip plus Linux's 200 ms floor), doubled at each repeat, and starts the window again at one
  segment (then slow start up to 0.7 of the window before the loss).

ACKs are taken as never lost (a later cumulative ACK covers a lost one), and every segment as
full-sized. The flow is seeded: a simulated run repeats. ``expected_extra_s`` is the planner's
figure, the mean over a seeded sequence of messages of one size.
"""

from __future__ import annotations

import functools
import math
import random
import statistics

BETA = 0.7
"""CUBIC's multiplicative decrease: the window after a loss, as a share of the window before."""
ALPHA = 3 * (1 - BETA) / (1 + BETA)
"""Segments the window grows per round trip in CUBIC's Reno-friendly region (RFC 9438)."""
INITIAL_WINDOW = 10
"""Linux's initial congestion window, segments."""
RTO_FLOOR_S = 0.2
"""Linux's minimum retransmission timeout (``TCP_RTO_MIN``), added to the smoothed round trip."""
MAX_BACKOFF = 64
"""The largest factor successive timeouts multiply the retransmission timeout by, here."""
MAX_WINDOW = 1e6
"""Window cap, segments, where the link's rate is unlimited."""
LOSSES_TO_AVERAGE = 2000
"""``expected_extra_s`` plays out enough messages to lose about this many segments."""


class TcpFlow:
    """One direction of one TCP connection under random loss ``loss`` over a link of one-way
    ``latency_s`` whose full segment takes ``segment_s`` to serialize. Its congestion window
    carries over from message to message, as the connection's does."""

    def __init__(self, loss: float, latency_s: float, segment_s: float, seed: int = 0):
        self.loss = loss
        self.latency_s = latency_s
        self.rtt_s = 2 * latency_s
        self.segment_s = segment_s
        bdp = self.rtt_s / segment_s if segment_s > 0 else math.inf
        self.max_cwnd = min(max(2 * bdp, INITIAL_WINDOW), MAX_WINDOW)
        """Window cap: twice the bandwidth-delay product (the socket buffers ``tcp_fixes``
        asks for); beyond one product the link's rate limits the sender anyway."""
        self.cwnd = self.max_cwnd
        """The connection starts warm, as the lossless link model assumes (slow start after
        idle off, its first messages long past): only loss shrinks it."""
        self.ssthresh = math.inf
        self.random = random.Random(seed)

    @property
    def rto_s(self) -> float:
        return self.rtt_s + RTO_FLOOR_S

    def probe_timeout(self, outstanding: int) -> float:
        """Linux's tail-loss probe timeout: two round trips, plus the 200 ms floor when one
        segment is outstanding (the receiver may be delaying its ACK), at most the RTO."""
        return min(2 * self.rtt_s + (RTO_FLOOR_S if outstanding == 1 else 0.0), self.rto_s)

    def _lost(self) -> bool:
        return self.random.random() < self.loss

    def _grow(self, sent: int, limited: bool) -> None:
        """A round trip of ``sent`` segments without a loss (``limited``: the window held the
        sender back). Linux grows the window in slow start while it is under twice what is in
        flight, and in congestion avoidance only when it limited the sender."""
        if self.cwnd < self.ssthresh:
            if self.cwnd < 2 * sent:
                self.cwnd = min(self.cwnd + sent, self.ssthresh)
        elif limited:
            self.cwnd += ALPHA * sent / self.cwnd
        self.cwnd = min(self.cwnd, self.max_cwnd)

    def _reduce(self) -> None:
        self.ssthresh = max(2.0, BETA * self.cwnd)
        self.cwnd = self.ssthresh

    def _timeout(self) -> None:
        """The window restarts at one segment; the slow-start threshold stays where the loss
        episode set it (Linux does not cut it again for a timeout inside an episode)."""
        self.cwnd = 1.0

    def send(self, segments: int) -> float:
        """Seconds from the message's first segment leaving until its last one is delivered, for
        a message of ``segments`` full segments (at least one). Lossless with a window of at
        least ``segments``: ``segments x segment_s + latency_s``."""
        t, new, resend, backoff, recovering = 0.0, max(1, segments), 0, 1, False
        while True:
            window = max(1, int(self.cwnd))
            sent = min(window, new + resend)
            retransmitted = min(resend, sent)
            resend, new = resend - retransmitted, new - (sent - retransmitted)
            unsent = new + resend  # goes out in later rounds (and reveals a loss before it)
            lost = [self._lost() for _ in range(sent)]
            serialize = sent * self.segment_s
            if not any(lost):
                self._grow(sent, limited=sent == window and new + resend > 0)
                recovering, backoff = False, 1
                if new + resend == 0:
                    return t + serialize + self.latency_s
                t += max(serialize, self.rtt_s)
                continue
            gone = sum(lost)
            resend += gone
            if not recovering or retransmitted < sent:  # new data lost: a new loss episode
                self._reduce()
            recovering = True
            if unsent > 0 or not all(lost[lost.index(True) :]):  # a later segment reveals it
                t += max(serialize, self.rtt_s)
                continue
            acked = gone < sent  # the probe's timer restarts at the delivered ones' ACKs
            t += serialize + (self.rtt_s if acked else 0.0) + self.probe_timeout(gone)
            while self._lost():  # the probe (or the resend after a timeout) is lost as well
                t += self.rto_s * backoff
                backoff = min(2 * backoff, MAX_BACKOFF)
                self._timeout()
            resend -= 1
            if resend == 0:
                return t + self.segment_s + self.latency_s
            t += self.rtt_s  # the probe's ACK reveals the rest of the loss

    def extra_s(self, segments: int) -> float:
        """``send``'s seconds beyond the lossless ``segments x segment_s + latency_s``."""
        return max(0.0, self.send(segments) - segments * self.segment_s - self.latency_s)


@functools.lru_cache(maxsize=1024)
def expected_extra_s(segments: int, loss: float, latency_s: float, segment_s: float) -> float:
    """Mean seconds ``loss`` adds to a message of ``segments`` segments on a connection that
    carries messages of that size one after another: seeded, over enough messages to lose about
    ``LOSSES_TO_AVERAGE`` segments (at least 400, at most 20,000), the first quarter (the
    window settling) not counted. 0 without loss."""
    if loss <= 0:
        return 0.0
    messages = min(20_000, max(400, math.ceil(LOSSES_TO_AVERAGE / (loss * segments))))
    flow = TcpFlow(loss, latency_s, segment_s)
    extras = [flow.extra_s(segments) for _ in range(messages)]
    return statistics.fmean(extras[messages // 4 :])
