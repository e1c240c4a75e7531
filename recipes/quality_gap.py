"""Closing the quality gap at the same bytes: width over precision, constrain only what crosses,
the token table, and whether the gap levels off.

    python -m recipes.quality_gap                  # trains what results/quality_gap lacks
    python -m recipes.quality_gap --render-only    # table and plot from its results.json
    python -m recipes.quality_gap --only "projected k=8 4x2 1200 steps" ...   # only these arms

The reference workload (``configs/reference_cpu.toml``: d = 256, 8 layers, Shakespeare) under
Muon on the same matrices in every arm, each run one process building the model of its layout
(``protocol.stages``), two seeds (``debug.seed`` 0 and 1; ``protocol.seed`` fixed). Every gap is
an arm's final validation loss over its fair dense twin's (same seed, same steps), in percent:

* today's mode, ``subspace`` (every writer upstream of the last boundary confined to span(U)),
  at k = 8 exact (32 bytes per token per boundary) and 8-bit (10 bytes: 8 codes and a bf16
  scale);
* width over precision: ``subspace`` at k = 30 with 8-bit coordinates: 32 bytes per token, the
  bytes of k = 8 in fp32;
* constrain only what crosses: ``projected`` mode (full-width writers, the stream projected onto
  ``F[t] + span(U)`` at each boundary only; ``protocol_models.model.model``) at k = 8 exact,
  the same bytes as the subspace arms;
* layouts: the reference's 4 stages of 2 blocks (``4x2``), where 6 of 8 blocks are constrained,
  and 2 stages of 4 (``2x4``), where 4 are; the dense twin does not depend on the layout (no
  block is constrained, and Muon treats every block matrix alike), so both layouts share it;
* the token table: the dense twin with its embedding frozen at its random initialization
  (``model.freeze_embedding``): if it loses most of its lead, the frozen table every
  downstream stage reads tokens through is what the compressed models lack; and the remedy at
  zero bytes, ``projected`` with ``stage_tables`` (each receiving stage's own learned table),
  and the dense twin given the same tables (``dense`` with ``stage_tables``: the same
  parameters, no projection), which prices the tables' capacity;
* the levers combined: ``projected`` at k = 30 in 8 bits with stage tables;
* the step size: Muon's step on the writers upstream of the last boundary doubled
  (``optimizer.writer_lr_scale = 2``) in today's mode and in its dense twin (the same
  matrices);
* the token trend: 300, 1,200 and 2,400 steps (warm-up and the validation and checkpoint
  intervals scaled with the budget; the 2,400-step pair is the dense twin and ``projected``
  with stage tables). 1,200 steps of 2,048 tokens read the bundled training text
  (~1.6M tokens) ~1.5 times, 2,400 steps ~3 times;
* the token trend where no text repeats: the dense twin, today's mode and ``projected`` with
  stage tables at 300 and 990 steps on the State of the Union addresses
  (``recipes.common.speeches``, 2.11M training tokens): a gap that widens here is not the dense
  twin memorising repeated text.

For every projected run the share of its stream that each boundary's projection discards is
measured from its checkpoint (``discarded_share``) and stored with its result. Every run stores
its mean training loss over each twelfth of its steps too (``train_loss``): on the 2,400-step
pair, which rereads the bundled text, the gap in training loss beside the gap in validation loss
shows what the dense twin spends on text it has read before. The report's last
table is time to today's loss at the production shapes, predicted: the steps
each lever's 1,200-step arm took to reach today's mode's final loss, times the planner's
tokens/s of the 2B and 8B configs with the lever's settings (``LEVERS_AT_SCALE``).

The dense twins and today's subspace arms at 300 and 1,200 steps are the scale study's runs
(``results/scale/results.json``, the same overrides), read from there and never retrained.

Each finished run's summary goes into ``results/quality_gap/results.json`` at once, so the study
resumes from it; a run cut short (a session's end) resumes from its last checkpoint (every
``steps / 6`` steps) where the run cache ``results/runs`` survives. Wall times are as measured,
with ``PM_PARALLEL_RUNS`` runs at a time, summed over a resumed run's launches.
"""

from __future__ import annotations

