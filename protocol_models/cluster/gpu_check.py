"""The first thing to run on a new GPU node or cluster: a short real run of a config's layout.

    bash scripts/gpu_check.sh CONFIG.toml [--steps N] [--section.key value ...]

It first prints this node's "before the first cluster run" checklist
(``protocol_models.cluster.checklist``: driver, flex toolchain, wandb key, checkpoints, interfaces,
FSDP network, sysctls, open files) and stops on a failed item.
Then it trains ``N`` steps (default 8) of the configured layout -- real dtype, real schedule, real
data, the configured pipeline and data-parallel degrees, with saving, validation and wandb off
(the config as the real run reads it is checked first: a wandb key for online logging, the data,
the tokenizer; on several nodes with one shared checkpoint folder, the check run's start-up
verifies that every node sees it) -- through ``scripts/train.sh`` (so
``NNODES``/``NODE_RANK``/``MASTER_ADDR`` work as for a real launch), then prints what decides
whether the real run will work:

* per pipeline stage, the peak device memory next to the planner's estimate and the card's
  usable memory;
* the bytes per coordinate each boundary carried (2 for a bf16 wire, 4 for fp32; with
  ``[codec] bits``, the packed codes and the per-token bf16 scale: 1.05 for the production
  configs' k = 40 at 8 bits) and the measured compression;
* steady tokens/s (the steps after the first two, which include start-up);
* with FSDP sharding, per stage the time of the step's FSDP all-gathers and reduce-scatter on
  this cluster's network, measured after the last step (``protocol_models.cluster.fsdp_probe``);
* that point-to-point traffic between stages and the data path worked (the steps completed);
* on every node, the network NCCL's communicators used, from NCCL's own log of the check run
  (``NCCL_DEBUG=INFO``, ``NCCL_DEBUG_SUBSYS=INIT,NET``, one file per process in
  ``<dump_folder>/nccl``: ``nccl_network``), with one ``warning:`` line on several nodes when it
  is not NCCL's socket transport, the one the planner models (``NCCL_NET=Socket`` in
  ``scripts/multinode.env`` pins it; a cloud image's net plugin would otherwise be taken);
* on every node, the device memory outside torch's allocator -- NCCL's buffers and the CUDA
  context, which torch's memory statistics do not see -- before the process groups connect,
  after they connect and after step 1, next to torch's reserved memory and the planner's terms
  (``DeviceMemoryProbe``, ``memory_lines``).

The memory probe runs in the workers: ``gpu_check`` sets ``PROTOCOL_MODELS_MEMORY_PROBE=1`` and a
worker that builds ``DeviceMemoryProbe.from_env`` marks the three phases (``mark`` before the
trainer is built, ``mark`` after it, ``after_first_step``); each rank writes its own
``<dump_folder>/device_memory/rank<r>.json``, read by the ``gpu_check`` of its node.

In CPU mode (``[hardware] device = "cpu"``) the same check runs on gloo, peak memory being the
processes' peak resident memory, and without the network and memory lines (no NCCL); the test
suite runs it that way. The summary is printed on the node that holds the first rank of the last
stage (where metrics are written), the network and memory lines on every node. Exit codes: 0 all
good, 1 the run failed or a stage's peak exceeds the card's usable memory, 2 a bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from torchtitan.config import TORCH_DTYPE_MAP

from protocol_models.cluster.checklist import render, rows
from protocol_models.cluster.fsdp_probe import FILE_NAME as FSDP_FILE
from protocol_models.cluster.fsdp_probe import FSDP_PROBE_ENV
from protocol_models.cluster.fsdp_probe import render as render_fsdp
from protocol_models.config.run_config import load_config, split_argv
from protocol_models.model.boundary import BOUNDARIES
from protocol_models.model.subspace import leak_tolerance
from protocol_models.tools.errors import UserError
from protocol_models.training.metrics import read_jsonl

GIB = 1024**3
REPO = Path(__file__).resolve().parents[2]

NCCL_LOG_FOLDER = "nccl"
"""Where, in the check run's dump folder, NCCL writes its log, one file per process."""
MEMORY_PROBE_ENV = "PROTOCOL_MODELS_MEMORY_PROBE"
"""Set to 1 (by ``gpu_check``) for the workers' device memory probe (``DeviceMemoryProbe``)."""
MEMORY_FOLDER = "device_memory"
"""Where, in the dump folder, each rank writes its probe's row."""
PHASES = ("before connect", "after connect", "after step 1")
"""The probe's phases, in order: before the trainer is built (this process's CUDA context, no
NCCL communicator), after it is built (the pipeline's groups connected: ``BoundaryGroups
.connect`` and the norm exchange's batch), after the first step (every group the step uses)."""


