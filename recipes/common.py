"""Helpers shared by the benchmark recipes: launch a real run, read its metrics, time it.

Every run is a real ``torchrun`` launch of ``protocol_models.train`` (one process per pipeline
stage, gloo on CPU); its console output goes to ``<dump_folder>/run.log``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "configs" / "reference_cpu.toml"


def train(
    dump_folder: Path, overrides: list[str], *, toml: Path = REFERENCE, nproc: int | None = None
) -> list[dict]:
    """Run one training job; return its ``metrics.jsonl`` records (raises on failure)."""
    dump_folder.mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", "validation.jsonl"):
        (dump_folder / name).unlink(missing_ok=True)
    check = subprocess.run(
        [sys.executable, "-m", "protocol_models.config", "--toml", str(toml), *overrides],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    nproc = nproc or int(check.stdout.split("nproc=")[1].split()[0])
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
    with open(dump_folder / "run.log", "w") as log:
        result = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=os.environ)
    if result.returncode != 0:
        raise RuntimeError(
            f"run failed ({result.returncode}): {' '.join(cmd)}; see {dump_folder}/run.log"
        )
    return read_jsonl(dump_folder / "metrics.jsonl")


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def validation_curve(dump_folder: Path) -> list[tuple[int, float]]:
    return [
        (r["step"], r["validation_metrics/loss"])
        for r in read_jsonl(dump_folder / "validation.jsonl")
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


def steps_to_target(curve: list[tuple[int, float]], target: float) -> int | None:
    """Earliest validation step whose loss is <= ``target`` (None if never)."""
    return next((step for step, loss in curve if loss <= target), None)
