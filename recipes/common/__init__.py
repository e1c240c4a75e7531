"""Helpers shared by the benchmark recipes: launch a real run, read its metrics, time it.

Every run is a real ``torchrun`` launch of ``protocol_models.train`` (one process per pipeline
stage, gloo on CPU); its console output goes to ``<dump_folder>/run.log``. The other helpers
several recipes share: the codec comparison's harness (``arms``) and the real shaped link
(``tun_relay``, ``link_probe``, ``shaped_link``).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from protocol_models.training.checkpointing import complete_step_numbers
from protocol_models.training.metrics import read_jsonl

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "configs" / "reference_cpu.toml"
RUN_CACHE = REPO / "results" / "runs"
"""Finished study runs, one folder per (config file text, overrides, process count); shared by
the recipes so a run two studies need (e.g. the Muon dense twin) is trained once."""
PARALLEL_RUNS = int(os.environ.get("PM_PARALLEL_RUNS", "2"))
"""Study runs that may train at the same time across all recipes (one core each)."""
LAUNCH_MARK = "launch: "
"""The first line ``train`` writes into ``run.log`` for each launch of a run."""


def train(
    dump_folder: Path,
    overrides: list[str],
    *,
    toml: Path = REFERENCE,
    nproc: int | None = None,
    env: dict | None = None,
    resume: bool = False,
) -> list[dict]:
    """Run one training job (its config checked and its data prepared first, in one process,
    as ``scripts/train.sh`` does); return its ``metrics.jsonl`` records (raises on failure).

    ``resume``: the run continues from the checkpoint in ``dump_folder`` (the records of the
    steps before it are kept, the log is appended to); otherwise it starts anew."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    if not resume:
        for name in ("metrics.jsonl", "validation.jsonl"):
            (dump_folder / name).unlink(missing_ok=True)
    check = subprocess.run(  # the check and the data, as scripts/train.sh does
        [sys.executable, "-m", "protocol_models.config", "--prepare", "--toml", str(toml),
         *overrides],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    nproc = nproc or int(check.stdout.split("nproc=")[1].split()[0])
    env = dict(env or os.environ)
    if "device=cpu" in check.stdout.split():
        env["PROTOCOL_MODELS_DEVICE"] = "cpu"  # as scripts/train.sh does, on a GPU machine too
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "protocol_models.train",
        "--toml",
        str(toml),
        "--dump_folder",
        str(dump_folder),
        *overrides,
    ]
    with open(dump_folder / "run.log", "a" if resume else "w") as log:
        log.write(f"{LAUNCH_MARK}{' '.join(cmd)}\n")
        log.flush()
        result = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env)
    if result.returncode != 0:
        raise RuntimeError(
            f"run failed ({result.returncode}): {' '.join(cmd)}; see {dump_folder}/run.log"
        )
    return read_jsonl(dump_folder / "metrics.jsonl")


def train_cached(overrides: list[str], *, toml: Path = REFERENCE, nproc: int = 1) -> Path:
    """Train ``toml`` + ``overrides`` on ``nproc`` processes unless an identical run already
    finished; return its dump folder (with ``metrics.jsonl``, ``validation.jsonl``, ``run.log``
    and the final model weights under ``checkpoint/step-N``). Overrides are compared as a set of
    ``key = value`` pairs, so their order does not matter.

    A run cut short (its recipe stopped, a session ended) resumes from its newest checkpoint
    holding the training state (``resume_point``; a recipe whose runs are long asks for
    ``--checkpoint.interval``), else starts over. Concurrent callers (several recipes at once)
    wait for each other on a per-run lock, and at most ``PARALLEL_RUNS`` runs train at a time.
    Delete ``results/runs`` to retrain everything.
    """
    folder = run_folder(overrides, toml=toml, nproc=nproc)
    folder.mkdir(parents=True, exist_ok=True)
    with _locked(folder / ".lock"):
        if (folder / "done").is_file():
            return folder
        (folder / "config.json").write_text(
            json.dumps(
                {"toml": str(toml.relative_to(REPO)), "overrides": overrides, "nproc": nproc},
                indent=1,
            )  # fmt: skip
        )
        resumed = resume_point(folder / "checkpoint") is not None
        with run_slot():
            single = ["--parallelism.pipeline_parallel_degree", "1"] if nproc == 1 else []
            final_weights = ["--checkpoint.enable", "--checkpoint.last_save_model_only"]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            train(folder, [*single, *final_weights, *overrides], toml=toml, nproc=nproc, env=env,
                  resume=resumed)  # fmt: skip
        (folder / "done").touch()
    return folder


