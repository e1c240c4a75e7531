"""The dry-run planner's command: check a layout and its cluster before paying for GPUs.

    python -m protocol_models.plan --toml FILE [--regions N,N,..] [--bandwidth-mbps B]
        [--latency-ms L] [--packet-loss P] [--region-bandwidth-mbps B] [--region-latency-ms L]
        [--mfu F] [--propose-split] [--ratio R] [overrides]

Prints, from the cost model (``cluster.plan``) on the cluster's network (``cluster.network``):
the layout and per stage its parameters, memory terms, fit and compute, and the NCCL
communicators its GPU holds with their buffers (an estimate); the wire bytes per boundary; the
predicted step of the configured model next to its twin (dense for a subspace or lossy mode,
subspace for dense) split into its terms, with the configured run's hours, GPU-hours and tokens,
and the ``Async1F1B`` step of the same stages; what that prediction assumes, the config check's
refusal where it does not run the layout, and the schedule it recommends; then the advice
(``cluster.advice``): how the run's length moves with the assumed MFU, a flag for a lopsided
stage, a layout giving more tokens per GPU-hour, the disk each node needs for its checkpoints,
and, where a stage does not fit, the remedies ranked by the memory they leave. Exits 1 if a
stage does not fit, 2 on bad input.

``--ratio R`` chooses k for a requested compression (``subspace`` and ``projected`` modes): the
widest wire whose 8-bit coordinates are at least R times fewer boundary bytes than dense, since
at the same bytes the wider 8-bit wire trained better than the exact one (the quality-gap
study); the plan is then that config's, and the line before it names the k exact coordinates
would carry at the same ratio.

The slow link between regions is ``--bandwidth-mbps``/``--latency-ms``, else the config's
``[transport] link_mbps``/``link_latency_ms``, losing ``--packet-loss`` (else ``[transport]
link_packet_loss``) of its packets (TCP's recovery modelled by ``wire.tcp_loss``);
``--regions`` (nodes per region, in node order) says which boundaries cross it, the others run
at ``--region-bandwidth-mbps``/``--region-latency-ms`` (assumed 100 Gbit/s and 0.5 ms unless
given, and the report says so).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from protocol_models.cluster.advice import (
    BETTER,
    checkpoint_disk,
    layouts,
    lopsided,
    remedies,
    run_figures,
    stage_seconds,
)
from protocol_models.cluster.network import (
    REGION_LATENCY_MS,
    REGION_MBPS,
    Link,
    boundary_links,
    parse_regions,
)
from protocol_models.cluster.plan import (
    ASSUMED_PEAK_TFLOPS,
    GIB,
    NCCL_CHANNELS,
    NCCL_VERSION,
    StagePlan,
    async_config,
    fsdp_bytes,
    fsdp_seconds,
    microbatching,
    peak_tflops,
    plan_stages,
    predict_async_step,
    predict_step,
    propose_split,
    twin,
    wire_plan,
)
from protocol_models.config.run_config import check_async, load_config, split_argv
from protocol_models.model.boundary import BOUNDARIES, label
from protocol_models.tools.errors import UserError
from protocol_models.wire import codec_for
from protocol_models.wire.async_schedule import ASYNC_SCHEDULE
from protocol_models.wire.transport import LOSSY_LINK

DEFAULT_MFU = 0.4
"""The fraction of the peak the planner assumes unless given ``--mfu``."""
MIB = 1024**2
ASYNC_SETTINGS = (("parallelism", "pipeline_parallel_schedule"), ("transport", "async_hop_depth"),
                  ("optimizer", "weight_prediction"))  # fmt: skip
"""The ``(table, key)`` settings ``plan.async_config`` changes."""


def mode_label(config) -> str:
    """The mode's label, with its bits where its codec quantizes (not the dense twin's)."""
    protocol, bits = config.protocol, config.codec.bits
    quantized = bits and getattr(codec_for(config), "bits", None) == bits
    return label(protocol.mode, protocol.k) + (f" {bits}-bit" if quantized else "")


def _assumed_peak(hardware) -> list[str]:
    """The report's line saying the compute estimate assumed ``ASSUMED_PEAK_TFLOPS`` (none
    where ``[hardware] peak_tflops`` is set)."""
    if hardware.peak_tflops is not None:
        return []
    return [f"assumed: {ASSUMED_PEAK_TFLOPS:g} TFLOP/s peak per GPU (an NVIDIA L4's dense "
            "bf16), since [hardware] peak_tflops is unset: set it for your GPU"]  # fmt: skip


def _ranges(ids: list[int]) -> str:
    """``[0, 1, 2, 4, 5]`` -> ``"0-2, 4-5"``."""
    parts, start = [], None
    for i, b in enumerate(ids):
        start = b if start is None else start
        if i + 1 == len(ids) or ids[i + 1] != b + 1:
            parts.append(f"{start}" if start == b else f"{start}-{b}")
            start = None
    return ", ".join(parts)


def describe_network(
    links: list[Link], local: Link, local_assumed: bool, source: str, fsdp: bool,
    regions_known: bool,
) -> str:  # fmt: skip
    """One line: which boundaries cross regions at what link, and the network inside a region
    where boundaries or FSDP (``fsdp``) use it."""
    crossing = [b for b, link in enumerate(links) if link.crosses]
    inside = [b for b, link in enumerate(links) if not link.crosses]
    parts = []
    if crossing:
        word = "boundary" if len(crossing) == 1 else "boundaries"
        slow = links[crossing[0]].describe()
        where = f"{word} {_ranges(crossing)} between regions" if regions_known else (
            "every boundary (no --regions)")  # fmt: skip
        parts.append(f"{where} at {slow} ({source})")
    users = ([f"boundar{'y' if len(inside) == 1 else 'ies'} {_ranges(inside)}"] if inside
             else []) + (["FSDP"] if fsdp else [])  # fmt: skip
    if users:
        assumed = (" (assumed: set --region-bandwidth-mbps and --region-latency-ms)"
                   if local_assumed else "")  # fmt: skip
        parts.append(f"{' and '.join(users)} inside a region at {local.describe()}{assumed}")
    return "network: " + ("; ".join(parts) if parts else "one stage, no boundary")


def render(
    config, plans: list[StagePlan], wire: dict, predictions: dict[str, dict], network: str,
    region: Link, mfu: float,
) -> str:  # fmt: skip
    """The planner's report: layout, the per-stage table, wire bytes, predicted step times and
    the configured run's length."""
    hw, par, arch = config.hardware, config.parallelism, config.model
    dp, world = config.replicas, config.world_size
    _, n_mb, _ = microbatching(config)
    ac = config.activation_checkpoint
    ac_name = {FullAC.Config: "full", SelectiveAC.Config: "selective"}.get(type(ac), "none")
    nccl_column = ["NCCL"] if any(p.communicators for p in plans) else []
    lines = [
        f"model: d={arch.dim}, {arch.n_layers} layers, vocab {arch.vocab_size}, "
        f"{mode_label(config)}",
        f"total parameters: {sum(p.params for p in plans):,}",
        f"layout: {config.layout_stages} pipeline stages x {dp} data-parallel = {world} GPUs "
        f"({hw.gpus_per_node} per node, {hw.usable_memory_gib:g} GiB usable and "
        f"{peak_tflops(hw):g} TFLOP/s peak each); blocks per stage "
        f"{[len(p.layers) for p in plans]}; {n_mb} microbatches of "
        f"{par.pipeline_parallel_microbatch_size} x {config.training.seq_len} tokens, "
        f"{par.pipeline_parallel_schedule}, activation_checkpoint {ac_name}, "
        f"loss_chunk_tokens {getattr(arch, 'loss_chunk_tokens', 0)}",
        *_assumed_peak(hw),
        network,
        "",
        "memory per GPU in GiB (fits: total incl. CUDA context and NCCL buffers x 1.10 <= "
        f"{hw.usable_memory_gib:g}); compute per GPU per step at MFU {mfu:g}",
        "",
        "| stage | layers | ranks (nodes) | params | "
        + " | ".join([*plans[0].memory, *nccl_column])
        + " | total x1.10 | fits | TFLOP/step | compute s/step |",
        "|---" * (8 + len(plans[0].memory) + len(nccl_column)) + "|",
    ]
    for p, seconds in zip(plans, stage_seconds(config, plans, mfu), strict=True):
        first_rank = p.stage * dp * par.tensor_parallel_degree
        last_rank = first_rank + dp * par.tensor_parallel_degree - 1
        nodes = f"{first_rank // hw.gpus_per_node}-{last_rank // hw.gpus_per_node}"
        fits = p.total_bytes <= hw.usable_memory_gib * GIB
        terms = [*p.memory.values(), *([p.nccl_bytes] if nccl_column else [])]
        mem = " | ".join(f"{v / GIB:.2f}" for v in terms)
        flops = n_mb * (p.fwd_flops + p.bwd_flops)
        lines.append(
            f"| {p.stage} | {p.layers.start}-{p.layers.stop - 1} "
            f"| {first_rank}-{last_rank} ({nodes}) | {p.params:,} | {mem} "
            f"| {p.total_bytes / GIB:.2f} | {'yes' if fits else 'NO'} "
            f"| {flops / 1e12:,.1f} | {seconds:.2f} |"
        )
    lines += nccl_lines(plans)
    spanning = [p for p in plans if fsdp_seconds(config, p, region)]
    if spanning:
        biggest = max(spanning, key=lambda p: p.params)
        gather, reduce = fsdp_bytes(config, biggest.params)
        lines += ["", f"FSDP inside a region: the data-parallel ranks of stage {biggest.stage} "
                  f"span nodes and each sends {gather / 1e9:,.1f} GB all-gather + "
                  f"{reduce / 1e9:,.1f} GB gradient reduction per step"]  # fmt: skip
    sync = (
        f"; plus {wire['sync_per_boundary_bytes'] / 1e6:,.1f} MB of weight gradients "
        "exchanged per step (both directions)"
        if wire["sync_per_boundary_bytes"]
        else ""
    )
    steps = config.training.steps
    tokens = run_figures(config, 1.0).tokens
    lines += [
        "",
        f"wire per boundary per step (fwd + bwd, all {dp} data-parallel replicas): "
        f"{wire['per_boundary_bytes'] / 1e6:,.1f} MB ({config.protocol.mode}) vs "
        f"{wire['dense_per_boundary_bytes'] / 1e6:,.1f} MB dense -> {wire['ratio']:.1f}x; "
        f"one message {wire['message_bytes'] / 1e3:,.1f} kB{sync}",
        "",
        f"predicted step on this layout and network, MFU {mfu:g} of {peak_tflops(hw):g} "
        f"TFLOP/s; the configured run: {steps:,} steps, {tokens / 1e9:,.2f} B tokens",
        "",
        "| | " + " | ".join(predictions) + " |",
        "|---" * (1 + len(predictions)) + "|",
    ]
    rows = [
        ("busiest stage compute per step", lambda r: f"{r['busiest_compute_s']:.2f} s"),
        ("one forward message on the slowest link", lambda r: f"{r['link_s']:.3f} s"),
        ("step: compute (slowest stage x M)", lambda r: f"{r['compute_s']:.2f} s"),
        ("+ bubble (pipeline fill and drain)",
         lambda r: f"{r['bubble_s']:.2f} s ({_share(r['bubble_s'], r['step_s'])} of the step)"),
        ("+ latency (fill and drain on the links)", lambda r: f"{r['latency_s']:.2f} s"),
        ("+ bytes (serialization)", lambda r: f"{r['bytes_s']:.2f} s"),
        ("+ collectives across the pipeline", lambda r: f"{r['collectives_s']:.2f} s"),
        ("+ FSDP inside a region (not overlapped)", lambda r: f"{r['fsdp_s']:.2f} s"),
        ("= predicted step time", lambda r: f"{r['step_s']:.2f} s"),
        (f"tokens/s ({world} GPUs)", lambda r: f"{r['tokens_per_s']:,.0f}"),
        (f"the run's {steps:,} steps: hours",
         lambda r: f"{run_figures(config, r['step_s']).hours:,.1f} h"),
        ("the run's GPU-hours", lambda r: f"{run_figures(config, r['step_s']).gpu_hours:,.0f}"),
        ("Async1F1B: hop depth (needed for no wait)",
         lambda r: f"{r['async']['hop']} ({r['async']['hop_needed']})"),
        ("Async1F1B: steady step (M periods)", lambda r: f"{r['async']['steady_s']:.2f} s"),
        ("+ flushes (fill and drain, per step)", lambda r: f"{r['async']['flushes_s']:.2f} s"),
        ("= Async1F1B step", lambda r: f"{r['async']['step_s']:.2f} s"),
        (f"Async1F1B tokens/s ({world} GPUs)", lambda r: f"{r['async']['tokens_per_s']:,.0f}"),
    ]  # fmt: skip
    for name, cell in rows:
        lines.append(f"| {name} | " + " | ".join(cell(r) for r in predictions.values()) + " |")
    return "\n".join(lines)


