"""Subspace ablation: optimizer x subspace updates, each against a fair dense twin.

    python -m recipes.ablation                # ~13 runs of the reference workload (see README)
    python -m recipes.ablation --render-only  # table and plot from results/subspace_ablation

Every run is the shared reference workload (``configs/reference_cpu.toml``: Shakespeare, d=256,
8 layers in a 4-stage layout, k=8 (32x), 300 steps, validation every 50 steps on 32,768 held-out
tokens) trained in one process with ``protocol.stages = 4`` -- the exact model a 4-process
pipeline trains (tests/test_exactness.py), at a quarter of the processes.

* subspace x every registered optimizer (``protocol_models.training.optimizers.OPTIMIZERS``: adamw,
  adamw_rowwise, muon, adamw_project) x {updates off, every 40 steps};
* the fair dense twin of each optimizer (its ``OptimizerEntry.dense_twin``): the same rule on the
  same matrices (``adamw`` for ``adamw`` and ``adamw_project``, whose projection has no dense
  counterpart; row-wise second moments on the same writers for ``adamw_rowwise``; Muon on the
  same block matrices for ``muon``);
* a second seed (``debug.seed = 1``) for the best subspace configuration and its twin.

Writes ``results/subspace_ablation/{results.json,table.md,val_loss.png}``; runs are cached in
``results/runs`` (shared with the codec comparison).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from protocol_models.training.optimizers import OPTIMIZERS as REGISTRY
from recipes.common import (
    REPO,
    read_jsonl,
    repo_relative,
    steps_to_reach,
    train_cached,
    validation_curve,
    wall_seconds,
)

UPDATE_EVERY = 40  # 7 updates in 300 steps, none right before the final validation
UPDATE_ANGLE_DEG = 5.0
OUT = REPO / "results" / "subspace_ablation"


def overrides(mode: str, optimizer: str, updates: bool, seed: int) -> list[str]:
    """The run's overrides of the reference workload (the order the run cache expects)."""
    if mode == "dense":
        return ["--protocol.mode", "dense", "--optimizer.name", optimizer, "--debug.seed",
                str(seed)]  # fmt: skip
    extra = (
        ["--protocol.update_every", str(UPDATE_EVERY), "--protocol.update_angle_deg",
         str(UPDATE_ANGLE_DEG)]
        if updates
        else []
    )  # fmt: skip
    return ["--optimizer.name", optimizer, "--debug.seed", str(seed), *extra]


def twin(optimizer: str) -> str:
    """The optimizer of ``optimizer``'s fair dense twin (``OptimizerEntry.dense_twin``)."""
    return REGISTRY[optimizer].dense_twin or optimizer


def first_jobs() -> list[tuple[str, str, bool, int]]:
    """Seed 0 of every (mode, optimizer, updates) run: each registered optimizer with U fixed
    and with updates, and every dense twin once."""
    jobs = [("subspace", o, u, 0) for o in REGISTRY for u in (False, True)]
    return jobs + [("dense", o, False, 0) for o in sorted({twin(o) for o in REGISTRY})]


def run_name(mode: str, optimizer: str, updates: bool, seed: int) -> str:
    suffix = "" if mode == "dense" else ("/updates" if updates else "/fixed-U")
    return f"{mode}/{optimizer}{suffix}/seed{seed}"


