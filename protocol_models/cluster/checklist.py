"""Before the first cluster run: what every node must have, checked on the node.

``scripts/gpu_check.sh`` prints these rows as a table on each node before its check run, and
stops (exit 2) on a failed one; the config check refuses the same failures with one line. Each
row is ``(item, verdict, detail)`` with the verdict ``ok``, ``warn`` (the run starts but is slower
or cannot resume), ``FAIL`` (the run would stop) or ``n/a`` (this config does not need it).

| item | what is checked |
|---|---|
| driver | the NVIDIA driver is at or above the torch build's floor (``cuda_driver``) |
| toolchain | with flex attention: a C compiler and ``Python.h`` for Triton's launchers |
| wandb key | with wandb logging online: an API key on the node that logs |
| checkpoints | per node, or one folder every node sees (checked by the check run itself) |
| interfaces | on several nodes: NCCL's interface choice next to a VPN (``interfaces``) |
| FSDP network | with FSDP on several nodes: which network FSDP's collectives take next to the |
|  | pipeline's links between regions (``NCCL_IB_DISABLE`` is process-wide) |
| sysctls | with ``[transport]`` link stated: TCP buffers and congestion control for it |
| open files | on several nodes: NCCL's sockets per worker next to ``ulimit -n`` |
"""

from __future__ import annotations

import os
import resource
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from protocol_models.tools.errors import ConfigError


@dataclass(frozen=True, slots=True)
class Row:
    item: str
    verdict: str
    """``ok``, ``warn``, ``FAIL`` or ``n/a``."""
    detail: str


def _checked(item: str, check: Callable[[], None], ok: str) -> Row:
    """``check()`` passing is ``ok``; its ConfigError is the FAIL row's detail."""
    try:
        check()
    except ConfigError as e:
        return Row(item, "FAIL", str(e))
    return Row(item, "ok", ok)


def driver_row(config) -> Row:
    import torch

    from protocol_models.tools.cuda_driver import (
        driver_clause,
        driver_floor,
        node_driver,
        version_tuple,
    )

    if config.hardware.device == "cpu":
        return Row("driver", "n/a", 'hardware.device = "cpu"')
    cuda = torch.version.cuda
    if cuda is None:
        return Row("driver", "FAIL", f"torch {torch.__version__} is a CPU build")
    driver, floor = node_driver(), driver_floor(cuda)
    clause = f"torch {torch.__version__} is {driver_clause(cuda, driver)}"
    if driver is None or (floor and version_tuple(driver) < version_tuple(floor)):
        return Row("driver", "FAIL", clause)
    return Row("driver", "ok", clause)


def toolchain_row(config, env: Mapping[str, str]) -> Row:
    from protocol_models.config.preflight import check_flex_toolchain

    if config.model.attention != "flex":
        return Row("toolchain", "n/a", f"model.attention = {config.model.attention!r}")
    return _checked(
        "toolchain", lambda: check_flex_toolchain(env), "a C compiler and Python.h for flex"
    )


def wandb_row(config, env: Mapping[str, str]) -> Row:
    from protocol_models.config.preflight import check_wandb_key, holds_metrics_rank

    if not config.metrics.enable_wandb:
        return Row("wandb key", "n/a", "metrics.enable_wandb = false")
    if not holds_metrics_rank(config, env):
        return Row("wandb key", "n/a", "wandb logs on another node (the last stage's first rank)")
    mode = env.get("WANDB_MODE") or "online"
    return _checked("wandb key", lambda: check_wandb_key(env), f"WANDB_MODE = {mode!r}, key found")


def checkpoints_row(config, nodes: int) -> Row:
    ckpt = config.checkpoint
    folder = os.path.join(config.dump_folder, ckpt.folder)
    if not ckpt.enable:
        return Row("checkpoints", "warn", "checkpoint.enable = false: a restart starts over")
    if ckpt.per_node:
        return Row(
            "checkpoints",
            "ok",
            f"per node: {folder}/node-<i>-of-{nodes} on each node's own disk (to export, copy "
            "the node folders into one)",
        )
    if nodes == 1:
        return Row("checkpoints", "ok", f"one node: {folder}")
    return Row(
        "checkpoints",
        "ok",
        f"shared: {folder} (that every node sees it is checked by the check run's start-up; "
        "without a shared filesystem set checkpoint.per_node = true)",
    )


