"""The first thing to run on a new GPU node or cluster: a short real run of a config's layout.

    bash scripts/gpu_check.sh CONFIG.toml [--steps N] [--section.key value ...]

It first prints this node's "before the first cluster run" checklist
(``protocol_models.cluster.checklist``: driver, flex toolchain, wandb key, checkpoints, interfaces,
FSDP network, sysctls) and stops on a failed item.
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
* that point-to-point traffic between stages and the data path worked (the steps completed).

In CPU mode (``[hardware] device = "cpu"``) the same check runs on gloo, peak memory being the
processes' peak resident memory; the test suite runs it that way. The summary is printed on the
node that holds the first rank of the last stage (where metrics are written). Exit codes: 0 all
good, 1 the run failed or a stage's peak exceeds the card's usable memory, 2 a bad config.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
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
    try:
        run = subprocess.run(
            ["bash", str(REPO / "scripts" / "train.sh"), str(Path(toml_path).resolve()),
             *overrides], cwd=REPO,
            env={**os.environ, "PYTHON": sys.executable, FSDP_PROBE_ENV: "1"},
        )  # fmt: skip
    finally:
        if probe:
            shutil.rmtree(probe, ignore_errors=True)
    if run.returncode != 0:
        print(
            f"error: the check run failed (exit code {run.returncode}); its messages are above",
            file=sys.stderr,
        )
        return 1
    records = read_jsonl(Path(dump) / "metrics.jsonl")
    if not records:
        print("gpu check: this node holds no metrics rank; see the node of the last stage")
        return 0
    fsdp = Path(dump) / FSDP_FILE
    report, fits = summarize(config, records, json.loads(fsdp.read_text()))
    print(report)
    return 0 if fits else 1