def resume_point(checkpoint: Path) -> int | None:
    """Where a run cut short (a session's end, a machine going down) resumes: the newest
    complete checkpoint in ``checkpoint`` that holds the training state. Every ``step-N``
    folder after it (half-written, or the model-only last save of a run stopped before it was
    marked done) is removed; with none, the whole folder is, and the run starts over."""
    full = [
        step
        for step in complete_step_numbers(str(checkpoint))
        if _holds_training_state(checkpoint / f"step-{step}")
    ]
    if not full:
        shutil.rmtree(checkpoint, ignore_errors=True)
        return None
    for step_dir in checkpoint.glob("step-*"):
        if int(step_dir.name.removeprefix("step-")) > full[-1]:
            shutil.rmtree(step_dir)
    return full[-1]


def _holds_training_state(step_dir: Path) -> bool:
    """Whether a complete DCP checkpoint holds more than the model (TorchTitan's ``train_state``
    is saved with the optimizer, and never in a model-only save)."""
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(step_dir)).read_metadata().state_dict_metadata
    return any(name.split(".")[0] == "train_state" for name in saved)


def canonical_overrides(overrides: list[str]) -> tuple[tuple[str, str], ...]:
    """The ``(key, value)`` pairs of an override list, sorted: equal for equal runs whatever
    the order the overrides were written in."""
    from protocol_models.config.run_config import parse_overrides

    return tuple(sorted((k, repr(v)) for k, v in parse_overrides(overrides)))


def run_folder(overrides: list[str], *, toml: Path = REFERENCE, nproc: int = 1) -> Path:
    """Where ``train_cached`` keeps this run (finished iff it holds a ``done`` file)."""
    canonical = canonical_overrides(overrides)  # JSON writes its pairs as lists, as before
    key = hashlib.sha256(json.dumps([toml.read_text(), canonical, nproc]).encode()).hexdigest()
    return RUN_CACHE / key[:16]


@contextlib.contextmanager
def _locked(path: Path):
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def run_slot():
    """Hold one of ``PARALLEL_RUNS`` machine-wide slots while a run trains (or a recipe computes
    in its own process, so that it does not slow the runs it times)."""
    slots = RUN_CACHE / ".slots"
    slots.mkdir(parents=True, exist_ok=True)
    while True:
        for i in range(PARALLEL_RUNS):
            handle = open(slots / f"{i}.lock", "a")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()
            return
        time.sleep(2)


def launch_seconds(folder: Path) -> list[float]:
    """The wall time of each launch of a run (one unless it was resumed): from the first to the
    last timestamp of that launch's part of its log (excludes the time ``train_cached`` waited
    for a slot; a resumed run's total counts the steps it repeated after its checkpoint)."""
    text = (folder / "run.log").read_text(errors="replace")
    walls = []
    for part in text.split(LAUNCH_MARK):
        stamps = re.findall(r"\[titan\] (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})", part)
        if stamps:
            first, last = (
                datetime.strptime(s, "%Y-%m-%d %H:%M:%S,%f") for s in (stamps[0], stamps[-1])
            )
            walls.append((last - first).total_seconds())
    return walls


def wall_seconds(folder: Path) -> float:
    """A run's wall time, summed over its launches (``launch_seconds``)."""
    return sum(launch_seconds(folder))


def repo_relative(path: Path) -> str:
    """``path`` as recorded in results files: relative to the repository when inside it, so
    results written by different clones compare."""
    path = path.resolve()
    return str(path.relative_to(REPO) if path.is_relative_to(REPO) else path)


_WRITES = threading.Lock()


def write_results(path: Path, results: dict) -> None:
    """Write a study's ``results.json`` whole: a temporary file renamed over it (a reader, or a
    session that ends mid-write, sees the old file or the new one), one writer at a time."""
    with _WRITES:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_suffix(".json.partial")
        staging.write_text(json.dumps(results, indent=1))
        os.replace(staging, path)


