"""Measure a real link between the namespaces of ``recipes.common.tun_relay``: round trip, bulk TCP
rate, and what one gloo message costs (the mechanism behind the link model).

Each probe is one side of a client/server pair; ``recipes/real_link.py`` starts both sides, one
per namespace, and reads the JSON line the measuring side prints:

    python -m recipes.common.link_probe rtt-server | rtt --peer 10.203.0.2
    python -m recipes.common.link_probe bulk-server | bulk --peer 10.203.0.2 --nbytes 2500000
    python -m recipes.common.link_probe gloo --rank 0|1 --master 10.203.0.1 --sizes 64 16384 524288

All times are ``time.time()`` on one machine (both namespaces share its clock).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time

PORT = 29611
GAP_S = 0.3
"""How long one side waits for the other in a gloo trial: longer than TCP's retransmission
timeout at these round trips, so every trial starts from an idle connection, as a pipeline
message after a stage's compute does."""


def rtt_server() -> None:
    """Echo UDP datagrams on ``PORT`` until killed."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", PORT))
    while True:
        data, addr = sock.recvfrom(2048)
        sock.sendto(data, addr)


def rtt(peer: str, count: int = 10) -> dict:
    """Median round trip of a 64-byte UDP datagram, ms (the first, which may meet a server
    still starting, is retried)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(0.5)
    samples = []
    while len(samples) < count:
        start = time.time()
        sock.sendto(b"x" * 64, (peer, PORT))
        try:
            sock.recv(2048)
        except TimeoutError:
            continue
        samples.append((time.time() - start) * 1e3)
        time.sleep(0.05)
    return {"rtt_ms": statistics.median(samples)}


def bulk_server() -> None:
    """Accept TCP connections on ``PORT``; read each to its end, then answer one byte."""
    server = socket.create_server(("0.0.0.0", PORT))
    while True:
        conn, _ = server.accept()
        with conn:
            while conn.recv(1 << 16):
                pass
            conn.sendall(b"k")


def bulk(peer: str, nbytes: int) -> dict:
    """Send ``nbytes`` over one TCP connection; the rate, Mbit/s, from the connect to the
    server's answer less one round trip (the answer's way back and the handshake's)."""
    for _ in range(50):  # the server may still be starting
        try:
            conn = socket.create_connection((peer, PORT), timeout=30)
            break
        except ConnectionRefusedError:
            time.sleep(0.1)
    start = time.time()
    conn.sendall(b"\0" * nbytes)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
    seconds = time.time() - start
    return {"bulk_bytes": nbytes, "bulk_seconds": seconds, "bulk_mbps": 8 * nbytes / seconds / 1e6}


def gloo_trials(rank: int, master: str, sizes: list[int], reps: int) -> dict | None:
    """Time one gloo send/recv per (size, order, rep) between rank 0 (sender) and rank 1.

    Orders: ``recv_first``: the receiver posts its recv ``GAP_S`` before the send, the cost is
    ``done - sent``; ``send_first``: the sender sends ``GAP_S`` before the recv is posted, the
    cost is ``done - posted`` (a link that had carried the message already would make it ~0).
    Every event is scheduled on the shared clock, so neither side waits on the other's message
    to start. Rank 1 returns ``{order: {size: median seconds}}``; rank 0 returns None."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR=master, MASTER_PORT=str(PORT + 1))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    origin = torch.tensor([time.time() + 1.0], dtype=torch.float64)
    dist.broadcast(origin, 0)
    slot, at = 0, float(origin.item())
    costs: dict = {"recv_first": {}, "send_first": {}}
    for size in sizes:
        for order in costs:
            samples = []
            for _ in range(reps):
                start = at + slot * (2 * GAP_S + 8 * size / 1e6 + 0.5)
                slot += 1
                samples.append(_one_trial(rank, order, size, start))
            costs[order][size] = statistics.median(samples) if rank == 1 else None
    dist.destroy_process_group()
    return costs if rank == 1 else None


def _one_trial(rank: int, order: str, nbytes: int, start: float) -> float:
    """One message of ``nbytes`` from rank 0 to rank 1; rank 1 returns its cost (seconds)."""
    import torch
    import torch.distributed as dist

    buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    send_at = start + (GAP_S if order == "recv_first" else 0.0)
    post_at = start + (0.0 if order == "recv_first" else GAP_S)
    if rank == 0:
        _sleep_until(send_at)
        dist.send(buf, 1)
        return 0.0
    _sleep_until(post_at)
    dist.recv(buf, 0)
    return time.time() - max(send_at, post_at)


def _sleep_until(t: float) -> None:
    time.sleep(max(0.0, t - time.time()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("probe", choices=["rtt-server", "rtt", "bulk-server", "bulk", "gloo"])
    parser.add_argument("--peer", default="10.203.0.2")
    parser.add_argument("--nbytes", type=int, default=2_500_000)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--master", default="10.203.0.1")
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 16384, 524288])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if args.probe == "rtt-server":
        rtt_server()
    elif args.probe == "bulk-server":
        bulk_server()
    elif args.probe == "rtt":
        print(json.dumps(rtt(args.peer)), flush=True)
    elif args.probe == "bulk":
        print(json.dumps(bulk(args.peer, args.nbytes)), flush=True)
    else:
        result = gloo_trials(args.rank, args.master, args.sizes, args.reps)
        if result is not None:
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
