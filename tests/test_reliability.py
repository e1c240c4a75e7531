"""A killed worker costs only the steps since the last checkpoint; bad steps and half-written
checkpoints never corrupt a run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO, TINY, read_jsonl, torchrun

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def test_killed_worker_restarts_and_resumes_exactly(tmp_path):
    reference = torchrun(2, tmp_path / "reference", "--training.steps", "20", *CKPT)

    dump = tmp_path / "killed"
    cmd = [
        sys.executable, "-m", "protocol_models.launch", "--standalone", "--nproc_per_node", "2",
        "--max-restarts", "1", "-m", "protocol_models.train", "--toml", str(TINY),
        "--dump_folder", str(dump), "--training.steps", "20", *CKPT,
    ]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    killed: list[int] = []

    def kill_first_stage_after_step_12():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and launcher.poll() is None:
            records = (
                read_jsonl(dump / "metrics.jsonl") if (dump / "metrics.jsonl").exists() else []
            )
            if records and records[-1]["step"] >= 12:
                workers = sorted(_children(launcher.pid))
                os.kill(workers[0], signal.SIGKILL)
                killed.append(workers[0])
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_first_stage_after_step_12)
    killer.start()
    output, _ = launcher.communicate(timeout=600)
    killer.join()
    assert killed, "the run finished before a worker could be killed"
    assert launcher.returncode == 0, output[-4000:]
    assert "Training starts at step 11" in output, "did not resume from the step-10 checkpoint"
    resumed = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]


def test_half_written_checkpoint_is_never_loaded(tmp_path):
    """A save killed mid-write leaves a step folder without DCP's .metadata (written last) and
    with truncated shards; the next start must fall back to the previous complete checkpoint."""
    dump = tmp_path / "run"
    schedule = ["--lr_scheduler.total_steps", "15"]  # the same LR schedule in all three runs
    torchrun(2, dump, "--training.steps", "12", *CKPT, *schedule)
    broken = dump / "checkpoint" / "step-12"
    (broken / ".metadata").unlink()
    for shard in broken.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    resumed = torchrun(2, dump, "--training.steps", "15", *CKPT, *schedule)
    reference = torchrun(2, tmp_path / "reference", "--training.steps", "15", *CKPT, *schedule)
    assert [r["step"] for r in resumed] == list(range(1, 16))
    assert [r["loss"] for r in resumed][10:] == [r["loss"] for r in reference][10:]
    assert (dump / "checkpoint" / "step-15" / ".metadata").is_file()


def test_non_finite_step_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    dump = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.launch", "--standalone", "--nproc_per_node", "2",
         "-m", "protocol_models.train", "--toml", str(TINY), "--dump_folder", str(dump),
         "--training.steps", "6", "--optimizer.lr", "1e30", "--checkpoint.enable", "--checkpoint.interval", "1"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: non-finite")]
    assert errors and "at step 2" in errors[0]
    assert "Traceback" not in result.stderr
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-1"]


def test_non_finite_steps_can_be_skipped(tmp_path):
    """With a skip budget the run drops the bad steps and stops only when the budget is spent."""
    dump = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.launch", "--standalone", "--nproc_per_node", "2",
         "-m", "protocol_models.train", "--toml", str(TINY), "--dump_folder", str(dump),
         "--training.steps", "6", "--optimizer.lr", "1e30", "--optimizer.skip_nonfinite_steps", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 2
    assert "non-finite loss or gradient at step 4" in result.stderr
    assert "skipped so far: [2, 3]" in result.stderr