def _share(part: float, whole: float) -> str:
    """``part`` as a share of ``whole``, to two significant figures below 10% (``0.33%``, not
    ``0%``)."""
    share = part / whole
    return f"{share:.0%}" if share >= 0.1 else f"{100 * share:.2g}%"


def nccl_lines(plans: list[StagePlan]) -> list[str]:
    """The memory table's NCCL lines (none on a CPU config): per set of communicators, the
    stages whose GPUs hold it and each one's buffers (``Communicator.buffer_bytes``, an
    estimate)."""
    if not any(p.communicators for p in plans):
        return []
    holders: dict[tuple, list[int]] = {}
    for p in plans:
        holders.setdefault(p.communicators, []).append(p.stage)
    lines = ["", f"NCCL buffers per GPU, estimated from NCCL {NCCL_VERSION}'s defaults at "
             f"{NCCL_CHANNELS} channels per communicator and counted on the GPU (an upper bound: "
             "without GPUDirect RDMA, as over sockets, NCCL keeps network buffers in pinned host "
             "memory):"]  # fmt: skip
    for communicators, stages in holders.items():
        items = [(f"{n} x " if n > 1 else "") + f"{c.buffer_bytes / MIB:.1f} MiB {c.describe()}"
                 for c, n in Counter(communicators).items()]  # fmt: skip
        total = sum(c.buffer_bytes for c in communicators)
        word = "stages" if len(stages) > 1 else "stage"
        lines.append(f"  {word} {_ranges(stages)}: {', '.join(items)} = {total / MIB:.1f} MiB")
    return lines


