"""What the asynchronous pipeline (``Async1F1B``: each step applies the previous step's gradient)
costs in quality on the reference workload.

    python -m recipes.async_study                 # trains what results/async/results.json lacks
    python -m recipes.async_study --render-only   # table and plot from results/async/results.json

The reference workload (``configs/reference_cpu.toml``: Shakespeare, d = 256, 8 layers in a
4-stage layout, subspace k = 8, 300 steps, validation every 50 steps on 32,768 held-out tokens),
each run one process with ``protocol.stages = 4``: under ``Async1F1B`` that is the one-process
emulation of the delayed rule, tested equal step for step to the pipelined run
(``tests/test_async.py``). Every validation (and the last step) is a flush point, as in a
pipelined run. Arms, two seeds each (``debug.seed`` 0 and 1):

* Muon (Muon on the block matrices, AdamW elsewhere), synchronous and asynchronous;
* AdamW, synchronous, asynchronous, and asynchronous with the DC-ASGD delay compensation
  (``optimizer.delay_compensation = 100``, not tuned);
* both asynchronous with weight prediction (``optimizer.weight_prediction = 1``: a batch runs on
  the weights extrapolated by the last update).

Each finished run's summary goes into ``results/async/results.json`` at once, so the study
resumes from it. Run wall times are as measured, at ``PM_PARALLEL_RUNS`` runs at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from threading import Lock

from recipes.common import (
    PARALLEL_RUNS,
    REPO,
    read_jsonl,
    repo_relative,
    train_cached,
    validation_curve,
    wall_seconds,
)

OUT = REPO / "results" / "async"
ASYNC = ["--parallelism.pipeline_parallel_schedule", "Async1F1B"]
DC = ["--optimizer.delay_compensation", "100"]
WP = ["--optimizer.weight_prediction", "1"]
ARMS = {  # name -> (baseline arm or None, overrides); AdamW first: the optimizer said to suffer
    "adamw sync": (None, ["--optimizer.name", "adamw"]),
    "adamw async": ("adamw sync", ["--optimizer.name", "adamw", *ASYNC]),
    "muon sync": (None, ["--optimizer.name", "muon"]),
    "muon async": ("muon sync", ["--optimizer.name", "muon", *ASYNC]),
    "adamw async + DC": ("adamw sync", ["--optimizer.name", "adamw", *ASYNC, *DC]),
    "muon async + WP": ("muon sync", ["--optimizer.name", "muon", *ASYNC, *WP]),
    "adamw async + WP": ("adamw sync", ["--optimizer.name", "adamw", *ASYNC, *WP]),
}
SEEDS = (0, 1)


def run_one(name: str, seed: int) -> dict:
    overrides = [*ARMS[name][1], "--debug.seed", str(seed)]
    folder = train_cached(overrides)
    train = read_jsonl(folder / "metrics.jsonl")
    return {
        "run": repo_relative(folder),
        "overrides": overrides,
        "val_curve": validation_curve(folder),
        "final_train_loss": train[-1]["loss"],
        "wall_s": wall_seconds(folder),
    }


def summarize(runs: dict) -> dict:
    """Per arm: the mean final validation loss over its seeds, each seed's, and the gap of the
    mean to its baseline arm's (same optimizer, synchronous), with the seeds' spread."""
    rows = {}
    for name in ARMS:
        seeds = runs.get(name, {})
        if len(seeds) < len(SEEDS):
            continue
        finals = [seeds[str(s)]["val_curve"][-1][1] for s in SEEDS]
        wall = statistics.mean(seeds[str(s)]["wall_s"] for s in SEEDS)
        rows[name] = {"final_val_loss": statistics.mean(finals), "seeds": finals, "wall_s": wall}
    for name, row in rows.items():
        baseline = ARMS[name][0]
        if baseline in rows:
            base = rows[baseline]
            row["gap_pct"] = 100 * (row["final_val_loss"] - base["final_val_loss"]) / base[
                "final_val_loss"
            ]
            row["gap_per_seed_pct"] = [
                100 * (a - b) / b for a, b in zip(row["seeds"], base["seeds"], strict=True)
            ]
    return rows


def render(results: dict) -> None:
    rows = summarize(results["runs"])
    lines = [
        "Reference workload (d = 256, 8 layers, 4-stage layout, subspace k = 8, 300 steps), "
        "one process per run with the delayed rule emulated (tested equal to the pipelined "
        f"run); {results['meta']['where']}; study wall {results['meta']['wall_s'] / 60:.0f} min.",
        "",
        "| arm | final val loss (seed 0 / 1) | gap vs its synchronous twin (per seed) | wall/run |",
        "|---|---|---|---|",
    ]
    for name, row in rows.items():
        gap = "baseline"
        if "gap_pct" in row:
            per_seed = " / ".join(f"{g:+.2f}%" for g in row["gap_per_seed_pct"])
            gap = f"{row['gap_pct']:+.2f}% ({per_seed})"
        seeds = " / ".join(f"{v:.3f}" for v in row["seeds"])
        lines.append(f"| {name} | {row['final_val_loss']:.3f} ({seeds}) | {gap} | "
                     f"{row['wall_s'] / 60:.1f} min |")  # fmt: skip
    lines += [
        "",
        "Gap: of the two seeds' mean final validation loss to the synchronous arm with the same "
        "optimizer; per seed: seed against the same seed. `+ DC`: "
        "`optimizer.delay_compensation = 100` (DC-ASGD with AdamW's second moment, untuned). "
        "`+ WP`: `optimizer.weight_prediction = 1` (each batch on the weights extrapolated by "
        "the last update).",
    ]
    (OUT / "table.md").write_text("\n".join(lines) + "\n")
    plot(results["runs"])


def plot(runs: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, optimizer in zip(axes, ("adamw", "muon"), strict=True):
        names = [n for n in ARMS if n.startswith(optimizer) and n in runs]
        for color, name in enumerate(names):
            for i, seed in enumerate(sorted(runs[name])):
                xs, ys = zip(*runs[name][seed]["val_curve"], strict=True)
                ax.plot(xs, ys, marker=".", color=f"C{color}", alpha=1 if i == 0 else 0.5,
                        label=name if i == 0 else None)  # fmt: skip
        ax.set_title(optimizer)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[0].set_ylabel("validation loss")
    low = min(p[1] for seeds in runs.values() for s in seeds.values() for p in s["val_curve"])
    axes[0].set_ylim(low - 0.05, low + 1.0)
    fig.suptitle("Async1F1B (gradient applied one step late) vs synchronous, 2 seeds")
    fig.tight_layout()
    fig.savefig(OUT / "val_loss.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / "results.json"
    results = json.loads(path.read_text()) if path.is_file() else {"runs": {}, "meta": {}}
    if not args.render_only:
        started, lock = time.time(), Lock()
        todo = [(n, s) for n in ARMS for s in SEEDS if str(s) not in results["runs"].get(n, {})]

        def one(job):
            entry = run_one(*job)
            with lock:  # saved at once: the study resumes from here
                results["runs"].setdefault(job[0], {})[str(job[1])] = entry
                path.write_text(json.dumps(results, indent=1))
            print(f"done: {job[0]} seed {job[1]}", flush=True)

        with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
            list(pool.map(one, todo))
        meta = results["meta"]
        meta["wall_s"] = meta.get("wall_s", 0.0) + time.time() - started
        meta["where"] = f"CPU, 1 process per run, {PARALLEL_RUNS} runs at a time"
        path.write_text(json.dumps(results, indent=1))
    render(results)


if __name__ == "__main__":
    main()
