"""Worker for test_link.py (run under torchrun): a 3-stage 1F1B exchange over a SimulatedLink.

Each stage multiplies by a weight vector, so messages are ``[2, width]`` fp32 both ways. Writes
every rank's delivery log to ``OUT/rank<r>.json``.
    torchrun --nproc_per_node 3 tests/link_exchange.py OUT WIDTH BANDWIDTH_MBPS LATENCY_MS
"""

import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.pipelining import Schedule1F1B

import protocol_models  # noqa: F401  (installs the CPU shim)
from protocol_models.wire import Wire
from protocol_models.wire.link import LinkSettings, SimulatedLink
from protocol_models.wire.meter import WireMeter
from protocol_models.wire.stage import WirePipelineStage


class Scale(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return x * self.weight


def main() -> None:
    out, width, mbps, latency_ms = (
        Path(sys.argv[1]),
        int(sys.argv[2]),
        float(sys.argv[3]),
        float(sys.argv[4]),
    )
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    link = SimulatedLink(LinkSettings(bandwidth_mbps=mbps, latency_ms=latency_ms))
    wire = Wire(meter=WireMeter(dim=width), codec=None, link=link)
    stage = WirePipelineStage(Scale(width), rank, world, torch.device("cpu"), wire=wire)
    schedule = Schedule1F1B(
        stage, n_microbatches=4, loss_fn=lambda y, target: (y - target).pow(2).mean()
    )
    x, target = torch.randn(8, width), torch.zeros(8, width)
    for _ in range(2):
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps([asdict(d) for d in link.log]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