def async_refusal(config) -> str | None:
    """Why the config check refuses ``Async1F1B`` on ``config``'s layout
    (``run_config.check_async``, which names one reason at a time), or None."""
    try:
        check_async(config)
    except UserError as e:
        return str(e)
    return None


def async_assumptions(config) -> str:
    """The line saying what the Async1F1B rows assume."""
    validator, ckpt = config.validator, config.checkpoint
    flushes = [f"validation every {validator.freq:,} steps"] if validator.enable else []
    flushes += [f"a checkpoint every {ckpt.interval:,}"] if ckpt.enable else []
    return ("Async1F1B rows assume: one-step-delayed updates (each step applies the previous "
            "step's gradient; every stage keeps two weight versions); no fill and drain except "
            f"at flushes ({', '.join([*flushes, 'the last step'])}); one GPU per stage (no "
            "FSDP, data-, tensor- or context-parallel ranks) and no activation checkpointing, "
            "as the config check requires; the same links and transport as the synchronous "
            "rows; a prediction, not measured on GPUs")  # fmt: skip


def recommend(config, prediction: dict, refusal: str | None) -> str:
    """The schedule the planner recommends for the configured model (its ``prediction``):
    ``Async1F1B`` where the config check allows the layout, its stages fit under it
    (``async_config``) and it is predicted faster; else the synchronous one."""
    schedule = config.parallelism.pipeline_parallel_schedule
    synchronous = "GPipe" if schedule == ASYNC_SCHEDULE else schedule
    if refusal:
        return (f"recommended schedule: {synchronous}: Async1F1B does not run this layout "
                "(above)")  # fmt: skip
    predicted, step = prediction["async"], prediction["step_s"]
    variant = async_config(config, predicted["hop"])
    largest = max(plan_stages(variant), key=lambda p: p.total_bytes)
    usable = config.hardware.usable_memory_gib
    if largest.total_bytes > usable * GIB:
        return (f"recommended schedule: {synchronous}: under Async1F1B stage {largest.stage} "
                f"would need {largest.total_bytes / GIB:.2f} GiB with the margin, more than "
                f"{usable:g}")  # fmt: skip
    if predicted["step_s"] >= step:
        return (f"recommended schedule: {synchronous}: Async1F1B is predicted no faster "
                f"({predicted['step_s']:.2f} s against {step:.2f} s per step)")  # fmt: skip
    return (
        f"recommended schedule: Async1F1B, predicted {predicted['step_s']:.2f} s per step "
        f"against {synchronous}'s {step:.2f} s ({step / predicted['step_s']:.2f}x the tokens "
        f"per GPU-hour): {' '.join(async_overrides(config, variant))}; under it the largest "
        f"stage needs {largest.total_bytes / GIB:.2f} GiB with the margin ({usable:g} "
        "usable); its loss against the synchronous schedule's is measured only on the CPU "
        "reference workload (results/README.md#asynchronous-pipeline-resultsasync)"
    )


