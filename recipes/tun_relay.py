"""A real shaped link between two network namespaces: TUN devices and a userspace relay.

    python -m recipes.tun_relay --mbps 10 --delay-ms 25     # as root, until Ctrl-C

Two namespaces, ``pmlink-a`` and ``pmlink-b``, each hold one TUN device (MTU 1500) with a
point-to-point address (``10.203.0.1`` <-> ``10.203.0.2``). This process owns both devices: it
reads every raw IP packet one side sends and writes it to the other side after

* a serialization queue per direction: a packet of ``n`` bytes leaves ``8 n / rate`` seconds after
  the previous one left (or after it arrived, if the wire was idle); a packet that would wait
  longer than ``queue_ms`` behind the ones queued is dropped (a drop-tail buffer, as a router's);
* the one-way delay ``delay_ms`` after it left.

So a round trip costs ``2 * delay_ms`` plus serialization, and bulk TCP runs at the rate. The
kernel has ``tbf`` but no ``netem`` here, hence the relay for the delay. ``LinkNamespaces`` sets
it all up and tears it down (namespaces, devices, the relay process), also after an error.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import fcntl
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
PR_SET_PDEATHSIG = 1
MTU = 1500
NAMESPACES = ("pmlink-a", "pmlink-b")
DEVICES = ("pmtun-a", "pmtun-b")
ADDRESSES = ("10.203.0.1", "10.203.0.2")


@dataclass(frozen=True)
class Shape:
    """One direction's shaping: ``mbps`` Mbit/s (> 0), ``delay_ms`` one way, ``queue_ms`` the
    longest a packet may wait for the wire before it is dropped."""

    mbps: float
    delay_ms: float
    queue_ms: float = 100.0

    def serialize_s(self, nbytes: int) -> float:
        """Seconds one packet of ``nbytes`` bytes occupies the wire."""
        return 8 * nbytes / (self.mbps * 1e6)


class Direction:
    """Packets from one TUN device to the other: a FIFO of ``(deliver_at, packet)``; since the
    delay is constant, packets leave the FIFO in the order they entered it."""

    def __init__(self, shape: Shape, out_fd: int):
        self.shape = shape
        self.out_fd = out_fd
        self.wire_free = 0.0
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.dropped = 0

    def accept(self, packet: bytes, now: float) -> None:
        """Queue ``packet`` (arrived at ``now``) or drop it when the buffer is full."""
        start = max(self.wire_free, now)
        if start - now > self.shape.queue_ms / 1e3:
            self.dropped += 1
            return
        self.wire_free = start + self.shape.serialize_s(len(packet))
        self.queue.append((self.wire_free + self.shape.delay_ms / 1e3, packet))

    def deliver(self, now: float) -> float | None:
        """Write every packet due by ``now``; return when the next one is due (None: empty)."""
        while self.queue and self.queue[0][0] <= now:
            with contextlib.suppress(OSError):  # the peer device went down: as a lost packet
                os.write(self.out_fd, self.queue.popleft()[1])
        return self.queue[0][0] if self.queue else None


def open_tun(name: str) -> int:
    """Create TUN device ``name`` (raw IP packets, no packet-info header); return its fd."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def relay(fds: tuple[int, int], shape: Shape) -> None:
    """Forward packets between the two devices forever (until SIGTERM/SIGINT)."""
    directions = {fds[0]: Direction(shape, fds[1]), fds[1]: Direction(shape, fds[0])}
    due: float | None = None
    while True:
        timeout = None if due is None else max(0.0, due - time.time())
        readable, _, _ = select.select(list(fds), [], [], timeout)
        now = time.time()
        for fd in readable:
            for _ in range(64):  # drain a burst without starving the other side
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                directions[fd].accept(packet, now)
        now = time.time()
        dues = [d for d in (w.deliver(now) for w in directions.values()) if d is not None]
        due = min(dues) if dues else None


def ip(*args: str, check: bool = True) -> None:
    """Run ``ip ARGS`` (quiet); raise on failure when ``check``."""
    subprocess.run(["ip", *args], check=check, capture_output=True)


def configure(side: int) -> None:
    """Move device ``side`` into its namespace, give it its point-to-point address, bring it up."""
    ns, dev = NAMESPACES[side], DEVICES[side]
    ip("link", "set", dev, "netns", ns)
    ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", ns, "addr", "add", ADDRESSES[side], "peer", ADDRESSES[1 - side], "dev", dev)
    ip("-n", ns, "link", "set", dev, "mtu", str(MTU), "up")


def teardown() -> None:
    """Remove both namespaces (their devices go with them); harmless when they do not exist."""
    for ns in NAMESPACES:
        ip("netns", "del", ns, check=False)


def check_privileges() -> str | None:
    """Why this machine cannot build the link (not root, no TUN, no ``ip``), or None."""
    if os.geteuid() != 0:
        return "the real link needs root (network namespaces and TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "no /dev/net/tun: this kernel has no TUN devices"
    try:
        ip("netns", "list")
    except (OSError, subprocess.CalledProcessError):
        return "`ip netns` is unavailable (iproute2 missing or namespaces not permitted)"
    return None


def exit_on_sigterm() -> None:
    """Turn SIGTERM into ``SystemExit`` so that ``finally`` blocks (the teardown) run."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))


def die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when its parent dies (Linux ``prctl``)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def preempt_training() -> None:
    """Run the relay under the real-time FIFO scheduler: it needs little CPU but needs it at
    once, and on a machine whose cores the training processes keep busy, waiting for a time
    slice would add milliseconds of delay to packets at random."""
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))


def serve(shape: Shape) -> None:
    """The relay process: create the devices, signal readiness on stdout, relay until killed."""
    exit_on_sigterm()
    die_with_parent()
    preempt_training()
    fds = (open_tun(DEVICES[0]), open_tun(DEVICES[1]))
    for side in (0, 1):
        configure(side)
    print("ready", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        relay(fds, shape)


@contextlib.contextmanager
def link_namespaces(shape: Shape) -> Iterator[None]:
    """Namespaces ``NAMESPACES`` joined by a relay shaped as ``shape``, for the ``with`` body;
    everything is removed on exit, however the body ends. A leftover from an earlier run that
    died is removed first."""
    teardown()
    for ns in NAMESPACES:
        ip("netns", "add", ns)
    cmd = [sys.executable, "-m", "recipes.tun_relay", "--serve", "--mbps", str(shape.mbps)]
    cmd += ["--delay-ms", str(shape.delay_ms), "--queue-ms", str(shape.queue_ms)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=_repo())
    try:
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the TUN relay did not start (exit {proc.wait()})")
        yield
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)
        if proc.poll() is None:
            proc.kill()
        teardown()


def in_namespace(side: int, cmd: list[str]) -> list[str]:
    """``cmd`` run inside namespace ``side`` (0 or 1)."""
    return ["ip", "netns", "exec", NAMESPACES[side], *cmd]


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbps", type=float, required=True, help="rate, Mbit/s, each direction")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, ms")
    parser.add_argument("--queue-ms", type=float, default=100.0, help="drop-tail buffer, ms")
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = Shape(args.mbps, args.delay_ms, args.queue_ms)
    if args.serve:
        serve(shape)
        return
    problem = check_privileges()
    if problem:
        sys.exit(f"error: {problem}")
    exit_on_sigterm()
    with link_namespaces(shape), contextlib.suppress(KeyboardInterrupt):
        print(f"{NAMESPACES[0]} {ADDRESSES[0]} <-> {NAMESPACES[1]} {ADDRESSES[1]}; Ctrl-C ends")
        signal.pause()


if __name__ == "__main__":
    main()