def nccl_log_env(dump: str, env: Mapping[str, str]) -> dict[str, str]:
    """The check run's NCCL logging: INFO (TRACE where set) for NCCL's start-up and network
    messages, into one file per process in ``<dump>/nccl`` (``NCCL_DEBUG_FILE``'s ``%h`` and
    ``%p``: host and process id, NCCL's ``src/debug.cc``), not on the console."""
    folder = Path(dump, NCCL_LOG_FOLDER)
    folder.mkdir(parents=True, exist_ok=True)
    level = "TRACE" if env.get("NCCL_DEBUG", "").upper() == "TRACE" else "INFO"
    return {"NCCL_DEBUG": level, "NCCL_DEBUG_SUBSYS": "INIT,NET",
            "NCCL_DEBUG_FILE": str(folder / "%h.%p.log")}  # fmt: skip


# NCCL 2.30.7 (github.com/NVIDIA/nccl, tag v2.30.7-1) prints an INFO line as
# "<host>:<pid>:<tid> [<cuda device>] NCCL INFO <message>" (src/debug.cc, ncclDebugLogV, lines
# 330 and 354), the messages being:
_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
"""``INFO(NCCL_INIT, "Using network %s", comm->ncclNet->name)`` (src/init.cc:486), once per
communicator: the network it uses, ``Socket`` for NCCL's TCP transport
(src/transport/net_socket.cc:804), ``IB`` for InfiniBand, else an external plugin's name."""
_SOCKETS = re.compile(r"NCCL INFO NET/Socket: Using (\d+) threads and (\d+) sockets per thread")
"""``"NET/Socket: Using %d threads and %d sockets per thread"`` (src/transport/net_socket.cc:400),
printed only when there are data sockets (none: the data travels on the control socket)."""
_PLUGIN = re.compile(
    r"NCCL INFO (?:Successfully loaded external network plugin (.+?)"
    r"|NET/Plugin: Loaded net plugin (.+?) \(v\d+\))\s*$"
)
"""An external net plugin loaded: ``"Successfully loaded external network plugin %s"`` (its
library; src/plugin/net.cc:126), in NCCL 2.21-2.29 ``"NET/Plugin: Loaded net plugin %s (v%d)"``
(its name; e.g. src/plugin/net/net_v10.cc:17 at v2.27.3-1). Loaded is not used: with
``NCCL_NET=Socket`` NCCL loads a plugin but does not initialize it (src/plugin/net.cc,
``ncclNetInit``)."""


@dataclass
class NcclNetwork:
    """What NCCL's logs of one node's processes say about its network (``nccl_network``)."""

    processes: int = 0
    """Log files read (one per process that loaded NCCL and logged)."""
    networks: dict[str, int] = field(default_factory=dict)
    """Each network's name: the processes that used it for at least one communicator."""
    sockets: set[tuple[int, int]] = field(default_factory=set)
    """``(threads, sockets per thread)`` of the socket transport, as NCCL logged them."""
    plugins: set[str] = field(default_factory=set)
    """External net plugins loaded."""

    def add(self, lines: Iterable[str]) -> None:
        """One process's log."""
        self.processes += 1
        used = set()
        for line in lines:
            if found := _NETWORK.search(line):
                used.add(found[1])
            elif found := _SOCKETS.search(line):
                self.sockets.add((int(found[1]), int(found[2])))
            elif found := _PLUGIN.search(line):
                self.plugins.add(found[1] or found[2])
        for name in used:
            self.networks[name] = self.networks.get(name, 0) + 1


def nccl_network(folder: Path) -> NcclNetwork:
    """The network facts of every NCCL log in ``folder`` (``nccl_log_env``'s)."""
    seen = NcclNetwork()
    for path in sorted(folder.glob("*.log")) if folder.is_dir() else []:
        with open(path, errors="replace") as f:
            seen.add(f)
    return seen


