"""Is this backend's point-to-point transport receiver-driven over this link? Two ranks, one
per node, time a message whose receive is posted before it is sent against one whose receive
is posted only after (torch only; no TorchTitan, so it runs on any node with PyTorch).

    # on each of the two nodes (NODE_RANK 0 and 1), across the link the pipeline will use:
    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 1 \
        --master_addr $MASTER --master_port 29620 scripts/p2p_check.py --backend nccl
    # gloo (CPU tensors) instead: --backend gloo

Rank 0 measures on its own clock, so the nodes' clocks need not agree. For each message size
(``--sizes``, bytes) it runs ``--trials`` round trips of two kinds and reports the medians:

* **posted first**: rank 1 posts the receive, tells rank 0, and rank 0 waits ``--gap`` more
  seconds before it sends; rank 1 answers with one byte. Costs ``2 L + w`` (``L``: one-way
  latency; ``w``: the message's time on the wire);
* **posted late**: rank 0 sends a one-byte "go" and the message at once; rank 1 posts the
  message's receive only when "go" arrived, then answers. A **sender-driven** transport has the
  message on its way already (``2 L + w`` again); a **receiver-driven** one (gloo's TCP pairs)
  sends it only once the receive's "ready" notice crossed the link: ``4 L + w``.

``late - first`` per size is the verdict: about ``2 L`` (twice the one-byte round trip's half)
means receiver-driven, about 0 sender-driven. Messages from rank 0 travel on one process group
and the answers on another, so that NCCL (which runs a communicator's operations in the order
they were issued) never queues a receive ahead of a send; both are connected first, one byte
each way. Over NCCL's socket transport a send does not wait for its receive: expect
sender-driven, a late receive costing about nothing (over InfiniBand a send waits for the
receive to be posted: receiver-driven). On NCCL set what the run will use
(e.g. ``NCCL_SOCKET_IFNAME``, ``NCCL_IB_DISABLE=1`` for the socket transport over a WAN).
The last line is the result as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def _device(backend: str) -> torch.device:
    if backend == "nccl":
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _wait(work: dist.Work, device: torch.device) -> None:
    """Block the host until ``work`` is done (on CUDA a wait only orders the streams)."""
    work.wait()
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Pair:
    """The two ranks' messages: ``forth`` carries rank 0 -> 1, ``back`` rank 1 -> 0."""

    def __init__(self, device: torch.device):
        self.device = device
        self.forth = dist.new_group([0, 1])
        self.back = dist.new_group([0, 1])
        self.byte = torch.zeros(1, dtype=torch.uint8, device=device)
        self._connect()

    def _connect(self) -> None:
        """One byte each way, ``forth`` first: NCCL sets up a connection at its first message
        in each direction and blocks both sides until both have issued theirs, so a receive
        posted ahead of a message that needs the peer first would never complete."""
        for group, sender in ((self.forth, 0), (self.back, 1)):
            byte = torch.zeros_like(self.byte)
            if dist.get_rank() == sender:
                _wait(self.send(byte, group), self.device)
            else:
                _wait(self.recv(byte, group), self.device)

    def send(self, t: torch.Tensor, group) -> dist.Work:
        return dist.isend(t, group=group, group_dst=1 - dist.get_rank())

    def recv(self, t: torch.Tensor, group) -> dist.Work:
        return dist.irecv(t, group=group, group_src=1 - dist.get_rank())


def round_trip(pair: Pair, payload: torch.Tensor, late: bool, gap: float) -> float | None:
    """One round trip of ``payload`` (rank 0 returns its seconds, rank 1 None)."""
    byte = torch.zeros_like(pair.byte)
    if dist.get_rank() == 0:
        if not late:  # rank 1's "posted" comes first on ``back``, then its answer
            _wait(pair.recv(torch.zeros_like(pair.byte), pair.back), pair.device)
        answer = pair.recv(byte, pair.back)
        if not late:
            time.sleep(gap)
        start = time.time()
        sent = [pair.send(pair.byte, pair.forth)] if late else []  # "go"
        sent.append(pair.send(payload, pair.forth))  # (a dropped Work cancels its send)
        _wait(answer, pair.device)
        seconds = time.time() - start
        for work in sent:
            _wait(work, pair.device)
        return seconds
    if late:
        _wait(pair.recv(byte, pair.forth), pair.device)  # "go"
        arrived = pair.recv(payload, pair.forth)
    else:
        arrived = pair.recv(payload, pair.forth)
        _wait(pair.send(pair.byte, pair.back), pair.device)  # "posted"
    _wait(arrived, pair.device)
    _wait(pair.send(pair.byte, pair.back), pair.device)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="nccl",
                        help="nccl, gloo, or another in torch's backend registry")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16384, 524288])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--gap", type=float, default=0.3, help="seconds; > a round trip")
    args = parser.parse_args()
    if args.backend not in dist.Backend.backend_list:
        parser.error(f"--backend {args.backend}: expected one of {dist.Backend.backend_list}")
    device = _device(args.backend)
    dist.init_process_group(args.backend, device_id=device if device.type == "cuda" else None)
    if dist.get_world_size() != 2:
        raise SystemExit(f"error: run 2 ranks (one per node), not {dist.get_world_size()}")
    pair = Pair(device)
    result = {"backend": args.backend, "sizes": {}}
    for size in args.sizes:
        payload = torch.zeros(size, dtype=torch.uint8, device=device)
        round_trip(pair, payload, late=False, gap=args.gap)  # warm the connection up
        times = {
            kind: [round_trip(pair, payload, late, args.gap) for _ in range(args.trials)]
            for kind, late in (("first", False), ("late", True))
        }
        if dist.get_rank() == 0:
            result["sizes"][size] = {k: statistics.median(v) for k, v in times.items()}
    if dist.get_rank() == 0:
        one_way = result["sizes"][min(args.sizes)]["first"] / 2
        print(f"{args.backend}: one-way latency ~{1e3 * one_way:.1f} ms (half the smallest "
              "message's round trip, posted first)")  # fmt: skip
        for size, t in result["sizes"].items():
            extra = t["late"] - t["first"]
            print(f"  {size:>9} B: posted first {1e3 * t['first']:8.1f} ms, posted late "
                  f"{1e3 * t['late']:8.1f} ms, late - first {1e3 * extra:7.1f} ms")  # fmt: skip
        extras = [t["late"] - t["first"] for t in result["sizes"].values()]
        driven = "receiver" if statistics.median(extras) > one_way else "sender"
        result.update(one_way_s=one_way, driven=driven)
        print(f"verdict: {driven}-driven (a late receive costs "
              f"{1e3 * statistics.median(extras):.1f} ms more; receiver-driven costs ~2 L = "
              f"{2e3 * one_way:.1f} ms)")  # fmt: skip
        print(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
