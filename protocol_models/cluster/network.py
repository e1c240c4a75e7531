"""The cluster's network as the planner sees it: one ``Link`` per pipeline boundary.

A run's ranks are stage-major (stage ``s`` holds global ranks ``s R T .. (s + 1) R T - 1``,
``R`` data-parallel replicas of ``T`` tensor-parallel ranks) and fill nodes of
``[hardware] gpus_per_node`` in rank order. Given the nodes per region in node order
(``--regions 4,4``: nodes 0-3 in one region, 4-7 in another), a boundary crosses regions when
the last rank of the stage before it and the first rank of the stage after it sit in different
regions; it then runs over the slow link between regions, every other boundary over the link
inside a region. Without regions every boundary is the slow link (the planner's view before
regions were known).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from protocol_models.tools.errors import UserError

REGION_MBPS = 100_000.0
"""Assumed bandwidth between two nodes of one region, unless ``--region-bandwidth-mbps`` says
otherwise (the report says it assumed it): Google Cloud's maximum for its L4 machines (G2,
100 Gbit/s on the 8-GPU machine type; smaller machine types get less)."""
REGION_LATENCY_MS = 0.5
"""Assumed one-way latency between two nodes of one region."""


@dataclass(frozen=True)
class Link:
    """The network path of one pipeline boundary (or of a data-parallel group inside a region).

    ``mbps``: bandwidth in Mbit/s, ``None`` unlimited; ``latency_ms``: one-way latency;
    ``crosses``: between regions; ``loss``: the probability that a packet is lost
    (``wire.tcp_loss`` models what it costs)."""

    mbps: float | None
    latency_ms: float
    crosses: bool = True
    loss: float = 0.0

    @property
    def bps(self) -> float:
        return self.mbps * 1e6 if self.mbps else math.inf

    @property
    def latency_s(self) -> float:
        return self.latency_ms / 1e3

    def describe(self) -> str:
        speed = f"{self.mbps:g} Mbit/s" if self.mbps else "unlimited bandwidth"
        lost = f", {100 * self.loss:g}% packet loss" if self.loss else ""
        return f"{speed} + {self.latency_ms:g} ms{lost}"


def parse_regions(text: str) -> list[int]:
    """``"4,4"`` -> ``[4, 4]``: nodes per region, in node order, each at least 1."""
    try:
        regions = [int(part) for part in text.split(",")]
    except ValueError:
        regions = []
    if not regions or min(regions) < 1:
        raise UserError(f"--regions {text!r}: give the nodes of each region in node order, "
                        "comma-separated positive integers (e.g. 4,4)")  # fmt: skip
    return regions


def nodes_of(config) -> int:
    """Nodes the run occupies: its processes over ``[hardware] gpus_per_node``."""
    return math.ceil(config.world_size / config.hardware.gpus_per_node)


def _ranks_per_stage(config) -> int:
    """Processes of one pipeline stage; 0 when one process builds every stage (``protocol.stages``
    over ``pipeline_parallel_degree = 1``: no boundary leaves the process)."""
    par = config.parallelism
    if par.pipeline_parallel_degree != config.layout_stages:
        return 0
    return config.world_size // config.layout_stages


def boundary_links(
    config, slow: Link, regions: list[int] | None = None, local: Link | None = None
) -> list[Link]:
    """One ``Link`` per boundary of ``config``'s pipeline (module docstring): ``slow`` where
    the boundary crosses regions (every boundary when ``regions`` is None), ``local`` where it
    does not. A boundary crosses when any of its rank pairs (the stage's rank ``i`` sends to
    the next stage's rank ``i``) sits in two regions. ``regions`` must account for every node
    of the run and keep each stage's ranks in one region, as the launch's placement check
    requires (``training.placement``)."""
    stages = config.layout_stages
    per_stage = _ranks_per_stage(config)
    if regions is None:
        return [slow if per_stage else local or slow] * (stages - 1)
    nodes = nodes_of(config)
    if sum(regions) != nodes:
        raise UserError(f"--regions {','.join(map(str, regions))}: {sum(regions)} nodes, but the "
                        f"run occupies {nodes} ({config.world_size} processes, "
                        f"{config.hardware.gpus_per_node} per node)")  # fmt: skip
    region_of_node = [r for r, count in enumerate(regions) for _ in range(count)]
    gpus = config.hardware.gpus_per_node

    def region(rank: int) -> int:
        return region_of_node[rank // gpus]

    for stage in range(stages if per_stage else 0):
        spans = sorted({region(stage * per_stage + i) for i in range(per_stage)})
        if len(spans) > 1:
            raise UserError(
                f"--regions {','.join(map(str, regions))}: the data-parallel group of pipeline "
                f"stage {stage} (nodes {stage * per_stage // gpus}-"
                f"{((stage + 1) * per_stage - 1) // gpus}) would span regions "
                f"{', '.join(map(str, spans))}, which the launch refuses (its FSDP/replicate "
                "traffic would cross a slow link every step); give region sizes that keep each "
                "stage's nodes in one region"
            )
    return [slow if any(region(b * per_stage + i) != region((b + 1) * per_stage + i)
                        for i in range(per_stage)) else local
            for b in range(stages - 1)]  # fmt: skip


def stage_spans_nodes(config, stage: int) -> bool:
    """Whether ``stage``'s data-parallel ranks sit on more than one node (their FSDP traffic
    then crosses the network inside a region)."""
    per_stage = _ranks_per_stage(config)
    gpus = config.hardware.gpus_per_node
    first = stage * per_stage
    return per_stage > 0 and first // gpus != (first + per_stage - 1) // gpus