def study_main(prog: str, arms: list[str], run_study, report) -> None:
    """The command line of a resumable study: train the runs its results lack (``--only``: only
    these arms'; ``run_study(names or None)``), then write its table and plots (``report()``);
    ``--render-only``: only the latter."""
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--render-only", action="store_true", help="no training")
    parser.add_argument("--only", nargs="+", choices=arms, metavar="ARM",
                        help="train only these arms' missing runs: " +
                        ", ".join(repr(a) for a in arms))  # fmt: skip
    args = parser.parse_args()
    if not args.render_only:
        run_study(set(args.only) if args.only else None)
    report()


def seed_gaps(row: dict | None, twin: dict | None, seeds, partial: bool = False):
    """Per seed, a results row's final validation loss over its dense twin row's, in percent
    (seed s against the twin's seed s); None until both rows have every seed (``partial``: a
    None for each seed not run yet, None only without both rows)."""
    if row is None or twin is None:
        return None
    pairs = [(row["seeds"].get(str(s)), twin["seeds"].get(str(s))) for s in seeds]
    if any(a is None or b is None for a, b in pairs) and not partial:
        return None
    return [None if a is None or b is None else
            100 * (a["final_val_loss"] - b["final_val_loss"]) / b["final_val_loss"]
            for a, b in pairs]  # fmt: skip


def seed_cells(row: dict, seeds, gap: list[float] | None) -> tuple[str, str, float]:
    """A results row's table cells: its final validation losses (``a / b``, ``-`` for a seed
    not run), its gaps (``+x / +y (mean +z)``; ``+x / -`` while a seed is missing, or
    ``pending``) and its runs' mean wall time."""
    entries = [row["seeds"].get(str(s)) for s in seeds]
    losses = " / ".join(f"{e['final_val_loss']:.4f}" if e else "-" for e in entries)
    known = [g for g in gap or [] if g is not None]
    gap_text = "pending" if not known else " / ".join(
        "-" if g is None else f"{g:+.2f}" for g in gap) + (
        f" (mean {statistics.fmean(known):+.2f})" if len(known) == len(gap) else "")  # fmt: skip
    return losses, gap_text, statistics.fmean(e["wall_s"] for e in entries if e)


def write_report(out: Path, table: str, plot) -> None:
    """Write a study's ``table.md`` (``table``) and its plots (``plot()``) under ``out``, and
    print the table."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(table)
    plot()
    print(table)


def validation_curve(dump_folder: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["validation_metrics/loss"])
        for r in read_jsonl(dump_folder / "validation.jsonl")
    ]


def timing_overrides(steps: int) -> list[str]:
    """Overrides of a run timed by ``steady_step_time``: ``steps`` steps, every step logged,
    validation off (it would pause training)."""
    return [
        "--training.steps",
        str(steps),
        "--metrics.log_freq",
        "1",
        "--validator.enable",
        "false",
    ]


def steady_step_time(records: list[dict], window: int = 10, skip: int = 1) -> tuple[float, bool]:
    """ProtocolNanoGPT's rule: mean step time over consecutive ``window``-step windows; the first
    three consecutive windows within 1% of each other are steady, their median is the step time.
    Returns ``(seconds, steady)``; when no three windows agree, the median of the last three
    (or of all windows, if fewer) with ``steady=False``. Needs ``metrics.log_freq = 1``."""
    times = [r["time_metrics/end_to_end(s)"] for r in records[skip:]]
    windows = [
        statistics.fmean(times[i : i + window]) for i in range(0, len(times) - window + 1, window)
    ]
    for i in range(len(windows) - 2):
        trio = windows[i : i + 3]
        if max(trio) <= 1.01 * min(trio):
            return statistics.median(trio), True
    tail = windows[-3:] if windows else times
    return statistics.median(tail), False


def steps_to_reach(
    curve: list[tuple[int, float]], target: float, *, interpolate: bool = True
) -> float | None:
    """The step at which a validation curve ``[(step, loss)]`` first reaches ``target`` (loss
    <= target): linearly interpolated between the two validation points around the crossing
    (``interpolate``), else the first validation step at or below it; the first point's step
    when it already is; None if the curve never gets there."""
    if curve[0][1] <= target:
        return curve[0][0]
    for (s0, l0), (s1, l1) in zip(curve, curve[1:], strict=False):
        if l1 <= target:
            return s0 + (l0 - target) / (l0 - l1) * (s1 - s0) if interpolate else s1
    return None