def network_line(seen: NcclNetwork, nodes: int, folder: Path) -> str:
    """One line naming the network NCCL used on this node; a ``warning:`` line when, on several
    nodes, any communicator took another than ``Socket``."""
    if not seen.networks:
        return (f"net transport: no \"Using network\" line in NCCL's log ({folder}, "
                f"{seen.processes} file(s))")  # fmt: skip
    plugins = f"; external plugin loaded: {', '.join(sorted(seen.plugins))}" if seen.plugins else ""
    others = {name: n for name, n in seen.networks.items() if name.lower() != "socket"}
    if not others:
        shapes = [f"{t} thread(s) x {s} socket(s) per thread" for t, s in sorted(seen.sockets)]
        shape = ", ".join(shapes) or "no data sockets, the data on each connection's control socket"
        return (
            f"net transport: Socket (NCCL's TCP transport) in all {sum(seen.networks.values())}"
            f" process(es) of this node, {shape}{plugins} (NCCL's log: {folder})"
        )
    used = ", ".join(f"{name!r} in {n} of {seen.processes} process(es)"
                     for name, n in sorted(others.items()))  # fmt: skip
    if nodes == 1:
        return (
            f"net transport: {used}{plugins} (one node: NCCL's network carries nothing here; "
            f"a multi-node run pins Socket through scripts/multinode.env)"
        )
    return (
        f"warning: NCCL used network {used}, not Socket{plugins}: the planner and the "
        "start-up estimates assume NCCL's socket transport; set NCCL_NET=Socket on every "
        f"node (scripts/multinode.env sets it unless NCCL_NET is already exported; NCCL's "
        f"log: {folder})"
    )


def read_device_memory(device) -> tuple[int, int, int]:
    """``(free, total, torch reserved)`` bytes on ``device``: ``cudaMemGetInfo`` (device-wide,
    so NCCL's own allocations and the CUDA context count) and the caching allocator's reserved
    bytes. Neither synchronizes the device."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return free, total, torch.cuda.memory_reserved(device)


class DeviceMemoryProbe:
    """A worker's device memory at ``PHASES``, written to ``<dump>/device_memory/rank<r>.json``
    after every mark (``{"rank", "world", "device", "phases": [{"phase", "used", "total",
    "reserved"}]}``), for ``gpu_check`` (``memory_lines``). ``read``: ``read_device_memory``,
    or a stand-in in tests."""

    def __init__(self, folder: Path, rank: int, world: int, device,
                 read: Callable[[object], tuple[int, int, int]] = read_device_memory):  # fmt: skip
        self.path = Path(folder, MEMORY_FOLDER, f"rank{rank}.json")
        self.device, self.read = device, read
        self.row = {"rank": rank, "world": world, "device": str(device), "phases": []}

    @classmethod
    def from_env(cls, dump_folder: str, env: Mapping[str, str] = os.environ):
        """The probe of this worker of a ``gpu_check`` run on CUDA (its device: ``cuda:
        LOCAL_RANK``, the one TorchTitan binds), else None."""
        import torch

        if env.get(MEMORY_PROBE_ENV) != "1" or env.get("PROTOCOL_MODELS_DEVICE") == "cpu":
            return None
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", int(env.get("LOCAL_RANK", "0")))
        return cls(Path(dump_folder), int(env.get("RANK", "0")),
                   int(env.get("WORLD_SIZE", "1")), device)  # fmt: skip

    def mark(self, phase: str) -> None:
        free, total, reserved = self.read(self.device)
        self.row["phases"].append(
            {"phase": phase, "used": total - free, "total": total, "reserved": reserved}
        )
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.row))

    def after_first_step(self, trainer) -> None:
        """Mark ``"after step 1"`` when ``trainer``'s first ``train_step`` returns (the
        instance's method wrapped once, then restored)."""
        original = trainer.train_step

        def first_step(*args, **kwargs):
            result = original(*args, **kwargs)
            trainer.train_step = original
            self.mark(PHASES[2])
            return result

        trainer.train_step = first_step


def memory_rows(dump: Path) -> list[dict]:
    """The probe rows this node's ranks wrote, in rank order."""
    folder = Path(dump, MEMORY_FOLDER)
    rows = [json.loads(p.read_text()) for p in folder.glob("rank*.json")] if folder.is_dir() else []
    return sorted((r for r in rows if r["phases"]), key=lambda r: r["rank"])


def outside_torch(phase: dict) -> int:
    """Device bytes in use that torch's allocator does not hold: the CUDA context (with the
    kernels loaded so far) and NCCL's buffers (and any other process on the device)."""
    return phase["used"] - phase["reserved"]


