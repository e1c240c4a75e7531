"""The compression frontier: validation-loss gap to the dense twin against bytes on the wire.

    python -m recipes.frontier                 # the study, through the shared run cache
    python -m recipes.frontier --quick         # tiny model, few steps: checks the harness
    python -m recipes.frontier --render-only   # table and plot from an existing results.json
    python -m recipes.frontier --cached-only   # the finished runs only (trains nothing)
    python -m recipes.frontier --only "subspace k=16 4-bit" ... [--one-seed]   # train these only

Arms, each trained on the reference workload (``configs/reference_cpu.toml``, 300 steps, Muon on
every arm, in one process with the codecs in-graph at the 4-stage layout's 3 boundaries; runs
go through the shared cache ``common.train_cached``):

* the exact subspace wire at k in {1, 2, 4, 8, 16, 32, 64}, with its k coordinates in full
  precision or quantized to 8, 4 or 2 bits (``[codec] bits``: a bf16 per-token scale, stochastic
  rounding backward; k a multiple of 8 / bits), trained from the fewest bytes up;
* the other arms of the codec comparison: the lossy baselines (TopK, quantization, fixed
  low-rank, SVD) and the learned boundaries (ResBM, MAPL);
* the dense twin, two seeds.

Runs the codec comparison already measured (the same overrides on the same workload: dense,
subspace k=1, 8 and 32, the lossy baselines, ResBM, MAPL) are read from
``results/compare/results.json`` rather than trained again, and so are this study's own runs in
``results/frontier/results.json`` (the run cache ``results/runs`` is per machine); a stored run
counts only while its wire still sends the bytes it sent then.

Seed 1 then trains every arm on the frontier (no other arm has both fewer bytes and a smaller
gap), again whenever a second seed moves the frontier onto an arm with one seed. Bytes per
token: what one boundary carries per token, forward + backward, every scale and index included
(the run's fp32 wire; ``wire.sizes.message_bytes``).

Writes ``results/frontier/{results.json,table.md,frontier.png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from protocol_models.config.run_config import load_config
from recipes import common
from recipes.common import PARALLEL_RUNS, REFERENCE, REPO
from recipes.common.arms import (
    QUICK,
    QUICK_TOML,
    arm,
    overrides,
    run_all,
    select_arms,
    stored_runs,
    summarize,
    wire_bytes,
)
from recipes.compare import ARMS

KS = [1, 2, 4, 8, 16, 32, 64]
BITS = [None, 8, 4, 2]
COMPARE = REPO / "results" / "compare" / "results.json"
OUT = REPO / "results" / "frontier"


def subspace_arm(k: int, bits: int | None, base_k: int) -> dict:
    """Subspace rank ``k`` with ``bits``-bit coordinates (None: full precision). At the
    workload's own k (``base_k``) no k override: the same run, and cache entry, as the codec
    comparison's."""
    precision = "full" if bits is None else f"{bits}-bit"
    extra = [] if k == base_k else ["--protocol.k", str(k)]
    extra += [] if bits is None else ["--codec.bits", str(bits)]
    return arm(f"subspace k={k} {precision}", "frontier", "subspace", extra)


def study_arms(quick: bool) -> list[dict]:
    """Every arm of the study (seed 0; the dense twin with seeds 0 and 1)."""
    if quick:
        grid = [subspace_arm(4, b, 4) for b in BITS] + [subspace_arm(8, b, 4) for b in (None, 2)]
        return [arm("dense", "1x", "dense", [], (0, 1)), *grid,
                arm("lowrank k=4", "lossy", "lowrank", ["--codec.rank", "4"]),
                arm("quant int2", "lossy", "quant", ["--codec.bits", "2"])]  # fmt: skip
    grid = [subspace_arm(k, b, 8) for k in KS for b in BITS if b is None or k * b % 8 == 0]
    others = [dict(a, ratio=a["mode"]) for a in ARMS if a["mode"] not in ("dense", "subspace")]
    return [ARMS[0], *grid, *others]


