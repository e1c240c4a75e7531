"""What the planner advises beyond the configured layout: the run's length in hours and
GPU-hours, how it moves with MFU, a flag for a stage that computes far more than the others,
a better layout, the disk each node needs for its checkpoints, and, for a layout that does not
fit, its remedies ranked by the memory they leave.

Every alternative is the configured TOML with overrides added (``Variant``), planned by the
same cost model (``cluster.plan``) on the same network (``cluster.network``), so the advice and
the plan can not disagree about what a layout costs.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

from torchtitan.tools import filesystem

from protocol_models.cluster.network import Link
from protocol_models.cluster.plan import (
    GIB,
    StagePlan,
    compute_seconds,
    microbatching,
    plan_stages,
    predict_step,
    propose_split,
)
from protocol_models.model.layout import stage_layer_ranges
from protocol_models.tools.errors import UserError
from protocol_models.training.optimizers import OPTIMIZERS

LOPSIDED = 1.5
"""Flag a stage whose compute per step exceeds the median stage's by this factor."""
BETTER = 1.05
"""Print a layout unasked when it gives this many more tokens per GPU-hour than the
configured one."""

Variant = Callable[[list[str]], object]
"""The configured run with more overrides: ``variant(["--key", "value"])`` -> its config."""
LinksFor = Callable[[object], list[Link]]
"""The boundary links of a layout (``network.boundary_links`` for its stage count)."""


@dataclass(frozen=True)
class RunFigures:
    """The configured run at a predicted step time."""

    hours: float
    gpu_hours: float
    tokens: int


def run_figures(config, step_s: float) -> RunFigures:
    """``training.steps`` steps of ``step_s`` seconds on ``config.world_size`` GPUs, and the
    tokens they train on (every data-parallel replica's batch)."""
    steps = config.training.steps
    hours = steps * step_s / 3600
    tokens = steps * config.replicas * config.training.local_batch_size * config.training.seq_len
    return RunFigures(hours, hours * config.world_size, tokens)


def stage_seconds(config, plans: list[StagePlan], mfu: float) -> list[float]:
    """Each stage's compute per step on one GPU."""
    _, n_mb, _ = microbatching(config)
    return [compute_seconds(config, n_mb * (p.fwd_flops + p.bwd_flops), mfu) for p in plans]


def lopsided(config, plans: list[StagePlan], mfu: float) -> str | None:
    """One line naming the busiest stage when it computes at least ``LOPSIDED`` times the
    median stage (what it holds that the others do not), else None."""
    seconds = stage_seconds(config, plans, mfu)
    median = statistics.median(seconds)
    busiest = max(range(len(plans)), key=seconds.__getitem__)
    if len(plans) < 2 or seconds[busiest] < LOPSIDED * median:
        return None
    holds = {0: " (it holds the embedding)", len(plans) - 1: " (it holds the LM head and the "
             "loss)"}.get(busiest, "")  # fmt: skip
    return (f"lopsided: stage {busiest} computes {seconds[busiest] / median:.1f}x the median "
            f"stage{holds}; every other stage waits for it, a step's compute is its "
            f"{seconds[busiest]:.2f} s")  # fmt: skip


@dataclass(frozen=True)
class Layout:
    """A pipeline layout and its predicted step."""

    stages: int
    split: list[int]
    gpus: int
    step_s: float
    tokens_per_s: float

    @property
    def per_gpu(self) -> float:
        return self.tokens_per_s / self.gpus

    def overrides(self) -> str:
        return (f'--parallelism.pipeline_parallel_degree {self.stages} '
                f'--protocol.layers_per_stage "{self.split}"')  # fmt: skip


def layouts(
    config, variant: Variant, links_for: LinksFor, mfu: float, region: Link
) -> list[Layout]:
    """For every stage count from 2 to the configured one (the same data-parallel degree,
    microbatches and batch), the fastest split that fits (``plan.propose_split``) and its
    predicted step on ``links_for``'s links and the network inside a region ``region``;
    fastest per GPU first."""
    found = []
    for stages in range(2, min(config.layout_stages, config.model.n_layers) + 1):
        try:
            proposal = propose_split(variant(stage_count(config, stages)), mfu)
        except UserError:
            continue
        if proposal is None:
            continue
        candidate = variant(stage_count(config, stages, proposal[0]))
        prediction = predict_step(candidate, plan_stages(candidate), links_for(candidate), mfu,
                                  region)  # fmt: skip
        found.append(Layout(stages, proposal[0], candidate.world_size, prediction["step_s"],
                            prediction["tokens_per_s"]))  # fmt: skip
    return sorted(found, key=lambda layout: -layout.per_gpu)


def stage_count(config, stages: int, split: list[int] | None = None) -> list[str]:
    """Overrides that give ``config`` ``stages`` pipeline stages of ``split`` blocks (default:
    near-equal, as ``layout.stage_layer_ranges`` splits)."""
    if split is None:
        split = [len(r) for r in stage_layer_ranges(config.model.n_layers, stages)]
    layout = ["--protocol.stages", str(stages)] if config.protocol.stages else []
    return ["--parallelism.pipeline_parallel_degree", str(stages), *layout,
            "--protocol.layers_per_stage", str(split)]  # fmt: skip