def memory_lines(rows: list[dict], planned: Callable[[dict], tuple[int, float, float]] | None = None
                 ) -> list[str]:  # fmt: skip
    """The probe's report for this node: the rank with the most memory outside torch's
    allocator at its last phase, phase by phase, with torch's reserved memory beside it; with
    ``planned`` (a probe row -> its stage and the planner's CUDA context and NCCL buffer bytes
    for it), a ``warning:`` line when the measured is more."""
    if not rows:
        return []
    row = max(rows, key=lambda r: outside_torch(r["phases"][-1]))
    phases, parts = row["phases"], []
    for i, phase in enumerate(phases):
        outside = outside_torch(phase)
        change = f" (+{(outside - outside_torch(phases[i - 1])) / GIB:.2f})" if i else ""
        parts.append(f"{phase['phase']} {outside / GIB:.2f} GiB{change}, torch reserved "
                     f"{phase['reserved'] / GIB:.2f} GiB")  # fmt: skip
    last = phases[-1]
    which = f"rank {row['rank']}" + (f", the most of this node's {len(rows)}" if len(rows) > 1
                                     else "")  # fmt: skip
    lines = [
        f"device memory outside torch's allocator (NCCL + CUDA context; {which}, "
        f"{row['device']}): "
        + "; ".join(parts)
        + f"; {last['used'] / GIB:.2f} of {last['total'] / GIB:.2f} GiB of the device in use"
    ]
    if planned is not None:
        stage, context, nccl = planned(row)
        if outside_torch(last) > context + nccl:
            lines.append(
                f"warning: {outside_torch(last) / GIB:.2f} GiB outside torch's allocator on "
                f"rank {row['rank']} (stage {stage}) is more than the planner's "
                f"{context / GIB:.2f} GiB CUDA context + {nccl / GIB:.2f} GiB NCCL buffers: "
                "its memory estimate is short by the difference"
            )
    return lines


def planner_terms(config) -> Callable[[dict], tuple[int, float, float]]:
    """For ``memory_lines``: a probe row's stage (pipeline-outermost ranks: ``world / stages``
    per stage) and that stage's planned CUDA context and NCCL buffers (``plan.plan_stages``)."""
    from protocol_models.cluster.plan import plan_stages

    plans = plan_stages(config)

    def terms(row: dict) -> tuple[int, float, float]:
        stage = row["rank"] // max(row["world"] // len(plans), 1)
        plan = plans[min(stage, len(plans) - 1)]
        return stage, plan.memory.get("context", 0.0), float(plan.nccl_bytes)

    return terms


def node_lines(config, dump: Path, nodes: int) -> list[str]:
    """What this node's NCCL did, for every node's ``gpu_check`` (CUDA configs only): the
    network line and the device memory lines."""
    if config.hardware.device == "cpu":
        return []
    folder = Path(dump, NCCL_LOG_FOLDER)
    return [network_line(nccl_network(folder), nodes, folder),
            *memory_lines(memory_rows(dump), planner_terms(config))]  # fmt: skip


def check_overrides(steps: int, dump_folder: str, shared_probe: str | None = None) -> list[str]:
    """What the check changes in the user's config: length and side effects, nothing else.
    With ``shared_probe`` (a folder inside the real run's checkpoint folder), the checkpointer
    starts there load-only: its start-up check that every node sees the folder runs, nothing is
    saved."""
    checkpoint = ["--checkpoint.enable", "false"]
    if shared_probe:
        checkpoint = ["--checkpoint.enable", "true", "--checkpoint.load_only", "true",
                      "--checkpoint.folder", shared_probe]  # fmt: skip
    return [
        "--training.steps", str(steps),
        "--metrics.log_freq", "1",
        *checkpoint,
        "--validator.enable", "false",
        "--metrics.enable_wandb", "false",
        "--metrics.enable_tensorboard", "false",
        "--dump_folder", dump_folder,
    ]  # fmt: skip


def shared_probe_folder(config) -> str | None:
    """Where the check run verifies that the real run's checkpoint folder is shared (None: it
    need not be -- checkpoints off, per node, or one node)."""
    ckpt = config.checkpoint
    if not ckpt.enable or ckpt.per_node or int(os.environ.get("NNODES", "1")) == 1:
        return None
    return os.path.abspath(os.path.join(config.dump_folder, ckpt.folder, ".gpu_check"))