def highest_ratio_first(arms: list[dict], toml: Path, quick_over: list[str]) -> list[dict]:
    """The training order: dense (the twin every gap needs), then the fewest bytes per step
    first, so that a partial run of the study holds the high-ratio end of the frontier."""

    def sent(a: dict) -> int:
        b = wire_bytes(toml, [*quick_over, *overrides(a, 0)])
        return -1 if a["mode"] == "dense" else b["fwd"] + b["bwd"]

    return sorted(arms, key=sent)


def bytes_per_token(entry: dict, tokens_per_step_boundary: int) -> float:
    """Bytes one boundary carries per token (forward + backward, plus MAPL's per-step weight
    exchange spread over the step's tokens): a step's bytes over all boundaries / (tokens per
    step x boundaries)."""
    b = entry["bytes_per_step"]
    return (b["fwd"] + b["bwd"] + entry.get("sync_bytes_per_step", 0)) / tokens_per_step_boundary


def ratio(entry: dict, tokens_per_step_boundary: int) -> float:
    """Dense bytes per token over the arm's (``bytes_per_token``)."""
    dense = entry["bytes_per_step"]["dense"] / tokens_per_step_boundary
    return dense / bytes_per_token(entry, tokens_per_step_boundary)


def frontier(results: dict, tokens: int) -> list[str]:
    """The arms no other arm beats on both bytes per token and gap (dense excluded)."""
    points = {name: (bytes_per_token(e, tokens), e["gap_vs_dense_pct"])
              for name, e in results.items() if name != "dense"}  # fmt: skip
    return sorted(
        (n for n, (b, g) in points.items()
         if not any(b2 <= b and g2 <= g and (b2, g2) != (b, g) for b2, g2 in points.values())),
        key=lambda n: points[n][0],
    )  # fmt: skip