def collect(mode: str, optimizer: str, updates: bool, seed: int) -> dict:
    folder = train_cached(overrides(mode, optimizer, updates, seed))
    curve = validation_curve(folder)
    records = read_jsonl(folder / "metrics.jsonl")
    return {
        "mode": mode,
        "optimizer": optimizer,
        "updates": updates,
        "seed": seed,
        "val_curve": curve,
        "final_val_loss": curve[-1][1],
        "final_train_loss": records[-1]["loss"],
        "wall_s": wall_seconds(folder),
        "folder": repo_relative(folder),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render-only", action="store_true", help="no runs: re-render")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        results = json.loads((OUT / "results.json").read_text())
    else:
        jobs = first_jobs()
        with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
            done = pool.map(lambda job: collect(*job), jobs)
            runs = {run_name(*job): r for job, r in zip(jobs, done, strict=True)}
        best = min((r for r in runs.values() if r["mode"] == "subspace"),
                   key=lambda r: r["final_val_loss"])  # fmt: skip
        second = [("subspace", best["optimizer"], best["updates"], 1),
                  ("dense", twin(best["optimizer"]), False, 1)]  # fmt: skip
        with ThreadPoolExecutor(max_workers=2) as pool:
            for job, r in zip(second, pool.map(lambda j: collect(*j), second), strict=True):
                runs[run_name(*job)] = r
        results = {"update_every": UPDATE_EVERY, "update_angle_deg": UPDATE_ANGLE_DEG,
                   "best": run_name(*second[0][:3], 0), "runs": runs}  # fmt: skip
        (OUT / "results.json").write_text(json.dumps(results, indent=1))
    (OUT / "table.md").write_text(render_table(results))
    plot(results, OUT / "val_loss.png")
    print((OUT / "table.md").read_text())


def studied(results: dict) -> list[str]:
    """The registered optimizers ``results`` holds runs of, in registry order."""
    return [o for o in REGISTRY if run_name("subspace", o, False, 0) in results["runs"]]


def render_table(results: dict) -> str:
    runs = results["runs"]
    lines = [
        "| optimizer | U | final val loss (seed 0) | fair dense twin | twin's val loss | gap | "
        "steps the twin needs for the same loss | seed 1 (config / twin) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    schedule = f"{results['update_angle_deg']:g} deg every {results['update_every']} steps"
    for optimizer in studied(results):
        dense = runs[run_name("dense", twin(optimizer), False, 0)]
        for updates in (False, True):
            run = runs[run_name("subspace", optimizer, updates, 0)]
            gap = 100 * (run["final_val_loss"] / dense["final_val_loss"] - 1)
            needed = steps_to_reach(dense["val_curve"], run["final_val_loss"])
            seed1 = runs.get(run_name("subspace", optimizer, updates, 1))
            twin1 = runs.get(run_name("dense", twin(optimizer), False, 1))
            spread = (
                f"{seed1['final_val_loss']:.3f} / {twin1['final_val_loss']:.3f} (gap "
                f"{100 * (seed1['final_val_loss'] / twin1['final_val_loss'] - 1):+.1f}%)"
                if seed1 and twin1
                else ""
            )
            lines.append(
                f"| {optimizer} | {schedule if updates else 'fixed'} "
                f"| {run['final_val_loss']:.3f} | dense {twin(optimizer)} "
                f"| {dense['final_val_loss']:.3f} | {gap:+.1f}% "
                f"| {'> 300 (not reached)' if needed is None else f'{needed:.0f} of 300'} "
                f"| {spread} |"
            )
    lines.append("")
    lines.append(
        "Reference workload (configs/reference_cpu.toml), 300 steps x 2,048 tokens, k = 8 (32x), "
        "validation loss on 32,768 held-out tokens; one process with the 4-stage layout, 2-core "
        "CPU. Steps for the twin: linear interpolation between its validation points (every 50)."
    )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    optimizers = studied(results)
    fig, axes = plt.subplots(1, len(optimizers), figsize=(4 * len(optimizers), 4), sharey=True)
    runs = results["runs"]
    lowest = min(r["final_val_loss"] for r in runs.values())
    for ax, optimizer in zip(axes, optimizers, strict=True):
        for name, style in [
            (run_name("dense", twin(optimizer), False, 0), "k--"),
            (run_name("subspace", optimizer, False, 0), "C0-"),
            (run_name("subspace", optimizer, True, 0), "C1-"),
        ]:
            steps, losses = zip(*runs[name]["val_curve"], strict=True)
            ax.plot(steps, losses, style, marker="o", ms=3, label=name.replace("/seed0", ""))
        ax.set_title(optimizer)
        ax.set_xlabel("step")
        ax.set_ylim(bottom=lowest - 0.05, top=7.0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("validation loss")
    fig.suptitle(
        "Subspace ablation on the reference workload (k = 8, 32x): each vs its fair dense twin"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