def checkpoint_disk(config, plans: list[StagePlan]) -> tuple[float, float]:
    """``(bytes of one checkpoint, bytes of storage it needs)``: on the fullest node's disk
    with ``per_node``, else in the shared folder or object store (every node's shards).

    A checkpoint holds its stage's fp32 parameters and optimizer state once (``(4 + o) P``;
    ``o``: the optimizer's ``state_bytes``), spread over the stage's ranks (DCP writes a
    replicated entry once, on one of its replicas: counted here as an even share per rank,
    ``(4 + o) P / (R D T)``); a node holds its ranks' shares. The storage keeps
    ``keep_latest_k`` of them and the next one while it is written (TorchTitan deletes the
    oldest after a save), or, with ``keep_latest_k = 0``, one per interval and the last step's.
    With ``per_node`` and replicas on different nodes each node writes its own copy of the
    replicated entries, which this undercounts."""
    state = 4 + OPTIMIZERS[config.optimizer.name].state_bytes
    par = config.parallelism
    copies = config.replicas * par.tensor_parallel_degree  # every rank's share of its stage
    per_stage = config.world_size // config.layout_stages
    gpus = config.hardware.gpus_per_node
    nodes: dict[int, float] = {}
    for plan in plans:
        for rank in range(plan.stage * per_stage, (plan.stage + 1) * per_stage):
            nodes[rank // gpus] = nodes.get(rank // gpus, 0.0) + state * plan.params / copies
    one = max(nodes.values())
    if not config.checkpoint.per_node or filesystem.is_remote(config.checkpoint.folder):
        one = sum(nodes.values())  # one shared folder or object store: every node's shards
    ckpt = config.checkpoint
    saves = -(-config.training.steps // max(ckpt.interval, 1))  # the last step saves too
    kept = ckpt.keep_latest_k + 1 if ckpt.keep_latest_k else saves
    return one, one * kept


@dataclass(frozen=True)
class Remedy:
    """One change to a layout that does not fit, with the largest stage's memory after it."""

    change: str
    overrides: list[str]
    largest_bytes: float
    fits: bool


def remedies(config, variant: Variant, mfu: float) -> list[Remedy]:
    """Each single change that shrinks the largest stage, planned, smallest result first: a
    balanced split, full activation checkpointing, half the microbatch, the chunked loss, one
    more pipeline stage, twice the FSDP degree; where none fits alone, the pair that leaves
    the least memory and fits."""
    limit = config.hardware.usable_memory_gib * GIB
    par, arch = config.parallelism, config.model
    changes: list[tuple[str, list[str]]] = []
    proposal = propose_split(config, mfu)
    if proposal is not None:
        changes.append(("a balanced split", ["--protocol.layers_per_stage", str(proposal[0])]))
    changes.append(("full activation checkpointing", ["--activation_checkpoint", "full"]))
    if par.pipeline_parallel_microbatch_size > 1:
        half = str(par.pipeline_parallel_microbatch_size // 2)
        changes.append((f"microbatches of {half}",
                        ["--parallelism.pipeline_parallel_microbatch_size", half]))  # fmt: skip
    if hasattr(arch, "loss_chunk_tokens") and not arch.loss_chunk_tokens:
        chunk = str(min(1024, config.training.seq_len))
        changes.append((f"the loss in chunks of {chunk} tokens",
                        ["--model.loss_chunk_tokens", chunk]))  # fmt: skip
    if config.layout_stages < arch.n_layers:
        more = config.layout_stages + 1
        changes.append((f"{more} pipeline stages", stage_count(config, more)))
    shards = str(2 * max(par.data_parallel_shard_degree, 1))
    changes.append((f"FSDP over {shards} GPUs per stage",
                    ["--parallelism.data_parallel_shard_degree", shards]))  # fmt: skip
    found = [_planned(variant, change, overrides, limit) for change, overrides in changes]
    found = [remedy for remedy in found if remedy is not None]
    if found and not any(remedy.fits for remedy in found):  # two changes together
        pairs = [_planned(variant, f"{a} and {b}", [*oa, *ob], limit)
                 for i, (a, oa) in enumerate(changes) for b, ob in changes[i + 1:]]  # fmt: skip
        fitting = [remedy for remedy in pairs if remedy is not None and remedy.fits]
        found += sorted(fitting, key=lambda remedy: remedy.largest_bytes)[:1]
    return sorted(found, key=lambda remedy: remedy.largest_bytes)


def _planned(variant: Variant, change: str, overrides: list[str], limit: float) -> Remedy | None:
    """``change`` planned: the largest stage's bytes with the margin (None: not a valid
    config)."""
    try:
        largest = max(p.total_bytes for p in plan_stages(variant(overrides)))
    except UserError:
        return None
    return Remedy(change, overrides, largest, largest <= limit)