def interfaces_row(nodes: int, env: Mapping[str, str]) -> Row:
    from protocol_models.tools.interfaces import interface_warning

    if nodes == 1:
        return Row("interfaces", "n/a", "one node")
    warning = interface_warning(env)
    if warning:
        return Row("interfaces", "warn", warning.removeprefix("warning: "))
    chosen = env.get("NCCL_SOCKET_IFNAME") or "(unset)"
    return Row("interfaces", "ok", f"NCCL_SOCKET_IFNAME={chosen}, no VPN-like interface beside it")


INFINIBAND = "/sys/class/infiniband"


def infiniband_devices(root: str = INFINIBAND) -> list[str]:
    """This node's InfiniBand (and RoCE) devices as the kernel lists them."""
    return sorted(os.listdir(root)) if os.path.isdir(root) else []


def fsdp_network_row(config, nodes: int, env: Mapping[str, str], devices: list[str]) -> Row:
    """NCCL picks one network per process, and the pipeline's groups between regions are built
    by TorchTitan's mesh and torch's pipelining without per-group options, so
    ``NCCL_IB_DISABLE=1`` (no InfiniBand between regions) also sends FSDP inside a region over
    TCP: only a cost where the node has InfiniBand devices (``gpu_check`` measures it)."""
    shards = config.parallelism.data_parallel_shard_degree
    if shards <= 1 or nodes == 1:
        return Row("FSDP network", "n/a", f"data_parallel_shard_degree = {shards}, {nodes} node(s)")
    names = ", ".join(devices)
    if not devices:
        return Row("FSDP network", "ok", "no InfiniBand devices: FSDP and the pipeline use TCP")
    if env.get("NCCL_IB_DISABLE") == "1":
        return Row(
            "FSDP network",
            "warn",
            f"NCCL_IB_DISABLE=1 next to InfiniBand devices ({names}): FSDP inside the region "
            "runs over TCP too (gpu_check's FSDP lines say what it costs); unset it only if "
            "InfiniBand or RoCE also routes between the regions",
        )
    return Row(
        "FSDP network",
        "warn",
        f"InfiniBand devices ({names}) and NCCL_IB_DISABLE unset: NCCL also tries InfiniBand "
        "for the pipeline's groups between regions; set NCCL_IB_DISABLE=1 unless it routes "
        "there",
    )


def sysctls_row(config) -> Row:
    from protocol_models.wire.transport import tcp_advice

    transport = config.transport
    if not transport.link_stated:
        return Row("sysctls", "n/a", "[transport] link_mbps and link_latency_ms not stated")
    advice = tcp_advice(
        transport.link_mbps, transport.link_latency_ms, loss=transport.link_packet_loss
    )
    if advice:
        return Row("sysctls", "warn", advice.removeprefix("warning: "))
    link = f"{transport.link_mbps:g} Mbit/s + {transport.link_latency_ms:g} ms"
    return Row("sysctls", "ok", f"TCP buffers and congestion control fit a {link} link")


NCCL_SOCKET_AUTO = ((0, 1), (2, 8), (4, 1))
"""NCCL's own ``(NCCL_SOCKET_NTHREADS, NCCL_NSOCKS_PERTHREAD)`` where they are unset: by the
NIC's PCI vendor, AWS's 2 x 8, Google's 4 x 1, else 0 x 1 (NCCL 2.30.7,
``src/transport/net_socket.cc``, ``ncclNetSocketGetNsockNthread``)."""
NCCL_MAX_THREADS, NCCL_MAX_SOCKETS = 16, 64
"""The same function's caps (``MAX_THREADS``, ``MAX_SOCKETS``)."""


