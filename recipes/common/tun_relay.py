"""A real shaped network between network namespaces: TUN devices and a userspace relay.

    python -m recipes.common.tun_relay --mbps 10 --delay-ms 25             # as root, until Ctrl-C
    python -m recipes.common.tun_relay --mbps 80 --delay-ms 50 --nodes 3   # three nodes

``nodes`` namespaces (2 to 4), ``pmlink-a``, ``pmlink-b``, ..., each hold one TUN device
(MTU 1500) with an address of ``10.203.0.0/24`` (``10.203.0.1``, ``.2``, ...). This process owns
every device: it reads each raw IPv4 packet a node sends and writes it to the device of the node
it is addressed to, after

* a serialization queue per ordered pair of nodes (every pair has a link of its own, as two
  regions on the internet have a path of their own): a packet of ``n`` bytes leaves
  ``8 n / rate`` seconds after the previous one on that link left (or after it arrived, if the
  link was idle); a packet that would wait longer than ``queue_ms`` behind the ones queued is
  dropped (a drop-tail buffer, as a router's), and counted;
* the one-way delay ``delay_ms`` after it left.

Faults, for ``recipes/faults.py``: the relay takes commands on its stdin, one JSON object per
line: ``{"blackout": seconds}`` drops every packet between every pair for that long (a stall or a
partition: nothing arrives, no reset is sent), ``{"loss": p}`` drops each packet with
probability ``p`` from then on (both directions of every pair; seeded, so runs repeat).

So a round trip costs ``2 * delay_ms`` plus serialization, and bulk TCP runs at the rate. The
kernel has ``tbf`` but no ``netem`` here, hence the relay for the delay. ``link_namespaces``
sets it all up and tears it down (namespaces, devices, the relay process), also after an error,
and reports the relay's drop counts.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import fcntl
import json
import os
import random
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
NAMES = ("a", "b", "c", "d")
NAMESPACES = tuple(f"pmlink-{name}" for name in NAMES)
DEVICES = tuple(f"pmtun-{name}" for name in NAMES)
ADDRESSES = tuple(f"10.203.0.{i + 1}" for i in range(len(NAMES)))
LOCK = "/run/pmlink.lock"
"""Held while a relay is up: a second one would tear the first one's namespaces down."""
SUBNET_BITS = 24
"""Node ``i`` has ``ADDRESSES[i]`` on ``DEVICES[i]`` in ``NAMESPACES[i]``; the last byte is
``i + 1``."""


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
        self.lost = 0
        """Packets dropped by a fault (blackout or random loss), not by the full buffer."""

    def accept(self, packet: bytes, now: float, lose: bool = False) -> None:
        """Queue ``packet`` (arrived at ``now``) or drop it when the buffer is full or ``lose``
        (a fault)."""
        if lose:
            self.lost += 1
            return
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


def destination(packet: bytes) -> int | None:
    """The node an IPv4 packet is addressed to (by the last byte of its destination), or None
    (not IPv4, or outside the nodes)."""
    if len(packet) < 20 or packet[0] >> 4 != 4:
        return None
    node = packet[19] - 1
    return node if 0 <= node < len(ADDRESSES) and packet[16:19] == bytes([10, 203, 0]) else None


class Faults:
    """The faults the relay applies now (module docstring), set by stdin commands."""

    def __init__(self, seed: int = 0):
        self.blackout_until = 0.0
        self.loss = 0.0
        self.random = random.Random(seed)

    def command(self, line: str) -> None:
        """Apply one command line (``{"blackout": s}`` or ``{"loss": p}``)."""
        order = json.loads(line)
        if "blackout" in order:
            self.blackout_until = time.time() + float(order["blackout"])
        if "loss" in order:
            self.loss = float(order["loss"])

    def lose(self, now: float) -> bool:
        """Whether the packet arriving at ``now`` is lost to a fault."""
        if now < self.blackout_until:
            return True
        return self.loss > 0 and self.random.random() < self.loss


def relay(fds: list[int], shape: Shape, control: int | None = None) -> None:
    """Forward packets between the devices ``fds`` (index = node) until SIGTERM/SIGINT, each
    over the link of its (sender, receiver) pair, applying the fault commands read from the
    file descriptor ``control`` (module docstring). It prints ``ready`` on stdout when it can
    take signals; then on SIGUSR1 one JSON line: the packets each link dropped so far,
    ``{"a->b": count}`` (a full buffer's drops; ``"lost"``: the faults' drops, all links)."""
    nodes = len(fds)
    links = {(a, b): Direction(shape, fds[b]) for a in range(nodes) for b in range(nodes) if a != b}
    sender = {fd: node for node, fd in enumerate(fds)}
    faults = Faults()
    pending = b""

    def report(*_) -> None:
        counts = {f"{NAMES[a]}->{NAMES[b]}": link.dropped for (a, b), link in links.items()}
        counts["lost"] = sum(link.lost for link in links.values())
        print(json.dumps(counts), flush=True)

    signal.signal(signal.SIGUSR1, report)
    print("ready", flush=True)
    due: float | None = None
    watched = fds if control is None else [*fds, control]
    while True:
        timeout = None if due is None else max(0.0, due - time.time())
        readable, _, _ = select.select(watched, [], [], timeout)
        now = time.time()
        if control in readable:
            chunk = os.read(control, 4096)
            if not chunk:  # the controller closed it: no more commands
                watched, control = fds, None
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                faults.command(line.decode())
        for fd in readable:
            if fd == control or fd not in sender:
                continue
            for _ in range(64):  # drain a burst without starving the others
                try:
                    packet = os.read(fd, 65536)
                except BlockingIOError:
                    break
                node = destination(packet)
                if node is None or node == sender[fd] or node >= nodes:
                    continue
                links[(sender[fd], node)].accept(packet, now, faults.lose(now))
        now = time.time()
        dues = [d for d in (link.deliver(now) for link in links.values()) if d is not None]
        due = min(dues) if dues else None