def async_overrides(config, variant) -> list[str]:
    """The overrides that turn ``config`` into ``variant`` (``plan.async_config``)."""
    overrides = []
    for table, key in ASYNC_SETTINGS:
        value = getattr(getattr(variant, table), key)
        if getattr(getattr(config, table), key) != value:
            text = f"{value:g}" if isinstance(value, float) else str(value)
            overrides += [f"--{table}.{key}", text]
    return overrides


def advise(config, plans: list[StagePlan], prediction: dict, variant, links_for, mfu: float,
           region: Link, asked_split: bool) -> list[str]:  # fmt: skip
    """The advice after the table (module docstring), one paragraph per piece; ``prediction``:
    the configured model's step."""
    out = []
    links = links_for(config)
    hours = {m: run_figures(config, predict_step(config, plans, links, m, region)["step_s"]).hours
             for m in (0.75 * mfu, min(1.0, 1.25 * mfu))}  # fmt: skip
    out.append("MFU " + f"{mfu:g} is an assumption (measure it: the training log's mfu): the "
               "run takes " + " and ".join(f"{h:,.1f} h at MFU {m:.2g}"
                                           for m, h in hours.items()))  # fmt: skip
    flag = lopsided(config, plans, mfu)
    if flag:
        out.append(flag)
    configured = prediction["tokens_per_s"] / config.world_size
    current = [len(p.layers) for p in plans]
    options = [o for o in layouts(config, variant, links_for, mfu, region) if o.split != current]
    better = [o for o in options if o.per_gpu > configured]
    if (flag or asked_split) and not better:
        out.append("no other layout of these blocks gives more tokens per GPU-hour")
    if better and (better[0].per_gpu >= BETTER * configured or flag or asked_split):
        best = better[0]
        out.append(
            f"better layout: {best.stages} stages of {best.split} blocks on {best.gpus} GPUs: "
            f"{best.step_s:.2f} s per step, {best.per_gpu:,.0f} tokens/s per GPU (configured "
            f"{configured:,.0f}: {best.per_gpu / configured:.2f}x the tokens per GPU-hour): "
            f"{best.overrides()}"
        )
    proposal = propose_split(config, mfu)
    if proposal is not None:
        split, busiest, largest = proposal
        configured_busiest = max(stage_seconds(config, plans, mfu))
        if asked_split or (split != [len(p.layers) for p in plans]
                           and busiest <= 0.95 * configured_busiest):  # fmt: skip
            out.append(
                f"balanced split of {config.layout_stages} stages: --protocol.layers_per_stage "
                f'"{split}": busiest stage {busiest:.2f} s compute per step (configured '
                f"{configured_busiest:.2f} s), largest stage {largest / GIB:.2f} GiB with the "
                "margin"
            )
    elif asked_split:
        out.append(f"no split of {config.model.n_layers} blocks over {config.layout_stages} "
                   "stages fits")  # fmt: skip
    if config.checkpoint.enable:
        one, disk = checkpoint_disk(config, plans)
        ckpt = config.checkpoint
        kept = (f"keep_latest_k = {ckpt.keep_latest_k} and the one being written"
                if ckpt.keep_latest_k else "keep_latest_k = 0: every checkpoint")  # fmt: skip
        if "://" in ckpt.folder:
            where = f"in the object store {ckpt.folder}"
        elif ckpt.per_node:
            where = "on each node's own disk (the fullest node's)"
        else:
            where = "in the shared folder"
        out.append(f"checkpoint storage: {one / GIB:,.1f} GiB per checkpoint {where}, "
                   f"{disk / GIB:,.0f} GiB with {kept}")  # fmt: skip
    return out