def nccl_data_sockets(env: Mapping[str, str]) -> tuple[int, str]:
    """Data sockets per NCCL socket connection (``NCCL_SOCKET_NTHREADS`` x
    ``NCCL_NSOCKS_PERTHREAD``, capped as NCCL caps them; an unset one takes the largest of
    NCCL's own choices), and how the row names them."""

    def value(name: str) -> int | None:
        text = env.get(name, "").strip()
        return int(text) if text.lstrip("-").isdigit() and int(text) != -2 else None

    threads, per_thread = value("NCCL_SOCKET_NTHREADS"), value("NCCL_NSOCKS_PERTHREAD")
    options = []
    for auto_threads, auto_per_thread in NCCL_SOCKET_AUTO:
        t = min(auto_threads if threads is None else threads, NCCL_MAX_THREADS)
        s = auto_per_thread if per_thread is None else per_thread
        if t * s > NCCL_MAX_SOCKETS:
            s = NCCL_MAX_SOCKETS // t
        options.append((t * s, t, s))
    data, t, s = max(options)
    unset = threads is None or per_thread is None
    return data, f"{t} x {s} data" + (" (NCCL's own choice where unset, at most)" if unset else "")


def stage_network_connections(config, stage: int) -> int:
    """NCCL network connections one worker of ``stage`` holds, per channel: one per peer and
    direction of each point-to-point communicator whose peers are on other nodes (boundaries,
    norm exchange) and two per ring (the previous and the next rank), every ring counted as if
    it crossed nodes (``plan.stage_communicators``)."""
    from protocol_models.cluster.plan import stage_communicators

    return sum(2 if c.ring else 0 if c.local else c.directions * c.peers
               for c in stage_communicators(config, stage))  # fmt: skip


def open_files_limit() -> int | None:
    """This process's soft ``RLIMIT_NOFILE`` (``ulimit -n``), which the workers inherit; None
    when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def open_files_row(config, nodes: int, env: Mapping[str, str], limit: int | None) -> Row:
    """NCCL's sockets per worker against ``ulimit -n`` (``limit``, the soft limit): each
    socket-transport connection holds its data sockets and one control socket
    (``src/transport/net_socket.cc``, ``ncclNetSocketConnect``), one connection per peer,
    direction and channel (``plan.NCCL_CHANNELS``, the planner's assumption) of each
    communicator (``stage_network_connections``), the busiest stage's. ``FAIL`` when that alone
    reaches the limit, ``warn`` above half of it (the rest is for NCCL's bootstrap sockets, the
    CUDA driver's device files, the data loaders, the stores)."""
    from protocol_models.cluster.plan import NCCL_CHANNELS

    if config.hardware.device == "cpu" or nodes == 1:
        reason = 'hardware.device = "cpu"' if nodes > 1 else "one node"
        return Row("open files", "n/a", reason)
    data, described = nccl_data_sockets(env)
    stages = range(config.layout_stages)
    stage = max(stages, key=lambda s: stage_network_connections(config, s))
    connections = stage_network_connections(config, stage) * NCCL_CHANNELS
    sockets = connections * (data + 1)
    count = (
        f"up to {sockets} NCCL sockets per worker (stage {stage}: {connections} network "
        f"connections, {NCCL_CHANNELS} channels each counted, x ({described} + 1 control))"
    )
    if limit is None:
        return Row("open files", "ok", f"{count}; ulimit -n unlimited")
    fix = ("raise it before the launch (ulimit -n 65536; under SLURM or systemd: "
           "LimitNOFILE) or lower NCCL_SOCKET_NTHREADS x NCCL_NSOCKS_PERTHREAD")  # fmt: skip
    if sockets >= limit:
        return Row("open files", "FAIL", f"{count} reach ulimit -n {limit}: {fix}")
    if 2 * sockets > limit:
        return Row("open files", "warn", f"{count}: over half of ulimit -n {limit}; {fix}")
    return Row("open files", "ok", f"{count} within ulimit -n {limit}")


def rows(config, env: Mapping[str, str] = os.environ) -> list[Row]:
    """This node's checklist for ``config`` (``NNODES`` nodes, as ``scripts/train.sh`` reads)."""
    nodes = int(env.get("NNODES", "1"))
    return [
        driver_row(config),
        toolchain_row(config, env),
        wandb_row(config, env),
        checkpoints_row(config, nodes),
        interfaces_row(nodes, env),
        fsdp_network_row(config, nodes, env, infiniband_devices()),
        sysctls_row(config),
        open_files_row(config, nodes, env, open_files_limit()),
    ]


def render(checklist: list[Row]) -> str:
    lines = ["| before the first cluster run | verdict | detail |", "|---|---|---|"]
    lines += [f"| {r.item} | {r.verdict} | {r.detail} |" for r in checklist]
    return "\n".join(lines)
