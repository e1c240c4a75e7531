"""How the pipeline's messages travel (TOML table ``[transport]``) and whether this node's TCP
settings let a long fat link run at its rate.

On a link of ``R`` bit/s and one-way latency ``L``, TCP keeps at most one socket buffer of
unacknowledged bytes in flight, so it needs buffers of at least the bandwidth-delay product
``R * 2L / 8`` (twice that leaves room for loss recovery) to reach the rate; Linux's default
``tcp_slow_start_after_idle = 1`` restarts every burst after an idle spell from the initial
window of 10 segments, which costs a pipeline message several round trips; and BBR paces every
burst at its estimate of the path's rate, which the pipeline's short bursts between idle spells
(an application-limited flow) keep far below the link's, so each message is spread over much
of a round trip -- a loss-based congestion control (CUBIC, Linux's default) sends a message
that fits its window at once. On a link that loses packets at random it is the other way round:
CUBIC shrinks its window at every loss and settles near ``sqrt(3 / 2p)`` segments per round
trip (``wire.tcp_loss``), while BBR, which does not read loss as congestion, keeps its rate; so
for a link stated to lose at least ``LOSSY_LINK`` of its packets the advice is BBR
(docs/multinode.md#packet-loss). ``tcp_advice`` reads this node's settings and returns the one
line that fixes them, or None.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from protocol_models.tools.ranges import AT_LEAST_1, Range, Ranges

SYSCTL_ROOT = Path("/proc/sys")


@dataclass(kw_only=True, slots=True)
class TransportSettings:
    """TOML table ``[transport]``."""

    prepost_receives: bool = True
    """gloo: post all of a step's receives when its first is requested (the forward ones
    already when the previous training step's schedule finished), each waited right before its
    microbatch's compute (``wire.stage``); false: each just before its compute, as torch's
    schedules do, which costs one more latency per message under gloo. NCCL always posts just
    in time (a pending NCCL receive holds any device-wide synchronization; its socket transport
    does not wait for the receive)."""
    exchange_grad_norm: bool = True
    """Reduce the gradient norm over the pipeline stages by an exchange of messages
    (``wire.norm_exchange``: pre-posted on gloo, one batch at the clipping on NCCL; no latency
    on the step; a log step's metrics travel with it) instead of TorchTitan's all-reduce (about
    one round trip per ring step). The sum is the same on every stage; for two stages it equals
    the all-reduce's bit for bit, for more it may differ in the last bit (another order)."""
    link_mbps: float = 0.0
    """The slowest real link between two nodes of the run, Mbit/s (0: not stated). With
    ``link_latency_ms`` the config check compares this node's TCP settings with the link's
    bandwidth-delay product and prints the ``sysctl`` line that fixes them."""
    link_latency_ms: float = 0.0
    """That link's one-way latency in ms."""
    link_packet_loss: float = 0.0
    """The share of that link's packets lost at random (0: none stated); from
    ``LOSSY_LINK`` on, the TCP advice is BBR instead of CUBIC; the planner's default
    ``--packet-loss``."""
    async_hop_depth: int = 1
    """Under ``[parallelism] pipeline_parallel_schedule = "Async1F1B"``: how many microbatches
    each stage's backwards trail the next stage's (``wire.async_schedule``: stage ``s`` trails its
    own forwards by ``(S - 1 - s)`` times this). No stage waits for a gradient when it is at least
    ``ceil((2 (L + x) + f + b) / T)``; ``python -m protocol_models.plan`` prints that value for
    the config's link. The first stage's depth must stay below the microbatches per step."""

    stall_bound_steps: float = 5.0
    """A training step that runs longer than this many median steps plus
    ``stall_bound_floor_seconds`` (plus twice the time since the previous step: a checkpoint
    save, a validation) ends the worker with one line naming the message and peer it waits for,
    exit code 3, so that ``--max-restarts`` restarts the run from its last complete checkpoint
    (``training.stall_watch``). Armed from a process's 5th step. 0: off, a silent peer is
    noticed only after ``[comm] train_timeout_seconds``."""
    stall_bound_floor_seconds: float = 60.0
    """The bound's fixed part, seconds: room for what a median step does not show (a cold
    compile after a shape change, a slow disk, a TCP retransmission after a short stall)."""

    RANGES: ClassVar[Ranges] = {
        "async_hop_depth": AT_LEAST_1,
        "stall_bound_steps": Range(low=0, note="0 = off"),
        "stall_bound_floor_seconds": Range(low=1),
        "link_mbps": Range(low=0, note="0 = not stated"),
        "link_latency_ms": Range(low=0, note="0 = not stated"),
        "link_packet_loss": Range(low=0, high=0.5, note="a probability per packet; 0 = none"),
    }

    @property
    def link_stated(self) -> bool:
        return self.link_mbps > 0 and self.link_latency_ms > 0


LOSSY_LINK = 0.01
"""Packet loss from which the advice is BBR: on the real shaped link at 80 Mbit/s + 50 ms and 1%
loss, BBR trained both the compressed and the dense 2-stage run faster than CUBIC
(results/README.md, real link)."""


def bdp_bytes(mbps: float, latency_ms: float) -> int:
    """The bandwidth-delay product of a link: bytes in flight over one round trip."""
    return int(mbps * 1e6 / 8 * 2 * latency_ms / 1e3)


def read_sysctl(name: str, root: Path = SYSCTL_ROOT) -> str | None:
    """The value of sysctl ``name`` (``net.ipv4.tcp_rmem``) on this node, None if unreadable."""
    try:
        return (root / name.replace(".", "/")).read_text().strip()
    except OSError:
        return None


def tcp_fixes(
    mbps: float, latency_ms: float, root: Path = SYSCTL_ROOT, loss: float = 0.0
) -> dict[str, str]:
    """The sysctl settings to change on this node for a ``mbps`` + ``latency_ms`` link losing
    ``loss`` of its packets, with their new values: slow start after idle off, buffer maxima of
    at least twice the bandwidth-delay product, and, where the kernel offers it, CUBIC instead
    of BBR (module docstring: BBR's pacing delays each pipeline message) -- or, from
    ``LOSSY_LINK`` on, BBR instead of any other."""
    want = 2 * bdp_bytes(mbps, latency_ms)
    fixes: dict[str, str] = {}
    if read_sysctl("net.ipv4.tcp_slow_start_after_idle", root) not in (None, "0"):
        fixes["net.ipv4.tcp_slow_start_after_idle"] = "0"
    for name in ("net.core.wmem_max", "net.core.rmem_max"):
        value = read_sysctl(name, root)
        if value is not None and int(value) < want:
            fixes[name] = str(want)
    for name in ("net.ipv4.tcp_wmem", "net.ipv4.tcp_rmem"):
        value = read_sysctl(name, root)
        if value is not None:
            low, default, high = (int(v) for v in value.split())
            if high < want:
                fixes[name] = f"{low} {default} {want}"
    available = (read_sysctl("net.ipv4.tcp_available_congestion_control", root) or "").split()
    current = read_sysctl("net.ipv4.tcp_congestion_control", root)
    wanted = "bbr" if loss >= LOSSY_LINK else "cubic"
    if current != wanted and wanted in available and (current == "bbr" or wanted == "bbr"):
        fixes["net.ipv4.tcp_congestion_control"] = wanted
    return fixes


def tcp_advice(
    mbps: float, latency_ms: float, root: Path = SYSCTL_ROOT, loss: float = 0.0
) -> str | None:
    """One line: what this node's TCP settings lack for the link, and the command that fixes
    them (None: nothing to fix)."""
    fixes = tcp_fixes(mbps, latency_ms, root, loss)
    if not fixes:
        return None
    assignments = " ".join(
        f"{name}={value!r}" if " " in value else f"{name}={value}" for name, value in fixes.items()
    )
    return (
        f"warning: this node's TCP settings slow a {mbps:g} Mbit/s + {latency_ms:g} ms link"
        f"{f' losing {100 * loss:g}% of its packets' if loss else ''} "
        f"(bandwidth-delay product {bdp_bytes(mbps, latency_ms) / 1e6:.2f} MB; see "
        f"docs/multinode.md#tcp-on-long-fat-links); as root: sysctl -w {assignments}"
    )