def ip(*args: str, check: bool = True) -> None:
    """Run ``ip ARGS`` (quiet); raise on failure when ``check``."""
    subprocess.run(["ip", *args], check=check, capture_output=True)


def configure(node: int) -> None:
    """Move device ``node`` into its namespace, give it its address on the subnet, bring it up."""
    ns, dev = NAMESPACES[node], DEVICES[node]
    ip("link", "set", dev, "netns", ns)
    ip("-n", ns, "link", "set", "lo", "up")
    ip("-n", ns, "addr", "add", f"{ADDRESSES[node]}/{SUBNET_BITS}", "dev", dev)
    ip("-n", ns, "link", "set", dev, "mtu", str(MTU), "up")


def teardown() -> None:
    """Remove every namespace (their devices go with them); harmless when they do not exist."""
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


def serve(shape: Shape, nodes: int) -> None:
    """The relay process: create the devices, relay until killed (``relay`` says ready)."""
    exit_on_sigterm()
    die_with_parent()
    preempt_training()
    fds = [open_tun(DEVICES[node]) for node in range(nodes)]
    for node in range(nodes):
        configure(node)
    with contextlib.suppress(KeyboardInterrupt):
        relay(fds, shape, control=sys.stdin.fileno())


class Relay:
    """The running relay process of ``link_namespaces``."""

    def __init__(self, proc: subprocess.Popen, nodes: int):
        self.proc, self.nodes = proc, nodes

    def fault(self, **order: float) -> None:
        """Send the relay a fault command: ``blackout=seconds`` or ``loss=p`` (module
        docstring)."""
        self.proc.stdin.write(json.dumps(order) + "\n")
        self.proc.stdin.flush()

    def dropped(self) -> dict[str, int]:
        """Packets each link (``"a->b"``) has dropped since the relay started (and ``"lost"``:
        to faults, all links)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            line = self.proc.stdout.readline()
            if line:
                return json.loads(line)
        raise RuntimeError(f"the TUN relay exited (code {self.proc.wait()})")


@contextlib.contextmanager
def link_namespaces(shape: Shape, nodes: int = 2) -> Iterator[Relay]:
    """``nodes`` namespaces (of ``NAMESPACES``) joined by a relay shaped as ``shape``, for the
    ``with`` body; everything is removed on exit, however the body ends. A leftover from an
    earlier run that died is removed first."""
    if not 2 <= nodes <= len(NAMESPACES):
        raise ValueError(f"nodes = {nodes}: the relay joins 2 to {len(NAMESPACES)} nodes")
    lock = open(LOCK, "w")  # noqa: SIM115 (held for the body, closed in finally)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise RuntimeError(f"another shaped link is up ({LOCK} is locked): one at a time") from None
    cmd = [sys.executable, "-m", "recipes.common.tun_relay", "--serve", "--mbps", str(shape.mbps)]
    cmd += ["--delay-ms", str(shape.delay_ms), "--queue-ms", str(shape.queue_ms)]
    cmd += ["--nodes", str(nodes)]
    proc = None
    try:
        teardown()
        for ns in NAMESPACES[:nodes]:
            ip("netns", "add", ns)
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                cwd=_repo())  # fmt: skip
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the TUN relay did not start (exit {proc.wait()})")
        yield Relay(proc, nodes)
    finally:
        if proc is not None:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
            if proc.poll() is None:
                proc.kill()
        teardown()
        lock.close()


def in_namespace(node: int, cmd: list[str]) -> list[str]:
    """``cmd`` run inside node ``node``'s namespace."""
    return ["ip", "netns", "exec", NAMESPACES[node], *cmd]


def _repo() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mbps", type=float, required=True, help="rate, Mbit/s, each direction")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, ms")
    parser.add_argument("--queue-ms", type=float, default=100.0, help="drop-tail buffer, ms")
    parser.add_argument("--nodes", type=int, default=2, choices=range(2, len(NAMES) + 1),
                        help="namespaces")  # fmt: skip
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = Shape(args.mbps, args.delay_ms, args.queue_ms)
    if args.serve:
        serve(shape, args.nodes)
        return
    problem = check_privileges()
    if problem:
        sys.exit(f"error: {problem}")
    exit_on_sigterm()
    with link_namespaces(shape, args.nodes), contextlib.suppress(KeyboardInterrupt):
        nodes = ", ".join(f"{NAMESPACES[n]} {ADDRESSES[n]}" for n in range(args.nodes))
        print(f"{nodes}: every pair over its own link; Ctrl-C ends")
        signal.pause()


if __name__ == "__main__":
    main()