def _remedy_lines(config, variant, mfu: float) -> list[str]:
    """The ranked remedies of a layout that does not fit."""
    limit = config.hardware.usable_memory_gib
    lines = [f"remedies, each alone, by the largest stage's GiB after it (limit {limit:g}):"]
    for i, remedy in enumerate(remedies(config, variant, mfu), 1):
        verdict = "fits" if remedy.fits else "still too large"
        lines.append(f"  {i}. {remedy.change}: {remedy.largest_bytes / GIB:.2f} GiB, {verdict} "
                     f"({' '.join(remedy.overrides)})")  # fmt: skip
    return lines


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m protocol_models.plan",
        description="Plan a config's layout and cluster: memory, step time, run length, advice.",
        epilog="Arguments after these are the config file and its overrides: --toml FILE "
        "[--section.key value ...].",
    )
    parser.add_argument("--regions", default=None,
                        help="nodes per region in node order, e.g. 4,4 (default: every "
                        "boundary crosses the slow link)")  # fmt: skip
    parser.add_argument("--bandwidth-mbps", type=float, default=None,
                        help="the link between regions (default: [transport] link_mbps; "
                        "unset: unlimited)")  # fmt: skip
    parser.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="its one-way latency (default: [transport] link_latency_ms)",
    )
    parser.add_argument("--packet-loss", type=float, default=None,
                        help="the probability that the link between regions loses a packet, "
                        "e.g. 0.01 (default: [transport] link_packet_loss)")  # fmt: skip
    parser.add_argument(
        "--region-bandwidth-mbps",
        type=float,
        default=None,
        help=f"the network inside a region (default {REGION_MBPS:g}, assumed)",
    )
    parser.add_argument(
        "--region-latency-ms",
        type=float,
        default=None,
        help=f"its latency (default {REGION_LATENCY_MS:g}, assumed)",
    )
    parser.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                        help=f"fraction of [hardware] peak_tflops (unset: "
                        f"{ASSUMED_PEAK_TFLOPS:g}; default {DEFAULT_MFU:g})")  # fmt: skip
    parser.add_argument("--propose-split", action="store_true",
                        help="print the balanced layers_per_stage")  # fmt: skip
    parser.add_argument("--ratio", type=float, default=None,
                        help="choose k: the widest 8-bit wire with at least this many times "
                        "fewer boundary bytes than dense, e.g. 100 (sets --protocol.k and "
                        "--codec.bits)")  # fmt: skip
    return parser