def render_table(results: dict, meta: dict) -> str:
    tokens, on = meta["tokens_per_step_boundary"], set(meta["frontier"])
    wall = meta.get("recipe_wall_s")
    run_hours = sum(s["wall_s"] for e in results.values() for s in e["seeds"].values()) / 3600
    lines = [
        f"Reference workload, {meta['steps']} steps, Muon on every arm; {meta['where']}; "
        f"the runs' wall times add up to {run_hours:.1f} h, so the whole recipe takes about "
        f"{run_hours / PARALLEL_RUNS:.1f} h at {PARALLEL_RUNS} runs at a time"
        + (f" (this invocation: {wall / 60:.0f} min wall)." if wall else ".")
        + " Bytes per token: one boundary, forward + backward, every scale and index included "
        "(fp32 wire); MAPL's per-step exchange of its boundary weights' gradients counts too, "
        "spread over the step's tokens. Ratio: dense bytes / these bytes."
        + (f" **Not run yet**: {', '.join(meta['not_run'])}." if meta.get("not_run") else ""),
        "",
        "| arm | bytes/token | ratio | final val loss (seeds) | gap vs dense | on frontier |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in sorted(results.items(), key=lambda i: -bytes_per_token(i[1], tokens)):
        finals = [f"{s['val_curve'][-1][1]:.3f}" for s in e["seeds"].values()]
        loss = f"{e['final_val_loss']:.3f}" + (
            f" ({' / '.join(finals)})" if len(finals) > 1 else ""
        )
        lines.append(
            f"| {name} | {bytes_per_token(e, tokens):,.1f} | {ratio(e, tokens):.1f}x | {loss} "
            f"| {e['gap_vs_dense_pct']:+.2f}% | {'yes' if name in on else ''} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = meta["tokens_per_step_boundary"]
    fig, ax = plt.subplots(figsize=(8, 5))
    families = {"subspace full": "C0", "subspace 8-bit": "C1", "subspace 4-bit": "C2",
                "subspace 2-bit": "C3", "resbm": "C4", "mapl": "C5", "lossy": "0.5"}  # fmt: skip
    for name, e in results.items():
        if name == "dense":
            continue
        family = (f"subspace {name.split()[-1]}" if e["mode"] == "subspace"
                  else e["mode"] if e["mode"] in families else "lossy")  # fmt: skip
        x, y = bytes_per_token(e, tokens), e["gap_vs_dense_pct"]
        ax.scatter(x, y, color=families[family], label=family, zorder=3)
        ax.annotate(name, (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    line = [(bytes_per_token(results[n], tokens), results[n]["gap_vs_dense_pct"])
            for n in meta["frontier"]]  # fmt: skip
    ax.plot(*zip(*line, strict=True), "k--", lw=1, label="frontier")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles, strict=True))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("bytes per token per boundary (fwd + bwd)")
    ax.set_ylabel("validation-loss gap to dense (%)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--only", nargs="+", metavar="ARM",
                        help="train these arms (and dense); the others as finished")  # fmt: skip
    parser.add_argument("--one-seed", action="store_true", help="no second seed on the frontier")
    parser.add_argument("--cached-only", action="store_true",
                        help="report the finished runs only (trains nothing)")  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        saved = json.loads((args.out / "results.json").read_text())
        report(saved["runs"], saved["meta"], args.out)
        return
    started = time.time()
    if args.quick:  # keep the harness check's tiny runs out of the shared study cache
        common.RUN_CACHE = args.out / "runs"
    toml, quick_over = (QUICK_TOML, QUICK) if args.quick else (REFERENCE, [])
    arms = highest_ratio_first(study_arms(args.quick), toml, quick_over)
    named = {a["name"] for a in select_arms(parser, arms, ["dense", *args.only])} if args.only \
        else {a["name"] for a in arms}  # fmt: skip
    # the codec study's runs and this study's own, as measured (the run cache is per machine)
    stored = {} if args.quick else stored_runs(COMPARE) | stored_runs(args.out / "results.json")

    def gather(todo: list[dict]) -> dict:  # train the named arms; take the others as they are
        trained = run_all([a for a in todo if a["name"] in named], toml, quick_over,
                          args.cached_only, stored)  # fmt: skip
        rest = [a for a in todo if a["name"] not in named]
        return trained | run_all(rest, toml, quick_over, True, stored)

    runs = gather(arms)
    summarize(runs)
    config = load_config(str(toml), quick_over, check_environment=False)
    boundaries = config.layout_stages - 1
    tokens = config.training.local_batch_size * config.training.seq_len * boundaries

    def add_second_seeds(seeded: dict) -> None:
        for name, entry in seeded.items():
            runs[name]["seeds"].update(entry["seeds"])
        summarize(runs)

    # the second seeds measured already, then seed 1 of every frontier arm until the frontier
    # (which a second seed can move) holds no arm without it
    add_second_seeds(run_all([dict(a, seeds=[1]) for a in arms if a["name"] in runs], toml,
                             quick_over, True, stored))  # fmt: skip
    second: list[str] = []
    while not args.one_seed:
        todo = [dict(a, seeds=[1]) for a in arms
                if a["name"] in frontier(runs, tokens) and a["name"] not in second]  # fmt: skip
        if not todo:
            break
        second += [a["name"] for a in todo]
        add_second_seeds(gather(todo))
    meta = {
        "quick": args.quick,
        "toml": str(toml.relative_to(REPO)),
        "steps": config.training.steps,
        "tokens_per_step_boundary": tokens,
        "boundaries": boundaries,
        "where": f"{platform.machine()} CPU, {os.cpu_count()} cores, 1 process per run "
        f"({PARALLEL_RUNS} at a time), in-graph codecs at the 4-stage layout's boundaries"
        if not args.quick else "CPU (quick harness check)",
        "frontier": frontier(runs, tokens),
        "seed1_arms": [n for n in second if "1" in runs[n]["seeds"]],  # trained or found
        "not_run": [a["name"] for a in arms if a["name"] not in runs],
        "recipe_wall_s": None if args.cached_only or args.only else time.time() - started,
    }  # fmt: skip
    (args.out / "results.json").write_text(json.dumps({"meta": meta, "runs": runs}, indent=1))
    report(runs, meta, args.out)


def report(runs: dict, meta: dict, out: Path) -> None:
    (out / "table.md").write_text(render_table(runs, meta))
    plot(runs, meta, out / "frontier.png")
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
