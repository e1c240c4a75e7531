"""Where the ranks of a run are, and the one layout a slow link forbids: a stage whose
data-parallel group (FSDP and replicas) spans two regions would send its all-gathers and
reduce-scatters over the slow link every step. ``ProtocolTrainer.check_placement`` gathers a
``RankPlace`` from every rank at start-up; the functions here describe them and name the
problem."""

from __future__ import annotations

from typing import NamedTuple


class RankPlace(NamedTuple):
    """Where one rank runs, as ``check_placement`` gathers it."""

    region: str
    """``$REGION``, else the host name."""
    labelled: bool
    """Whether ``$REGION`` was set."""
    host: str
    node: int
    """The node rank (torchelastic's ``GROUP_RANK``)."""
    stage: int
    """The pipeline stage this rank holds."""


def _ranks_text(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2,5"``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _by_stage(places: list[RankPlace]) -> dict[int, dict[str, list[int]]]:
    """stage -> region -> global ranks, in stage and first-rank order."""
    stages: dict[int, dict[str, list[int]]] = {}
    for rank, place in enumerate(places):
        stages.setdefault(place.stage, {}).setdefault(place.region, []).append(rank)
    return dict(sorted(stages.items()))


def describe_placement(places: list[RankPlace]) -> str:
    """One line: for every stage its ranks, their nodes and regions (index = global rank)."""
    parts = []
    for stage, regions in _by_stage(places).items():
        ranks = [r for rs in regions.values() for r in rs]
        nodes = _ranks_text(sorted({places[r].node for r in ranks}))
        parts.append(
            f"stage {stage}: ranks {_ranks_text(ranks)} on node(s) {nodes} "
            f"(region {' + '.join(regions)})"
        )
    return "; ".join(parts)


def placement_problem(places: list[RankPlace]) -> str | None:
    """The one-line reason to refuse a placement (index = global rank), or None: the first
    stage whose data-parallel group spans more than one region."""
    for stage, regions in _by_stage(places).items():
        if len(regions) < 2:
            continue
        spans = ", ".join(f"{region!r} (ranks {_ranks_text(rs)})" for region, rs in regions.items())
        ranks = [r for rs in regions.values() for r in rs]
        reason = (
            f"the data-parallel group of pipeline stage {stage} spans regions {spans}, so its "
            "FSDP/replicate traffic would cross a slow link every step; number the nodes "
            f"(NODE_RANK) region by region so that ranks {_ranks_text(ranks)} share one region, "
            "or change [parallelism]"
        )
        if not all(places[r].labelled for r in ranks):
            reason += ", and set REGION on every node (unset, a node's region is its host name)"
        return reason
    return None


def interleaved_regions(places: list[RankPlace]) -> str | None:
    """A warning when the labelled regions (``REGION`` on every node) take turns along the
    pipeline, so that more boundaries cross a slow link than the regions need (index = global
    rank); None when each region holds consecutive stages, or a region is unlabelled."""
    if not all(place.labelled for place in places):
        return None
    order = [next(iter(regions)) for regions in _by_stage(places).values()]
    crossings = sum(a != b for a, b in zip(order, order[1:], strict=False))
    needed = len(set(order)) - 1
    if crossings <= needed:
        return None
    return (
        f"the pipeline's stages take turns between regions ({', '.join(order)}): {crossings} "
        f"boundaries cross a slow link where {needed} would; number the nodes (NODE_RANK) region "
        "by region so that each region holds consecutive stages"
    )


__all__ = ["RankPlace", "describe_placement", "interleaved_regions", "placement_problem"]