def summarize(config, records: list[dict], fsdp_rows: list[dict]) -> tuple[str, bool]:
    """The report for a finished check run (``fsdp_rows``: ``fsdp_probe``'s), and whether every
    stage fits the card."""
    from protocol_models.cluster.plan import boundary_width, plan_stages

    protocol, training = config.protocol, config.training
    stages = config.layout_stages
    usable = config.hardware.usable_memory_gib
    lines = [
        f"gpu check: {len(records)} steps of {stages} pipeline stage(s), d={config.model.dim}, "
        f"mode {protocol.mode}, {training.mixed_precision_param} compute"
    ]
    fits = True
    planned = plan_stages(config)
    lines.append("| stage | peak memory (measured) | planner estimate | usable |")
    lines.append("|---|---|---|---|")
    for plan in planned:
        key = f"memory/peak_gib/s{plan.stage}" if stages > 1 else "memory/max_reserved(GiB)"
        peak = max(r.get(key, 0.0) for r in records)
        estimate = sum(plan.memory.values()) - plan.memory.get("context", 0.0)
        fits &= peak <= usable
        lines.append(
            f"| {plan.stage} | {peak:.2f} GiB | {estimate / GIB:.2f} GiB | {usable:g} GiB |"
        )
    lines.append(
        "(measured: the device allocator's peak, on CPU the process's peak resident memory; "
        "estimate: the planner's tensors, without the CUDA context and the margin)"
    )
    last = records[-1]
    if stages > 1:
        width = boundary_width(config)
        tokens = training.local_batch_size * training.seq_len
        per_coordinate = last["wire/fwd_bytes/b0"] / (tokens * width)
        kind = "coordinate" if protocol.mode in BOUNDARIES else "coordinate sent"
        lines.append(
            f"wire: {per_coordinate:g} B per {kind} at boundary 0 "
            f"({last['wire/fwd_bytes/b0']:,.0f} B forward per step), measured compression "
            f"{last['wire/compression_ratio']:.1f}x; point-to-point traffic between all "
            f"{stages} stages worked"
        )
        if "subspace/leak" in last:
            worst = max(r["subspace/leak"] for r in records)
            dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]
            bound = leak_tolerance(dtype)
            verdict = "exact" if worst < bound else "NOT exact"
            lines.append(
                f"subspace leak: {worst:.2e} ({verdict}: the {dtype} stream's bound is {bound:.2g})"
            )
    steady = records[2:] or records
    tps = sum(r["tps"] for r in steady) / len(steady)
    lines.append(
        f"throughput: {tps:,.0f} tokens/s per process (mean of steps "
        f"{steady[0]['step']}-{steady[-1]['step']})"
    )
    step_s = sorted(r["time_metrics/end_to_end(s)"] for r in steady)[len(steady) // 2]
    lines += render_fsdp(fsdp_rows, step_s)
    lines.append(
        f"data: {config.dataloader.describe()} delivered {len(records)} steps x "
        f"{training.local_batch_size} x {training.seq_len} tokens per data-parallel rank"
    )
    if not fits:
        lines.append(f"error: a stage's peak exceeds hardware.usable_memory_gib = {usable:g}")
    return "\n".join(lines), fits


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="bash scripts/gpu_check.sh CONFIG.toml")
    parser.add_argument("--steps", type=int, default=8)
    known, rest = parser.parse_known_args(argv)
    if rest and not rest[0].startswith("--"):
        rest = ["--toml", *rest]
    toml_path, overrides = split_argv(rest)
    dump = tempfile.mkdtemp(prefix="gpu_check_")
    try:
        # the run's own config first: what the check run turns off (wandb, checkpoints) is
        # checked as the real run will meet it, and this node's checklist printed
        user_config = load_config(toml_path, overrides, check_environment=False)
        checklist = rows(user_config)
        print(render(checklist))
        load_config(toml_path, overrides)
        failed = next((r for r in checklist if r.verdict == "FAIL"), None)
        if failed:
            raise UserError(failed.detail)
        probe = shared_probe_folder(user_config)
        overrides = [*overrides, *check_overrides(max(known.steps, 3), dump, probe)]
        config = load_config(toml_path, overrides)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    env = {**os.environ, "PYTHON": sys.executable, FSDP_PROBE_ENV: "1", MEMORY_PROBE_ENV: "1",
           **nccl_log_env(dump, os.environ)}  # fmt: skip
    try:
        run = subprocess.run(
            ["bash", str(REPO / "scripts" / "train.sh"), str(Path(toml_path).resolve()),
             *overrides], cwd=REPO, env=env,
        )  # fmt: skip
    finally:
        if probe:
            shutil.rmtree(probe, ignore_errors=True)
    for line in node_lines(config, Path(dump), int(os.environ.get("NNODES", "1"))):
        print(line)
    if run.returncode != 0:
        print(
            f"error: the check run failed (exit code {run.returncode}); its messages are above"
            + (f", NCCL's in {Path(dump, NCCL_LOG_FOLDER)}" if config.hardware.device != "cpu"
               else ""),
            file=sys.stderr,
        )  # fmt: skip
        return 1
    records = read_jsonl(Path(dump) / "metrics.jsonl")
    if not records:
        print("gpu check: this node holds no metrics rank; see the node of the last stage")
        return 0
    fsdp = Path(dump) / FSDP_FILE
    report, fits = summarize(config, records, json.loads(fsdp.read_text()))
    print(report)
    return 0 if fits else 1