WIDE_BITS = 8
"""The precision ``--ratio`` buys width with: at the same bytes, k = 30 in 8 bits trained better
than k = 8 exact (d = 256, 1,200 steps, 2 seeds); 4 bits at twice the k did not clearly help
and 2 bits failed (the frontier study)."""


def widest_wire(variant, dim: int, ratio: float, bits: int) -> tuple[int, object] | None:
    """The largest k in [1, ``dim``] whose wire with ``bits``-bit coordinates (0: exact, or
    ``WIDE_BITS``: every k is allowed at both) is at least ``ratio`` times smaller than dense,
    with its config (``variant(overrides)``); None when even k = 1 is not. The wire's bytes
    grow with k, so a bisection finds it."""
    best, low, high = None, 1, dim
    while low <= high:
        k = (low + high) // 2
        config = variant(["--protocol.k", str(k), "--codec.bits", str(bits)])
        if wire_plan(config)["ratio"] >= ratio:
            best, low = (k, config), k + 1
        else:
            high = k - 1
    return best


def choose_k(config, variant, ratio: float, overrides: list[str]) -> tuple[object, list[str], str]:
    """``--ratio``: the config with the widest ``WIDE_BITS``-bit wire at ``ratio``, its
    overrides and the line that reports the choice. It sets k and the bits itself, so
    ``overrides`` that set either are refused."""
    mode = config.protocol.mode
    method = BOUNDARIES.get(mode)
    if method is None or not method.quantizable:
        quantizable = [name for name, m in BOUNDARIES.items() if m.quantizable]
        raise UserError(f"--ratio {ratio:g}: chooses k for the modes whose wire is k quantizable "
                        f"coordinates ({', '.join(quantizable)}); this config's mode is "
                        f"{mode!r}")  # fmt: skip
    given = [key for key in ("--protocol.k", "--codec.bits")
             if any(o == key or o.startswith(f"{key}=") for o in overrides)]  # fmt: skip
    if given:
        raise UserError(f"--ratio {ratio:g} chooses k and the bits itself: drop "
                        f"{' and '.join(given)}, or drop --ratio")  # fmt: skip
    if ratio <= 1:
        raise UserError(f"--ratio {ratio:g}: the compression against dense, greater than 1")
    chosen = widest_wire(variant, config.model.dim, ratio, WIDE_BITS)
    if chosen is None:
        least = wire_plan(variant(["--protocol.k", "1", "--codec.bits", str(WIDE_BITS)]))
        raise UserError(f"--ratio {ratio:g}: even k = 1 in {WIDE_BITS} bits compresses only "
                        f"{least['ratio']:.1f}x here")  # fmt: skip
    k, wide = chosen
    exact = widest_wire(variant, config.model.dim, ratio, 0)
    wire = wire_plan(wide)
    _, _, tokens = microbatching(wide)
    same = f"exact coordinates would carry k = {exact[0]}" if exact else (
        "no exact wire is this small")  # fmt: skip
    line = (f"--ratio {ratio:g}: k = {k} in {WIDE_BITS} bits, {wire['message_bytes'] / tokens:g} "
            f"bytes per token and direction ({wire['ratio']:.1f}x); {same} at this ratio (at "
            "the same bytes the wider 8-bit wire trained better: results/README.md, the "
            "quality gap at the same bytes)")  # fmt: skip
    return wide, ["--protocol.k", str(k), "--codec.bits", str(WIDE_BITS)], line


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    known, rest = _parser().parse_known_args(argv)
    toml_path, overrides = split_argv(rest)
    try:
        if toml_path is None:
            raise UserError(
                "the planner needs --toml FILE, the config to plan (e.g. --toml "
                "configs/llama3_2b_protocol.toml); it plans nothing by default"
            )
        if not 0 < known.mfu <= 1:
            raise UserError(f"--mfu {known.mfu:g}: must be in (0, 1]")
        if known.packet_loss is not None and not 0 <= known.packet_loss <= 0.5:
            raise UserError(f"--packet-loss {known.packet_loss:g}: a probability per packet, "
                            "in [0, 0.5]")  # fmt: skip
        config = load_config(toml_path, overrides, check_environment=False)
        transport = config.transport
        mbps = known.bandwidth_mbps if known.bandwidth_mbps is not None else (
            transport.link_mbps or None)  # fmt: skip
        ms = known.latency_ms if known.latency_ms is not None else transport.link_latency_ms
        given = known.bandwidth_mbps is not None or known.latency_ms is not None
        source = "as given" if given else (
            "[transport] link_mbps and link_latency_ms" if transport.link_stated else "no link "
            "given: --bandwidth-mbps and --latency-ms")  # fmt: skip
        loss = transport.link_packet_loss if known.packet_loss is None else known.packet_loss
        slow = Link(mbps, ms, loss=loss)
        local = Link(known.region_bandwidth_mbps or REGION_MBPS,
                     REGION_LATENCY_MS if known.region_latency_ms is None
                     else known.region_latency_ms, crosses=False)  # fmt: skip
        regions = parse_regions(known.regions) if known.regions else None

        def variant(extra: list[str]):
            return load_config(toml_path, [*overrides, *extra], check_environment=False)

        def links_for(c) -> list[Link]:
            """``c``'s boundaries; a changed layout keeps the regions' count of crossings."""
            if c is config or regions is None:
                return boundary_links(c, slow, regions, local)
            crossings = min(len(regions), c.layout_stages) - 1
            return [slow] * crossings + [local] * (c.layout_stages - 1 - crossings)

        if known.ratio is not None:
            config, chosen, ratio_line = choose_k(config, variant, known.ratio, overrides)
            overrides.extend(chosen)
            print(ratio_line)
        links = links_for(config)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    plans = plan_stages(config)
    predictions = {}
    for c in sorted([config, twin(config)], key=lambda c: c.protocol.mode != "dense"):
        p = plans if c is config else plan_stages(c)
        sync = predict_step(c, p, links, known.mfu, local)
        sync["async"] = predict_async_step(c, p, sync, links, known.mfu)
        predictions[mode_label(c)] = sync
    local_assumed = known.region_bandwidth_mbps is None or known.region_latency_ms is None
    fsdp = any(fsdp_seconds(config, p, local) for p in plans)
    network = describe_network(links, local, local_assumed, source, fsdp, regions is not None)
    print(render(config, plans, wire_plan(config), predictions, network, local, known.mfu))
    refusal = async_refusal(config)
    print("\nhours and GPU-hours: the run's steps x the predicted step; not counted: the "
          "optimizer step, validation, checkpoint saves and the first step's compile")
    print(f"\n{async_assumptions(config)}")
    if refusal:
        print(f"\nAsync1F1B does not run this layout, so its rows above time these stages as if "
              f"it did (without any FSDP collectives): {refusal}")  # fmt: skip
    mine = predictions[mode_label(config)]
    print(f"\n{recommend(config, mine, refusal)}")
    if slow.loss >= LOSSY_LINK:
        print(f"\npacket loss {100 * slow.loss:g}%: the steps above are TCP CUBIC's; at this loss "
              "the config check asks for BBR, which measured faster on a real link losing 1% "
              "(docs/multinode.md#packet-loss) and is not modelled")  # fmt: skip
    for paragraph in advise(config, plans, mine, variant, links_for, known.mfu, local,
                            known.propose_split):  # fmt: skip
        print(f"\n{paragraph}")
    limit = config.hardware.usable_memory_gib * GIB
    too_big = [p for p in plans if p.total_bytes > limit]
    if too_big:
        print("\n" + "\n".join(_remedy_lines(config, variant, known.mfu)))
        worst = max(too_big, key=lambda p: p.total_bytes)
        print(f"error: stage {worst.stage} needs {worst.total_bytes / GIB:.1f} GiB per GPU with "
              f"the 10% margin, more than hardware.usable_memory_gib = "
              f"{config.hardware.usable_memory_gib:g}: see the remedies above",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0