import json
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from protocol_models.training.metrics import read_jsonl
from recipes.common import (
    PARALLEL_RUNS,
    REFERENCE,
    REPO,
    launch_seconds,
    repo_relative,
    seed_cells,
    seed_gaps,
    speeches,
    steps_to_reach,
    study_main,
    train_cached,
    validation_curve,
    wall_seconds,
    write_report,
    write_results,
)
from recipes.common.arms import wire_bytes

OUT = REPO / "results" / "quality_gap"
RESULTS = OUT / "results.json"
SCALE = REPO / "results" / "scale" / "results.json"
SEEDS = (0, 1)
TRAIN_WINDOWS = 12
REFERENCE_STAGES = 4
REFERENCE_STEPS = 300
SPEECHES_STEPS = 990
"""The speeches' long budget (a multiple of 6, so the last validation is the last step's): 990
steps of 8 x 256 tokens read 2.03M of its 2.11M training tokens, none twice."""
SHORTER = {1200: REFERENCE_STEPS, SPEECHES_STEPS: REFERENCE_STEPS, 2400: 1200}
"""The budget each longer one's gap is compared with."""
CORPORA = {"shakespeare": [], "speeches": speeches.OVERRIDES}
"""Each corpus's overrides of the reference workload."""


@dataclass(frozen=True)
class Arm:
    """One row: a boundary method at a width and precision, a layout and a token budget."""

    method: str
    """``dense``, ``subspace`` or ``projected`` (``[protocol] mode``)."""
    k: int = 8
    bits: int = 0
    """``[codec] bits`` of the coordinates (0: exact, fp32)."""
    stages: int = REFERENCE_STAGES
    steps: int = REFERENCE_STEPS
    frozen_embedding: bool = False
    stage_tables: bool = False
    """``[protocol] stage_tables``: each receiving stage's own token table (``projected``, or
    ``dense``: the tables' fair twin)."""
    writer_lr_scale: float = 1.0
    """``[optimizer] writer_lr_scale``: Muon's step on the upstream writers (twin included)."""
    corpus: str = "shakespeare"
    """``shakespeare`` (the reference's bundled text) or ``speeches`` (``recipes.common.speeches``,
    which no run of ``SPEECHES_STEPS`` or fewer reads twice)."""
    scale_name: str | None = None
    """The scale study's name of this arm, whose runs it reads instead of training."""

    def __post_init__(self) -> None:
        if self.corpus not in CORPORA:
            raise ValueError(f"corpus = {self.corpus!r}: one of {sorted(CORPORA)}")

    @property
    def name(self) -> str:
        step = f" writer step x{self.writer_lr_scale:g}" if self.writer_lr_scale != 1 else ""
        corpus = f" on {self.corpus}" if self.corpus != "shakespeare" else ""
        budget = f"{corpus} {self.steps} steps"
        if self.method == "dense":
            what = "dense, frozen embedding" if self.frozen_embedding else "dense"
            tables = " + stage tables" if self.stage_tables else ""
            return f"{what}{tables}{step}{budget}"
        bits = f" {self.bits}-bit" if self.bits else ""
        tables = " + stage tables" if self.stage_tables else ""
        layers = 8 // self.stages
        return f"{self.method} k={self.k}{bits}{tables}{step} {self.stages}x{layers}{budget}"

    @property
    def twin(self) -> Arm:
        """The fair dense twin: the same steps, seeds and writer step, every block
        unconstrained."""
        if self.writer_lr_scale != 1 or self.corpus != "shakespeare":
            return Arm("dense", steps=self.steps, writer_lr_scale=self.writer_lr_scale,
                       corpus=self.corpus)  # fmt: skip
        return dense(self.steps)

    def overrides(self, seed: int) -> list[str]:
        """The run's overrides of the reference workload (a checkpoint every ``steps / 6``
        steps, the newest two kept: a run cut short resumes). The scale study's arms are never
        trained here: their overrides are the ones its results record."""
        budget = []
        if self.steps != REFERENCE_STEPS:
            warmup = str(20 * self.steps // REFERENCE_STEPS)
            budget = ["--training.steps", str(self.steps), "--lr_scheduler.warmup_steps",
                      warmup, "--validator.freq", str(self.steps // 6)]  # fmt: skip
        checkpoints = ["--checkpoint.interval", str(self.steps // 6),
                       "--checkpoint.keep_latest_k", "2"]  # fmt: skip
        method = [] if self.method == "subspace" else ["--protocol.mode", self.method]
        width = ["--protocol.k", str(self.k)] if self.k != 8 else []
        bits = ["--codec.bits", str(self.bits)] if self.bits else []
        layout = ["--protocol.stages", str(self.stages)] if self.stages != REFERENCE_STAGES else []
        frozen = ["--model.freeze_embedding"] if self.frozen_embedding else []
        tables = ["--protocol.stage_tables", "true"] if self.stage_tables else []
        step = (["--optimizer.writer_lr_scale", f"{self.writer_lr_scale:g}"]
                if self.writer_lr_scale != 1 else [])  # fmt: skip
        return [*budget, *checkpoints, *method, *width, *bits, *layout, *frozen, *tables, *step,
                *CORPORA[self.corpus], "--optimizer.name", "muon",
                "--debug.seed", str(seed)]  # fmt: skip


def dense(steps: int) -> Arm:
    return Arm("dense", steps=steps, scale_name=f"d=256 dense {steps} steps" if steps in
               (300, 1200) else None)  # fmt: skip


def today(steps: int, bits: int = 0) -> Arm:
    scale = f"d=256 {'8-bit' if bits else 'exact'} {steps} steps" if steps in (300, 1200) else None
    return Arm("subspace", bits=bits, steps=steps, scale_name=scale)


SAME_BYTES = [Arm("subspace", k=30, bits=8), Arm("projected"), Arm("projected", stage_tables=True)]
"""The same-bytes candidates at the reference layout (32 bytes per token per boundary)."""
COMBINED = Arm("projected", k=30, bits=8, stage_tables=True)
"""The levers together: width over precision, projection only at the boundary, stage tables."""
PHASES: list[list[Arm]] = [
    [dense(1200), today(1200), today(1200, 8), replace(SAME_BYTES[2], steps=1200),
     replace(COMBINED, steps=1200)],
    [Arm("dense", steps=1200, stage_tables=True)],
    [dense(300), today(300), today(300, 8), *SAME_BYTES, COMBINED],
    [Arm("subspace", stages=2), Arm("projected", stages=2),
     Arm("projected", stages=2, stage_tables=True)],
    [replace(SAME_BYTES[0], steps=1200), replace(SAME_BYTES[1], steps=1200),
     Arm("dense", steps=1200, frozen_embedding=True)],
    [Arm("subspace", steps=1200, writer_lr_scale=2), Arm("dense", steps=1200, writer_lr_scale=2)],
    [Arm(method, steps=steps, stage_tables=tables, corpus="speeches")
     for steps in (REFERENCE_STEPS, SPEECHES_STEPS)
     for method, tables in (("dense", False), ("subspace", False), ("projected", True))],
    [dense(2400), replace(SAME_BYTES[2], steps=2400)],
]  # fmt: skip
"""The order the study trains in: the best configurations at 1,200 steps (the acceptance
budget), the dense twin given the same stage tables (what the tables' capacity is worth without
the projection), the 300-step points of every same-bytes arm (does the gap widen?), the 2-stage
layout, the single levers and the token-table diagnostic at 1,200 steps, the step-size arm, the
token trend on the speeches (dense, today's mode and the best lever at 300 and 990 steps), the
2,400-step pair. Within a phase every arm's first seed trains before any second one; the next
phase's runs start as slots free up."""
ARMS = [a for phase in PHASES for a in phase]


def load_results() -> dict:
    """This study's results, with the scale study's runs of the arms it shares read in."""
    results = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {"runs": {}}
    scale = json.loads(SCALE.read_text())["runs"]
    for arm in ARMS:
        if arm.scale_name and arm.scale_name in scale:
            row = dict(scale[arm.scale_name], source=repo_relative(SCALE))
            row["seeds"] = {s: {key: e[key] for key in ("overrides", "val_curve",
                            "final_val_loss", "wall_s") if key in e}
                            for s, e in row["seeds"].items()}  # fmt: skip
            results["runs"][arm.name] = row
    return results


_SAVE = threading.Lock()
"""Held while a run's entry joins the results and they are written."""


def save(results: dict) -> None:
    """Write the study's own runs (not the rows read from the scale study)."""
    own = {name: row for name, row in results["runs"].items() if "source" not in row}
    write_results(RESULTS, {"runs": own})


def bytes_per_token(arm: Arm) -> dict:
    """Bytes per token per boundary forward, and the compression ratio against the dense
    wire (``recipes.common.arms.wire_bytes`` of the run's config, pipelined as its layout)."""
    over = [*arm.overrides(0), "--parallelism.pipeline_parallel_degree", str(arm.stages)]
    b = wire_bytes(REFERENCE, over)
    tokens = 8 * 256 * (arm.stages - 1)  # the reference: batch 8 x 256 tokens per step
    return {"fwd_bytes_per_token": b["fwd"] / tokens, "ratio": b["dense"] / (b["fwd"] + b["bwd"])}


def measure(arm: Arm, seed: int) -> dict:
    """Train (or find in the run cache) one run and summarize it."""
    over = arm.overrides(seed)
    folder = train_cached(over)
    curve = validation_curve(folder)
    entry = {"run": repo_relative(folder), "overrides": over, "val_curve": curve,
             "final_val_loss": curve[-1][1], "wall_s": wall_seconds(folder),
             "launches": len(launch_seconds(folder))}  # fmt: skip
    entry["train_loss"] = train_loss(folder, arm.steps)
    if arm.method == "projected":
        entry["discarded_share"] = discarded_share(folder)
    return entry


def train_loss(folder: Path, steps: int) -> list[tuple[int, float]]:
    """``[(end, loss)]``: the mean logged training loss over the steps in ``(end - steps / 12,
    end]``, for each twelfth of the run. Both arms of a pair read the same batches in the same
    order (same seed), so their windows compare batch for batch."""
    logged = {r["step"]: r["loss"] for r in read_jsonl(folder / "metrics.jsonl") if "loss" in r}
    width = steps // TRAIN_WINDOWS
    return [(end, statistics.fmean(v for s, v in logged.items() if end - width < s <= end))
            for end in range(width, steps + 1, width)]  # fmt: skip


def add_measurements(results: dict) -> None:
    """The measurements added after some runs finished (``train_loss``, and ``discarded_share``
    for projected runs), for those whose run folder is still in the run cache."""
    for arm in ARMS:
        row = results["runs"].get(arm.name)
        for entry in (row["seeds"].values() if row and "source" not in row else ()):
            folder = REPO / entry["run"]
            if "train_loss" not in entry and (folder / "metrics.jsonl").is_file():
                entry["train_loss"] = train_loss(folder, arm.steps)
            if (arm.method == "projected" and "discarded_share" not in entry
                    and (folder / "checkpoint").is_dir()):  # fmt: skip
                entry["discarded_share"] = discarded_share(folder)


def run_study(names: set[str] | None = None) -> None:
    """Train every run results.json lacks, phase by phase, every arm's first seed before any
    second one (with ``names``, only those arms')."""
    results = load_results()
    add_measurements(results)
    save(results)
    jobs = [(a, s) for phase in PHASES for s in SEEDS for a in phase
            if names is None or a.name in names
            if str(s) not in results["runs"].get(a.name, {}).get("seeds", {})]  # fmt: skip
    if any(arm.corpus == "speeches" for arm, _ in jobs):
        speeches.prepare(REPO / speeches.DEFAULT_CACHE)

    def one(job):
        arm, seed = job
        entry = measure(arm, seed)
        with _SAVE:
            row = results["runs"].setdefault(
                arm.name, {"arm": asdict(arm), **bytes_per_token(arm), "seeds": {}}
            )
            row["seeds"][str(seed)] = entry
            save(results)
        print(f"done: {arm.name} seed {seed} ({entry['wall_s']:.0f} s)", flush=True)

    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        list(pool.map(one, jobs))


def gaps(results: dict, arm: Arm) -> list[float] | None:
    """Per seed, the arm's gap to its dense twin in percent (``seed_gaps``)."""
    runs = results["runs"]
    return seed_gaps(runs.get(arm.name), runs.get(arm.twin.name), SEEDS)


def render_table(results: dict) -> str:
    lines = [
        "| arm | bytes/token fwd | ratio | final val loss (seed 0 / 1) "
        "| gap vs dense twin, % (seed 0 / 1) | wall s per run (mean) |",
        "|---|---|---|---|---|---|",
    ]
    for arm in ARMS:
        row = results["runs"].get(arm.name)
        if row is None:
            lines.append(f"| {arm.name} | | | not run yet | | |")
            continue
        sizes = bytes_per_token(arm)
        partial = seed_gaps(row, results["runs"].get(arm.twin.name), SEEDS, partial=True)
        losses, gap, wall = seed_cells(row, SEEDS, partial)
        plain_twin = arm.method == "dense" and not (arm.frozen_embedding or arm.stage_tables)
        gap = "" if plain_twin else gap
        source = " (scale study)" if "source" in row else ""
        lines.append(
            f"| {arm.name}{source} | {sizes['fwd_bytes_per_token']:.0f} | {sizes['ratio']:.0f}x "
            f"| {losses} | {gap} | {wall:.0f} |"
        )
    lines += ["", "Does the gap widen with tokens (its change in percentage points from the "
              "shorter budget to the longer, per seed)?", ""]  # fmt: skip
    names = {a.name for a in ARMS}
    for long in ARMS:
        short = replace(long, steps=SHORTER.get(long.steps, 0), scale_name=None)
        if long.method == "dense" or short.name not in names:
            continue
        a, b = gaps(results, short), gaps(results, long)
        change = ", ".join(f"{y - x:+.2f}" for x, y in zip(a, b, strict=True)) if a and b else (
            "pending")  # fmt: skip
        what = long.name.removesuffix(f" {long.steps} steps")
        lines.append(f"- {what}, {short.steps:,} to {long.steps:,} steps: {change}")
    trained = [e for row in results["runs"].values() if "source" not in row
               for e in row["seeds"].values()]  # fmt: skip
    hours = sum(e["wall_s"] for e in trained) / 3600
    lines.append(render_discarded(results))
    lines.append(render_rereading(results))
    lines.append(render_time_to_target(results))
    lines += ["", f"This study trained {len(trained)} runs so far ({hours:.1f} h of wall time, "
              "one process on one core each); the rows marked (scale study) are that study's "
              "runs, read from results/scale/results.json."]  # fmt: skip
    return "\n".join(lines) + "\n"


PRODUCTION = {"2B": REPO / "configs" / "llama3_2b_protocol.toml",
              "8B": REPO / "configs" / "llama3_8b_protocol.toml"}  # fmt: skip
LEVERS_AT_SCALE = [
    (replace(SAME_BYTES[1], steps=1200), "projected", ["--protocol.mode", "projected"]),
    (replace(SAME_BYTES[2], steps=1200), "projected + stage tables",
     ["--protocol.mode", "projected", "--protocol.stage_tables", "true"]),
]  # fmt: skip
"""The levers whose production form sends the production configs' bytes: each one's 1,200-step
arm and the overrides that turn the production configs (today's mode) into it. Width over
precision has no such form: the production configs already send 8-bit coordinates, so a wider
wire there is more bytes, which no arm here measures."""


def token_fraction(results: dict, arm: Arm) -> list[float | None] | None:
    """Per seed, the steps ``arm`` takes to reach today's mode's final loss at the same budget,
    over that budget (interpolated between validations; an upper bound, since the arm's
    learning rate has not decayed there; None for a seed that never gets there); None until
    both seeds of both arms are in."""
    runs = results["runs"]
    today_row, row = runs.get(today(arm.steps).name), runs.get(arm.name)
    if not (today_row and row and all(str(s) in row["seeds"] for s in SEEDS)):
        return None
    fractions = []
    for seed in map(str, SEEDS):
        target = today_row["seeds"][seed]["final_val_loss"]
        steps = steps_to_reach(row["seeds"][seed]["val_curve"], target)
        fractions.append(None if steps is None else steps / arm.steps)
    return fractions


def planned(toml: Path, overrides: list[str]) -> tuple[float, bool, int]:
    """The planner's tokens/s of a production config on its stated link (``[transport]``, at
    the planner's default MFU), whether every stage fits, and the most blocks a stage holds."""
    from protocol_models.cluster.network import Link, boundary_links
    from protocol_models.cluster.plan import plan_stages, predict_step
    from protocol_models.cluster.planner import DEFAULT_MFU
    from protocol_models.config.run_config import load_config

    config = load_config(str(toml), overrides, check_environment=False)
    transport = config.transport
    link = Link(transport.link_mbps, transport.link_latency_ms, loss=transport.link_packet_loss)
    plans = plan_stages(config)
    step = predict_step(config, plans, boundary_links(config, link), DEFAULT_MFU)
    limit = config.hardware.usable_memory_gib * 2**30
    fits = all(p.total_bytes <= limit for p in plans)
    return step["tokens_per_s"], fits, max(len(p.layers) for p in plans)


def render_discarded(results: dict) -> str:
    """The projected arms' ``discarded_share`` per boundary and seed."""
    lines = ["", "What the projection discards at each boundary: the share of the sender's "
             "stream energy around F off span(U), over 4 validation batches (boundary 1 / 2 / 3; "
             "seed 0; seed 1):", ""]  # fmt: skip
    for arm in ARMS:
        row = results["runs"].get(arm.name)
        if arm.method != "projected" or row is None:
            continue
        entries = [row["seeds"].get(str(seed), {}) for seed in SEEDS]
        shares = ["/".join(f"{x:.2f}" for x in e["discarded_share"]) if "discarded_share" in e
                  else "not measured" for e in entries]  # fmt: skip
        lines.append(f"- {arm.name}: {'; '.join(shares)}")
    return "\n".join(lines)


def render_rereading(results: dict) -> str:
    """For the longest budget's compressed arms (which reread the bundled text), per seed and
    validation step: the gap in validation loss and the gap in training loss over the window
    ending there (``train_loss``)."""
    longest = max(a.steps for a in ARMS)
    lines = ["", f"Held-out vs read-before at {longest:,} steps: the gap (%) in validation loss "
             "and in training loss over the twelfth of the run before each validation:",
             ""]  # fmt: skip
    for arm in ARMS:
        row, twin = results["runs"].get(arm.name), results["runs"].get(arm.twin.name)
        if arm.steps != longest or arm.method == "dense" or not row or not twin:
            continue
        for seed, entry in sorted(row["seeds"].items()):
            dense_entry = twin["seeds"].get(seed)
            if not dense_entry or "train_loss" not in entry or "train_loss" not in dense_entry:
                continue
            val, dense_val = dict(entry["val_curve"]), dict(dense_entry["val_curve"])
            fit, dense_fit = dict(entry["train_loss"]), dict(dense_entry["train_loss"])
            cells = [f"{step}: {100 * (val[step] / dense_val[step] - 1):+.2f} / "
                     f"{100 * (fit[step] / dense_fit[step] - 1):+.2f}"
                     for step in sorted(val.keys() & fit.keys() & dense_val.keys())]  # fmt: skip
            lines.append(f"- {arm.name} seed {seed} (validation / training): {', '.join(cells)}")
    return "\n".join(lines)


def render_time_to_target(results: dict) -> str:
    """Time to today's loss at the production shapes, predicted: the tokens each lever needed at
    d = 256 times the planner's step at 2B and 8B."""
    lines = ["", "Time to today's mode's loss at the production shapes, predicted (d = 256 token "
             "fraction x the planner's tokens/s on each config's stated link; below 1: sooner "
             "than the configs as they are; the projection's fractions come from 2 blocks per "
             "stage and are not carried to a layout of one):", "",
             "| lever | tokens to today's 1,200-step loss (seed 0 / 1) | 2B tokens/s | 2B time "
             "| 8B tokens/s | 8B time |", "|---|---|---|---|---|---|"]  # fmt: skip
    base = {name: planned(toml, [])[0] for name, toml in PRODUCTION.items()}
    for arm, label, overrides in LEVERS_AT_SCALE:
        fractions = token_fraction(results, arm)
        if fractions is None:
            lines.append(f"| {label} | pending | | | | |")
            continue
        shown = " / ".join("not reached" if f is None else f"{f:.2f}" for f in fractions)
        cells = [f"| {label} | {shown}"]
        for name, toml in PRODUCTION.items():
            tokens_per_s, fits, blocks = planned(toml, overrides)
            time = "n/a" if None in fractions else (
                f"{statistics.fmean(fractions) * base[name] / tokens_per_s:.2f}")  # fmt: skip
            if not fits:
                time = "does not fit"
            elif blocks == 1 and arm.method == "projected":
                time = "one block per stage"
            cells.append(f"{tokens_per_s:,.0f} | {time}")
        lines.append(" | ".join(cells) + " |")
    lines.append(f"| today's mode (the configs as they are) | 1 | {base['2B']:,.0f} | 1 "
                 f"| {base['8B']:,.0f} | 1 |")  # fmt: skip
    return "\n".join(lines)


def discarded_share(folder: Path, batches: int = 4) -> list[float]:
    """Per boundary of a trained ``projected`` run (its newest checkpoint), the share of the
    stream's energy around ``F`` that the boundary's projection discards,
    ``sum |(I - U U^T)(x - F[t])|^2 / sum |x - F[t]|^2`` over ``batches`` validation batches of
    the run's rows: what the sending stage computed and the next never sees (0 in ``subspace``
    mode by construction)."""
    import argparse
    import warnings

    import torch

    from protocol_models.hf.checkpoint_files import CheckpointTensors
    from protocol_models.hf.evaluate import batches as rows
    from protocol_models.hf.fold import expected_shapes
    from protocol_models.training import run_record

    record = run_record.read(folder / "checkpoint")
    model_config = record.model_config()
    model = model_config.build()
    model.init_states()
    step = max((folder / "checkpoint").glob("step-*"), key=lambda d: int(d.name.split("-")[1]))
    model.load_state_dict(CheckpointTensors(step).load(list(expected_shapes(model_config))))
    senders = [layer for layer in model.layers.values() if getattr(layer, "project_out", False)]
    off, whole = [0.0] * len(senders), [0.0] * len(senders)

    def measuring(index: int, send):
        def measured(h, ffn, token_ids, basis, table):
            around = (h + ffn).float() - table[token_ids].float()
            kept = around @ basis @ basis.T
            off[index] += (around - kept).pow(2).sum().item()
            whole[index] += around.pow(2).sum().item()
            return send(h, ffn, token_ids, basis, table)

        return measured

    for index, layer in enumerate(senders):
        layer.send = measuring(index, layer.send)
    args = argparse.Namespace(text=None, seq_len=None, batch_size=None, steps=batches)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torchdata's "'set_vital' is deprecated"
        for inputs, _ in rows(Path(record.hf_assets_path), record, args):
            model(inputs["input"])
    return [o / w for o, w in zip(off, whole, strict=True)]


def plot(results: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(10, 4.5))
    series: dict[str, list[Arm]] = {}
    for arm in ARMS:
        if arm.method != "dense" and arm.stages == REFERENCE_STAGES:
            series.setdefault(arm.name.rsplit(" ", 2)[0], []).append(arm)
    for label, arms in series.items():
        points = sorted((a.steps, g) for a in arms if (g := gaps(results, a)))
        if not points:
            continue
        steps = [s for s, _ in points]
        means = [statistics.fmean(g) for _, g in points]
        spread = [[m - min(g) for m, (_, g) in zip(means, points, strict=True)],
                  [max(g) - m for m, (_, g) in zip(means, points, strict=True)]]  # fmt: skip
        style = "--" if arms[0].corpus != "shakespeare" else "-"
        axis.errorbar(steps, means, yerr=spread, marker="o", ls=style, capsize=4, label=label)
    axis.axhline(0, color="grey", lw=0.8)
    axis.axhline(1.0, color="grey", lw=0.8, ls="--")
    axis.set(xscale="log", xlabel="training steps (d = 256, 4 stages x 2 blocks)",
             ylabel="gap vs dense twin (%)",
             title="Same-bytes levers (2 seeds, range; dashed: the speeches)")  # fmt: skip
    axis.set_xticks([300, 990, 1200, 2400], ["300", "990", "1200", "2400"])
    axis.set_xticks([], minor=True)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.tight_layout()
    fig.savefig(OUT / "quality_gap.png", dpi=120)


def report() -> None:
    results = load_results()
    write_report(OUT, render_table(results), lambda: plot(results))


def main() -> None:
    study_main("python -m recipes.quality_gap", [a.name for a in ARMS], run_study, report)


if __name__ == "__main__":
    main()
