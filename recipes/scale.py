"""Does the gap to the fair dense twin close with scale? Width and tokens, rank collapse, and a
data-driven subspace.

    python -m recipes.scale                 # trains what results/scale/results.json lacks
    python -m recipes.scale --render-only   # table and plots from results/scale/results.json
    python -m recipes.scale --only "d=512 dense 300 steps" ...   # only these arms' runs

The reference workload (``configs/reference_cpu.toml``: Shakespeare, 8 layers in a 4-stage
layout, validation on 32,768 held-out tokens), every arm with Muon on the same matrices as its
dense twin, two seeds (``debug.seed`` 0 and 1; ``protocol.seed`` fixed), each run one process
with ``protocol.stages = 4`` (the exact model a 4-process pipeline trains):

* width: d in {128, 256, 512} (64-wide heads) at k = d / 32, 300 steps: the dense twin, the
  exact subspace wire and the production-style 8-bit wire (``codec.bits = 8``) at that k;
* tokens: d = 256 at 1,200 steps (warm-up 80 instead of 20: the same schedule shape), the same
  three arms. 1,200 steps of 2,048 tokens read the bundled training text (~1.6M tokens) about
  1.5 times, so this trend mixes more tokens with repeated ones;
* rank collapse, on every dense twin's checkpoints over training (every ``steps / 6`` steps):
  the mean entropy effective rank of its residual writers upstream of the last boundary
  (``wo``, ``w2``), the share of their columns' energy in their top-k subspace, and the share of
  the boundary stream's energy (the blocks' writes ``x - E[t]``, 4 validation batches at the
  three boundaries) in its top-k principal subspace (``protocol_models.model.spectrum``); the
  exact subspace arms' final streams are measured too (100% by construction: the check that the
  measure can tell a constrained model from a dense one);
* a data-driven U at d = 256, k = 8: the principal subspace of a 50-step dense pilot's boundary
  stream over training text (``python -m protocol_models.pilot_basis``; the file
  ``results/scale/pilot_basis_d256_k8.safetensors`` and its sha256 are kept, never remade) as
  ``[protocol] basis_file``, against the random U of the exact arm.

Each finished run's summary goes into ``results/scale/results.json`` at once, so the study
resumes from it (the run cache ``results/runs`` need not survive); where the cache survives, a
dense twin or a run of 40 minutes or more (d = 512, 1,200 steps) that was cut short resumes from
its last checkpoint (every ``steps / 6`` steps). On a machine that stops before the study ends
and loses the run cache, ``--only`` takes the arms whose runs fit. Run wall times are as
measured, at ``PM_PARALLEL_RUNS`` runs at a time, summed over a resumed run's launches (with the
steps it repeated).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from protocol_models.hf.evaluate import batches, per_document_positions
from protocol_models.hf.hf_model import folder_record, load_causal_lm, model_folder
from protocol_models.hf.streams import boundary_blocks, boundary_moment, residual_writers
from protocol_models.model.spectrum import effective_rank, energy_share, second_moment
from protocol_models.training.checkpointing import complete_step_numbers
from recipes.common import (
    PARALLEL_RUNS,
    REFERENCE,
    REPO,
    launch_seconds,
    repo_relative,
    run_slot,
    seed_cells,
    seed_gaps,
    study_main,
    train_cached,
    validation_curve,
    wall_seconds,
    write_report,
    write_results,
)
from recipes.common.arms import wire_bytes

OUT = REPO / "results" / "scale"
RESULTS = OUT / "results.json"
WIDTHS = (128, 256, 512)
K_PER_D = 32
SEEDS = (0, 1)
STEPS = (300, 1200)
PILOT_STEPS = 50
PILOT_D = 256
PILOT_BASIS = OUT / f"pilot_basis_d{PILOT_D}_k{PILOT_D // K_PER_D}.safetensors"
TRAIN_TEXT = REPO / ".cache" / "shakespeare" / "train.jsonl"
"""What the pilot's basis is read from: training text, so the validation rows every arm is
scored on stay unseen by it."""
STREAM_BATCHES = 4
"""Validation batches (of 8 x 256 tokens) whose boundary stream the diagnostics read."""


@dataclass(frozen=True)
class Arm:
    """One row of the study: a width, a wire and a token budget."""

    d: int
    wire: str
    """``dense``, ``exact`` (the subspace wire at fp32), ``8-bit`` or ``pilot U`` (exact, U from
    the dense pilot)."""
    steps: int = STEPS[0]

    @property
    def k(self) -> int:
        return self.d // K_PER_D

    @property
    def name(self) -> str:
        return f"d={self.d} {self.wire} {self.steps} steps"

    @property
    def resumable(self) -> bool:
        """Whether its runs save checkpoints every ``steps / 6`` steps, which a run cut short
        (a session's end) resumes from: the dense twins (their spectra read them all) and the
        runs of 40 minutes or more (d = 512, 1,200 steps); the shorter subspace arms save only
        their final weights (the d = 256 ones keep the codec comparison's overrides, and so its
        cached runs)."""
        return self.wire == "dense" or self.d > 256 or self.steps > STEPS[0]

    def overrides(self, seed: int) -> list[str]:
        """The run's overrides of the reference workload (none for what it already says: the
        d = 256, 300-step arms are the codec comparison's runs, and share its cache)."""
        width = []
        if self.d != 256:
            width = ["--model.dim", str(self.d), "--model.n_heads", str(self.d // 64),
                     "--protocol.k", str(self.k)]  # fmt: skip
        budget, every = [], str(self.steps // 6)
        if self.steps != STEPS[0]:
            budget = ["--training.steps", str(self.steps), "--lr_scheduler.warmup_steps",
                      str(20 * self.steps // STEPS[0]), "--validator.freq", every]  # fmt: skip
        checkpoints = []
        if self.resumable:  # a dense twin keeps all for its spectra, another run its newest two
            checkpoints = ["--checkpoint.interval", every, "--checkpoint.keep_latest_k",
                           "0" if self.wire == "dense" else "2"]  # fmt: skip
        wire = {
            "dense": ["--protocol.mode", "dense"],
            "exact": [],
            "8-bit": ["--codec.bits", "8"],
            "pilot U": ["--protocol.basis_file", repo_relative(PILOT_BASIS)],
        }[self.wire]
        return [*width, *budget, *checkpoints, *wire, "--optimizer.name", "muon",
                "--debug.seed", str(seed)]  # fmt: skip


ARMS = [
    *(Arm(d, wire) for d in WIDTHS for wire in ("dense", "exact", "8-bit")),
    Arm(256, "pilot U"),
    *(Arm(256, wire, STEPS[1]) for wire in ("dense", "exact", "8-bit")),
]
PHASES = [
    [a for a in ARMS if a.d < 512 and a.steps == STEPS[0] and a.wire != "pilot U"],
    [a for a in ARMS if a.wire == "pilot U"] + [a for a in ARMS if a.d == 512],  # short first
    [a for a in ARMS if a.steps == STEPS[1]],
]
"""The order the study trains in: the cheap widths first, then what needs the pilot or costs
most; a session that stops between phases leaves complete rows behind."""


def load_results() -> dict:
    if RESULTS.is_file():
        return json.loads(RESULTS.read_text())
    return {"runs": {}, "pilot": None}


_SAVE = threading.Lock()
"""Held while a run's entry joins the results and they are written."""


def save(results: dict) -> None:
    write_results(RESULTS, results)


_SPECTRA = threading.Lock()
"""One checkpoint measured at a time (two threads importing transformers at once can fail)."""


def spectra(folder: Path, k: int, step: int) -> dict:
    """The concentration measures of one checkpoint of a run (see the module docstring),
    computed in a run slot on one thread, so they do not slow a run being timed."""
    source = argparse.Namespace(hf=None, checkpoint=str(folder / "checkpoint"), step=step,
                                toml=None, overrides=[])  # fmt: skip
    rows = argparse.Namespace(text=None, seq_len=None, batch_size=None, steps=STREAM_BATCHES)
    with _SPECTRA, run_slot(), model_folder(source) as hf:
        record = folder_record(hf)
        model = load_causal_lm(hf)
        blocks = boundary_blocks(record)
        stream, _ = boundary_moment(model, batches(hf, record, rows), blocks,
                                    per_document_positions(record))  # fmt: skip
        writers = residual_writers(model, blocks)
    columns = second_moment(torch.cat(writers, dim=1).T)  # the writers' output directions
    return {
        "step": step,
        "stream_share": energy_share(stream, k),
        "writer_share": energy_share(columns, k),
        "writer_effective_rank": statistics.fmean(effective_rank(w) for w in writers),
    }


def measure(arm: Arm, seed: int) -> dict:
    """Train (or find in the run cache) one run and summarize it."""
    over = arm.overrides(seed)
    folder = train_cached(over)
    curve = validation_curve(folder)
    entry = {
        "run": repo_relative(folder),
        "overrides": over,
        "val_curve": curve,
        "final_val_loss": curve[-1][1],
        "wall_s": wall_seconds(folder),
        "launches": len(launch_seconds(folder)),
    }
    if arm.wire == "dense":
        steps = complete_step_numbers(str(folder / "checkpoint"))
        entry["spectra"] = [spectra(folder, arm.k, s) for s in steps]
    elif arm.wire == "exact":
        last = complete_step_numbers(str(folder / "checkpoint"))[-1]
        entry["spectra"] = [spectra(folder, arm.k, last)]
    return entry


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def make_pilot(results: dict) -> None:
    """The 50-step dense pilot at d = 256 and its basis file. A file that exists is kept
    (its sha256 recorded, or checked against the record): the pilot arm's runs, finished or
    cached, were trained on it, so a resumed study must never remake it."""
    pilot = results.get("pilot")
    if PILOT_BASIS.is_file():
        digest = _sha256(PILOT_BASIS)
        if pilot is None:
            results["pilot"] = {"sha256": digest, "adopted": repo_relative(PILOT_BASIS)}
            save(results)
        elif pilot["sha256"] != digest:
            raise SystemExit(
                f"{PILOT_BASIS} is not the file the pilot arm's runs used (sha256 {digest[:12]}, "
                f"recorded {pilot['sha256'][:12]}): restore it, or delete both it and the pilot "
                "arm's results to start that arm over"
            )
        return
    k = PILOT_D // K_PER_D
    over = ["--protocol.mode", "dense", "--training.steps", str(PILOT_STEPS),
            "--lr_scheduler.warmup_steps", str(20 * PILOT_STEPS // STEPS[0]),
            "--validator.freq", str(PILOT_STEPS), "--optimizer.name", "muon",
            "--debug.seed", "0"]  # fmt: skip
    folder = train_cached(over)
    made = subprocess.run(
        [sys.executable, "-m", "protocol_models.pilot_basis", "--checkpoint",
         str(folder / "checkpoint"), "--k", str(k), "--out", str(PILOT_BASIS),
         "--steps", str(STREAM_BATCHES), "--text", str(TRAIN_TEXT)],
        cwd=REPO, capture_output=True, text=True,
    )  # fmt: skip
    if made.returncode != 0:
        raise SystemExit(f"pilot_basis failed: {made.stderr.strip()}")
    results["pilot"] = {"run": repo_relative(folder), "overrides": over,
                        "wall_s": wall_seconds(folder), "said": made.stdout.strip(),
                        "sha256": _sha256(PILOT_BASIS)}  # fmt: skip
    save(results)


def run_study(names: set[str] | None = None) -> None:
    """Train every run ``results.json`` lacks, phase by phase; with ``names``, only those arms'
    (a session shorter than the study can take the runs that fit in it)."""
    results = load_results()
    for phase in PHASES:
        phase = [a for a in phase if names is None or a.name in names]
        if any(a.wire == "pilot U" for a in phase):
            make_pilot(results)
        jobs = [(a, s) for a in phase for s in SEEDS if str(s) not in
                results["runs"].get(a.name, {}).get("seeds", {})]  # fmt: skip

        def one(job):
            arm, seed = job
            entry = measure(arm, seed)
            with _SAVE:
                row = results["runs"].setdefault(arm.name, {
                    "d": arm.d, "k": arm.k, "wire": arm.wire, "steps": arm.steps,
                    "ratio": _ratio(arm), "seeds": {}})  # fmt: skip
                row["seeds"][str(seed)] = entry
            save(results)
            print(f"done: {arm.name} seed {seed} ({entry['wall_s']:.0f} s)", flush=True)

        with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
            list(pool.map(one, jobs))


def _ratio(arm: Arm) -> float:
    b = wire_bytes(REFERENCE, arm.overrides(0))
    return b["dense"] / (b["fwd"] + b["bwd"])


def gaps(results: dict, arm: Arm) -> list[float] | None:
    """Per seed, the arm's gap to its dense twin in percent (``seed_gaps``)."""
    runs = results["runs"]
    return seed_gaps(runs.get(arm.name), runs.get(Arm(arm.d, "dense", arm.steps).name), SEEDS)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` on ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def width_fit(
    points: dict[int, list[float]], scale: Callable[[float], float] = lambda g: g
) -> dict:
    """Slope of ``scale(gap)`` on log2 d, for each seed alone and pooled over seeds."""
    xs = [math.log2(d) for d in WIDTHS]
    return {
        "per seed": [slope(xs, [scale(points[d][i]) for d in WIDTHS]) for i in range(len(SEEDS))],
        "pooled": slope([x for x in xs for _ in SEEDS],
                        [scale(g) for d in WIDTHS for g in points[d]]),
    }  # fmt: skip


def trends(results: dict) -> dict:
    """The fitted directions, per wire, for each seed alone (their spread is the uncertainty)
    and pooled: at 300 steps the gap (percentage points) per doubling of d — a straight line in
    log d — and, where every gap is positive, the factor the gap is multiplied by per doubling
    of d (a power law, fitted as log2 gap on log2 d); at d = 256 the gap per quadrupling of
    tokens. Each entry carries the format its figures print with (signed for points)."""
    out = {}
    for wire in ("exact", "8-bit"):
        points = {d: gaps(results, Arm(d, wire)) for d in WIDTHS}
        if all(points.values()):
            out[f"{wire} per doubling of d"] = {**width_fit(points), "format": "+.2f"}
            if all(g > 0 for gap in points.values() for g in gap):
                logs = width_fit(points, scale=math.log2)
                out[f"{wire} factor per doubling of d"] = {
                    "per seed": [2**s for s in logs["per seed"]],
                    "pooled": 2 ** logs["pooled"],
                    "format": ".2f",
                }
        short, long = gaps(results, Arm(256, wire)), gaps(results, Arm(256, wire, STEPS[1]))
        if short and long:
            out[f"{wire} per 4x tokens"] = {
                "per seed": [b - a for a, b in zip(short, long, strict=True)],
                "pooled": statistics.fmean(long) - statistics.fmean(short),
                "format": "+.2f",
            }
    return out


def render_table(results: dict) -> str:
    lines = [
        "| arm | k | ratio | steps | final val loss (seed 0 / 1) "
        "| gap vs dense twin, % (seed 0 / 1) | wall s per run (seeds' mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        row = results["runs"].get(arm.name)
        if row is None:
            lines.append(f"| {arm.name} | {arm.k} | | {arm.steps} | not run yet | | |")
            continue
        losses, gap_text, wall = seed_cells(row, SEEDS, gaps(results, arm))
        gap_text = "" if arm.wire == "dense" else gap_text
        lines.append(
            f"| {arm.name} | {arm.k} | {row['ratio']:.0f}x | {arm.steps} | {losses} | {gap_text} "
            f"| {wall:.0f} |"
        )
    trained = [e for row in results["runs"].values() for e in row["seeds"].values()]
    pilot = results.get("pilot") or {}
    total_h = (sum(e["wall_s"] for e in trained) + pilot.get("wall_s", 0)) / 3600
    and_pilot = " and the pilot's" if "wall_s" in pilot else ""
    lines += ["", f"The {len(trained)} of {len(ARMS) * len(SEEDS)} runs trained so far{and_pilot}: "
              f"wall times sum to {total_h:.1f} h (one process on one core each; no link, so "
              "they say nothing of the wire's speed)."]  # fmt: skip
    title = "Rank collapse (dense twins, seed 0; the exact arms' final stream, for reference):"
    lines += ["", title, "",
              "| run | step | stream top-k share | writers top-k share "
              "| writer eff. rank (mean) |", "|---|---|---|---|---|"]  # fmt: skip
    for arm in ARMS:
        entry = results["runs"].get(arm.name, {}).get("seeds", {}).get("0")
        for s in (entry or {}).get("spectra", []):
            lines.append(
                f"| {arm.name} | {s['step']} | {s['stream_share']:.3f} | "
                f"{s['writer_share']:.3f} | {s['writer_effective_rank']:.1f} |"
            )
    fitted = trends(results)
    if fitted:
        lines += ["", "Fitted directions (gap in percentage points, or the factor it is "
                  "multiplied by; per seed, pooled):", ""]  # fmt: skip
        for name, t in fitted.items():
            per_seed = ", ".join(f"{v:{t['format']}}" for v in t["per seed"])
            lines.append(f"- {name}: {per_seed}; pooled {t['pooled']:{t['format']}}")
    return "\n".join(lines) + "\n"


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (width, tokens, rank) = plt.subplots(1, 3, figsize=(15, 4.2))
    for wire, marker in (("exact", "o"), ("8-bit", "s"), ("pilot U", "^")):
        for axis, arms in ((width, [Arm(d, wire) for d in WIDTHS]),
                           (tokens, [Arm(256, wire, s) for s in STEPS])):  # fmt: skip
            xs, means, lows, highs = [], [], [], []
            for arm in arms:
                g = gaps(results, arm)
                if g:
                    xs.append(arm.d if axis is width else arm.steps)
                    means.append(statistics.fmean(g))
                    lows.append(means[-1] - min(g))
                    highs.append(max(g) - means[-1])
            if xs:
                axis.errorbar(xs, means, yerr=[lows, highs], marker=marker, capsize=4, label=wire)
    for d in WIDTHS:
        entry = results["runs"].get(Arm(d, "dense").name, {}).get("seeds", {}).get("0")
        if entry:
            spectra_ = entry["spectra"]
            rank.plot([s["step"] for s in spectra_], [s["stream_share"] for s in spectra_],
                      marker="o", label=f"d={d}, k={d // K_PER_D}")  # fmt: skip
    width.set(xscale="log", xlabel="model width d (k = d/32)", ylabel="gap vs dense twin (%)",
              title="Gap vs width (300 steps, 2 seeds)")  # fmt: skip
    width.set_xticks(WIDTHS, [str(d) for d in WIDTHS])
    tokens.set(xscale="log", xlabel="training steps (d = 256)", ylabel="gap vs dense twin (%)",
               title="Gap vs tokens (2 seeds)")  # fmt: skip
    tokens.set_xticks(STEPS, [str(s) for s in STEPS])
    rank.set(xlabel="step", ylabel="top-k share of the stream's energy",
             title="Dense twins: boundary stream in its top-k subspace")  # fmt: skip
    for axis in (width, tokens, rank):
        axis.grid(alpha=0.3)
        axis.legend()
    for axis in (width, tokens):
        axis.axhline(0, color="grey", lw=0.8)
        axis.set_xticks([], minor=True)  # only the measured widths and budgets are labelled
    fig.tight_layout()
    fig.savefig(OUT / "scale.png", dpi=120)


def report() -> None:
    results = load_results()
    write_report(OUT, render_table(results), lambda: plot(results))


def main() -> None:
    torch.set_num_threads(1)  # the recipe's own computing shares the machine with its runs
    study_main("python -m recipes.scale", [a.name for a in ARMS], run_study, report)


if __name__ == "__main__":
    main()
