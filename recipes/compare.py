"""Codec comparison: every boundary codec at matched compression ratios.

    python -m recipes.compare                 # full study: 22 runs (the first 18: 1 h 46 min)
    python -m recipes.compare --quick         # tiny model, few steps: checks the harness
    python -m recipes.compare --render-only   # table and plots from an existing results.json
    python -m recipes.compare --cached-only   # report the finished runs only (trains nothing)

Every run trains the reference workload (``configs/reference_cpu.toml``: Shakespeare, d=256,
8 layers laid out as 4 pipeline stages, 300 steps, validation every 50 steps) in one process with
``protocol.stages = 4``: the lossy codecs run in-graph at the 3 stage boundaries
(``protocol_models.wire.codecs``), the subspace codec is exact, and ResBM's learned bottleneck
(``[protocol] mode = "resbm"``, h = ``protocol.k``) and MAPL's learned projection and anchors
(``mode = "mapl"``, r = ``protocol.k``) are part of the model. All runs use the same optimizer
(``OPTIMIZER``: Muon on every block matrix -- ResBM's encoders and decoders included --, AdamW
elsewhere; MAPL's projections by StiefelMuon), so dense is a fair baseline. The byte table counts
the activation wire; MAPL's per-step gradient exchange between a boundary's two copies
(``wire/sync_bytes``, independent of the batch) is shown beside it, not in the ratio.
``--only ARM ...`` adds the named arms to the existing results.json and keeps its other runs
(arms in neither are left out, as not run). Runs this study's or the frontier study's
results.json already hold are taken from there while their wire still sends the bytes it sent
then; any other run trains (again).
Runs go through ``common.train_cached``, shared with the other studies.

Writes ``results/compare/{results.json,table.md,val_loss.png,error_vs_depth.png}``.
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
from recipes.common import (
    PARALLEL_RUNS,
    REFERENCE,
    REPO,
    canonical_overrides,
)
from recipes.common.arms import (
    FRONTIER,
    OPTIMIZER,
    QUICK,
    QUICK_TOML,
    arm,
    run_all,
    select_arms,
    stored_runs,
    summarize,
)
from recipes.error_vs_depth import error_vs_depth, plot_error

ARMS = [  # in training order: the seed pairs, 32x, 256x, 8x (then svd, TopK straight-through and
    # the learned ResBM bottleneck, added later: 32x with both seeds, 256x, 8x; then MAPL's learned
    # projection with anchors: 32x with both seeds, 8x, and with residual vector quantization of
    # the 2 coordinates, 1 byte of indices per token forward: 228x, in the 256x group; the second
    # seeds of subspace k=32 and ResBM h=32 last, where ResBM's 8x lead rests on their difference)
    arm("dense", "1x", "dense", [], (0, 1)),
    arm("subspace k=8", "32x", "subspace", [], (0, 1)),
    arm("lowrank k=8", "32x", "lowrank", ["--codec.rank", "8"], (0, 1)),
    arm("topk K=5", "32x", "topk", ["--codec.topk", "5"]),
    arm("quant int2", "32x", "quant", ["--codec.bits", "2"]),
    arm("subspace k=1", "256x", "subspace", ["--protocol.k", "1"]),
    arm("lowrank k=1", "256x", "lowrank", ["--codec.rank", "1"]),
    arm("subspace k=32", "8x", "subspace", ["--protocol.k", "32"], (0, 1)),
    arm("lowrank k=32", "8x", "lowrank", ["--codec.rank", "32"]),
    arm("topk K=21", "8x", "topk", ["--codec.topk", "21"]),
    arm("quant int4", "8x", "quant", ["--codec.bits", "4"]),
    arm("svd r=5", "32x", "svd", ["--codec.rank", "5"]),
    arm("svd r=1", "256x", "svd", ["--codec.rank", "1"]),
    arm("svd r=21", "8x", "svd", ["--codec.rank", "21"]),
    arm("topk K=5 (ST)", "32x", "topk",
        ["--codec.topk", "5", "--codec.topk_backward", "straight_through"]),
    arm("resbm h=8", "32x", "resbm", ["--protocol.k", "8"], (0, 1)),
    arm("resbm h=1", "256x", "resbm", ["--protocol.k", "1"]),
    arm("resbm h=32", "8x", "resbm", ["--protocol.k", "32"], (0, 1)),
    arm("mapl r=8", "32x", "mapl", ["--protocol.k", "8"], (0, 1)),
    arm("mapl r=32", "8x", "mapl", ["--protocol.k", "32"]),
    arm("mapl r=2 rvq 2x16", "256x", "mapl",
        ["--protocol.k", "2", "--protocol.rvq_stages", "2", "--protocol.rvq_codebook", "16"]),
]  # fmt: skip

QUICK_ARMS = [  # one arm of each kind (every codec is trained by the codec tests)
    arm("dense", "1x", "dense", [], (0, 1)),
    arm("subspace k=4", "16x", "subspace", []),
    arm("quant int2", "16x", "quant", ["--codec.bits", "2"]),
    arm("resbm h=4", "16x", "resbm", []),
    arm("mapl r=4", "16x", "mapl", []),
]


def only_meta(previous: dict, names: list[str], trained: list[str], wall_s: float) -> dict:
    """What the results' meta records of an ``--only`` pass over ``names`` (of which ``trained``
    ran in it) taking ``wall_s`` seconds, on top of the ``previous`` results' records:
    ``retrained`` (arms the previous results held, trained again because their wire changed:
    the bf16 quantizer scales) and ``added`` (new arms), each ``{"arms": [...], "wall_s": ...}``."""
    meta = {key: previous["meta"][key] for key in ("retrained", "added") if key in previous["meta"]}
    for key, arms in (("retrained", [n for n in trained if n in previous["runs"]]),
                      ("added", [n for n in names if n not in previous["runs"]])):  # fmt: skip
        if arms:
            before = meta.get(key, {"arms": [], "wall_s": 0.0})
            arms = [*before["arms"], *(n for n in arms if n not in before["arms"])]
            meta[key] = {"arms": arms, "wall_s": before["wall_s"] + wall_s}
    return meta


def render_table(results: dict, meta: dict) -> str:
    steps = meta["steps"]
    later = {"retrained": "Retrained later with `--only` (bf16 quantizer scales)",
             "added": "Added later with `--only`"}  # fmt: skip
    lines = [
        f"Reference workload, {steps} steps, optimizer `{OPTIMIZER}` on every arm; ran on "
        f"{meta['where']}; whole recipe {meta['recipe_wall_s'] / 60:.0f} min wall."
        + "".join(
            f" {text}: {', '.join(meta[key]['arms'])}, {meta[key]['wall_s'] / 60:.0f} min wall."
            for key, text in later.items()
            if key in meta
        ),
        "",
        "| ratio group | codec | final val loss (seeds) | ppl | gap vs dense | dense steps to "
        "reach (inflation) | fwd + bwd bytes/step | ratio (fwd only) | wall time/run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    by_ratio = sorted(results.items(), key=lambda item: float(item[1]["ratio_group"][:-1]))
    for name, e in by_ratio:  # grouped by ratio, in training order within a group
        finals = [f"{s['val_curve'][-1][1]:.3f}" for s in e["seeds"].values()]
        spread = f" ({' / '.join(finals)})" if len(finals) > 1 else ""
        loss = f"{e['final_val_loss']:.3f}{spread}"
        reach = e["dense_steps_to_reach"]
        if "steps" in reach:
            need = f"{reach['steps']:.0f} ({steps / reach['steps']:.2f}x)"
        elif "beyond" in reach:
            need = f"> {reach['beyond']} (beats dense)"
        else:
            need = f"< {reach['before']}"
        b, sync = e["bytes_per_step"], e.get("sync_bytes_per_step", 0)
        lines.append(
            f"| {e['ratio_group']} | {name} | {loss} | {e['perplexity']:.1f} | "
            f"{e['gap_vs_dense_pct']:+.2f}% | {need} | {b['fwd']:,} + {b['bwd']:,}"
            + (f" (+ {sync:,} sync)" if sync else "")
            + " | "
            f"{e['ratio']:.1f}x ({b['dense'] / 2 / b['fwd']:.1f}x) | {e['wall_s'] / 60:.1f} min |"
        )
    lines += [
        "",
        "Final val loss: mean over seeds (each seed's value in brackets). Dense steps to reach: "
        "where the dense mean validation curve (points every "
        f"{meta['val_freq']} steps) crosses the codec's final loss, linearly interpolated; "
        f"inflation = {steps} / that. Bytes: the packed payloads the codec emits per step "
        "(all microbatches and boundaries); ratio = dense bytes / (fwd + bwd).",
    ]
    return "\n".join(lines) + "\n"


def plot_val(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({e["ratio_group"] for e in results.values()} - {"1x"},
                    key=lambda g: float(g.rstrip("x")))  # fmt: skip
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), sharey=True)
    for ax, group in zip(list(getattr(axes, "flat", [axes])), groups, strict=True):
        names = [n for n, e in results.items() if e["ratio_group"] in ("1x", group)]
        for color, name in enumerate(names):
            for i, s in enumerate(results[name]["seeds"].values()):
                xs, ys = zip(*s["val_curve"], strict=True)
                ax.plot(xs, ys, "-", marker=".", color="k" if name == "dense" else f"C{color}",
                        alpha=1 if i == 0 else 0.45, label=name if i == 0 else None)  # fmt: skip
        ax.set_title(f"{group}")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        low = min(e["final_val_loss_min"] for e in results.values())
        ax.set_ylim(low - 0.1, low + 1.5)
    axes_list = list(getattr(axes, "flat", [axes]))
    axes_list[0].set_ylabel("validation loss")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "compare")
    parser.add_argument("--render-only", action="store_true",
                        help="table and plots from an existing results.json (no runs)")  # fmt: skip
    parser.add_argument("--cached-only", action="store_true",
                        help="report only the runs already finished in the cache")  # fmt: skip
    parser.add_argument("--only", nargs="+", metavar="ARM",
                        help="add these arms (and retrain the stored runs whose wire bytes "
                        "changed) to the existing results.json")  # fmt: skip
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        results = json.loads((args.out / "results.json").read_text())
        report(results, args.out)
        return

    started = time.time()
    if args.quick:  # keep the harness check's tiny runs out of the shared study cache
        common.RUN_CACHE = args.out / "runs"
    toml, quick_over, arms = (
        (QUICK_TOML, QUICK, QUICK_ARMS) if args.quick else (REFERENCE, [], ARMS)
    )
    kept, previous, to_run = {}, {}, arms
    if args.only:  # add the named arms to the existing results.json, keep its other runs
        previous = json.loads((args.out / "results.json").read_text())
        select_arms(parser, arms, args.only)
        kept = stored_runs(FRONTIER) | stored_runs(args.out / "results.json")
        to_run = [a for a in arms if a["name"] in args.only or a["name"] in previous["runs"]]
    runs = run_all(to_run, toml, quick_over, args.cached_only, stored=kept)
    summarize(runs)
    config = load_config(str(toml), quick_over, check_environment=False)
    results = {
        "meta": {
            "quick": args.quick,
            "toml": str(toml.relative_to(REPO)),
            "steps": config.training.steps,
            "val_freq": config.validator.freq,
            "optimizer": OPTIMIZER,
            "where": f"{platform.machine()} CPU, {os.cpu_count()} cores, 1 process per run "
            f"({PARALLEL_RUNS} runs at a time), in-graph codecs at the 4-stage layout's "
            "boundaries" if not args.quick else "CPU (quick harness check)",
        },
        "runs": runs,
        "not_run": [f"{a['name']} (seed {s})" for a in arms for s in a["seeds"]
                    if str(s) not in runs.get(a["name"], {}).get("seeds", {})],
    }  # fmt: skip
    if args.only:  # the dense and subspace runs it measures are not among the retrained arms
        results["error_vs_depth"] = previous["error_vs_depth"]
        results["meta"]["recipe_wall_s"] = previous["meta"]["recipe_wall_s"]
        results["meta"]["where"] = previous["meta"]["where"]  # how the kept runs were trained
        trained = [n for n, e in runs.items() if any(  # the named arms, or stale stored ones
            kept.get(canonical_overrides(seed["overrides"]), (None, None))[1] is not seed
            for seed in e["seeds"].values())]  # fmt: skip
        results["meta"].update(only_meta(previous, args.only, trained, time.time() - started))
    else:
        sub = "subspace k=4" if args.quick else "subspace k=8"
        sub_folder = REPO / runs[sub]["seeds"]["0"]["run"]
        dense_folder = REPO / runs["dense"]["seeds"]["0"]["run"]
        results["error_vs_depth"] = error_vs_depth(
            toml, quick_over, dense_folder, sub_folder, quick=args.quick
        )
        results["meta"]["recipe_wall_s"] = time.time() - started
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    report(results, args.out)


def report(results: dict, out: Path) -> None:
    table = render_table(results["runs"], results["meta"])
    if results.get("not_run"):
        table += f"\nNot run (no finished run in the cache): {', '.join(results['not_run'])}.\n"
    (out / "table.md").write_text(table)
    quick = " [quick]" if results["meta"]["quick"] else ""
    plot_val(results["runs"], out / "val_loss.png", f"Validation loss by ratio{quick}")
    plot_error(results["error_vs_depth"], out / "error_vs_depth.png", quick)
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
