"""A killed worker costs only the steps since the last checkpoint; bad steps and half-written
checkpoints never corrupt a run; a failed run's last line is the rank that failed first."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import NCCL_RULES, REPO, TINY, read_jsonl, torchrun

CKPT = ["--checkpoint.enable", "--checkpoint.interval", "5"]
STREAMED = ["--dataloader.streaming"]  # the bundled corpus read as a stream: HF's resume state


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


def _step_logged(dump: Path, step: int, launcher: subprocess.Popen) -> bool:
    """Wait until the run in ``dump`` has logged ``step``; False if it ended first (or 300 s
    passed)."""
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and launcher.poll() is None:
        records = read_jsonl(dump / "metrics.jsonl") if (dump / "metrics.jsonl").exists() else []
        if records and records[-1]["step"] >= step:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> list[dict]:
    """The records of a 20-step, 2-stage run with checkpoints every 5 steps and streamed data,
    never interrupted: what every interrupted run here must equal."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    return torchrun(2, folder, "--training.steps", "20", *CKPT, *STREAMED)


def test_a_metrics_line_cut_off_by_a_kill_is_no_record(tmp_path):
    """A reader during the run, and the resumed run itself, skip a last line written only in
    part (the run still appending it, or killed while it did) instead of failing to parse it."""
    from protocol_models.training.metrics import JsonlLogger

    paths = [str(tmp_path / name) for name in ("metrics.jsonl", "validation.jsonl", "s.jsonl")]
    first_launch = JsonlLogger(*paths)
    for step in (1, 2, 3):
        first_launch.log({"loss": float(step)}, step)
    with open(paths[0], "a") as f:
        f.write(json.dumps({"step": 4, "loss": 4.0})[:12])  # killed while appending step 4
    assert [r["step"] for r in read_jsonl(Path(paths[0]))] == [1, 2, 3]

    JsonlLogger(*paths).log({"loss": 3.5}, 3)  # the restart resumes from its step-2 checkpoint
    assert [(r["step"], r["loss"]) for r in read_jsonl(Path(paths[0]))] == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.5),
    ]


def test_killed_worker_restarts_and_resumes_exactly(tmp_path, uninterrupted):
    """Killed after step 12, the run resumes from the step-10 checkpoint with the streamed data
    at the exact next batch: every step's ids and loss equal an uninterrupted run's (which ran on
    gloo's rules; this one under NCCL's, ``NCCL_RULES``)."""

    dump = tmp_path / "killed"
    cmd = [
        sys.executable, "-m", "protocol_models.launch", "--standalone", "--nproc_per_node", "2",
        "--max-restarts", "1", "-m", "protocol_models.train", "--toml", str(TINY),
        "--dump_folder", str(dump), "--training.steps", "20", *CKPT, *STREAMED,
    ]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **NCCL_RULES},
    )  # fmt: skip
    killed: list[int] = []

    def kill_first_stage_after_step_12():
        if _step_logged(dump, 12, launcher):
            workers = sorted(_children(launcher.pid))
            os.kill(workers[0], signal.SIGKILL)
            killed.append(workers[0])

    killer = threading.Thread(target=kill_first_stage_after_step_12)
    killer.start()
    output, _ = launcher.communicate(timeout=600)
    killer.join()
    assert killed, "the run finished before a worker could be killed"
    assert launcher.returncode == 0, output[-4000:]
    assert "Training starts at step 11" in output, "did not resume from the step-10 checkpoint"
    resumed = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 21))
    checksums = [r["data/ids_checksum"] for r in uninterrupted]
    assert len(set(checksums)) == 20, "the checksum cannot tell the batches apart"
    assert [r["data/ids_checksum"] for r in resumed] == checksums
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted]


def test_stalled_peer_is_detected_within_the_bound_and_the_run_resumes_exactly(
    tmp_path, uninterrupted
):
    """Stage 1 frozen (SIGSTOP: its sockets stay open, as across a partition) for 2 s rides
    through; frozen past the stall bound after step 12, stage 0 names it in one line within the
    bound, the launcher restarts both and the run resumes from the step-10 checkpoint: every
    step's loss equals an uninterrupted run's."""
    steps = ["--training.steps", "20", *CKPT, *STREAMED]
    dump = tmp_path / "stalled"
    bound = ["--transport.stall_bound_steps", "5", "--transport.stall_bound_floor_seconds", "6"]
    cmd = [
        sys.executable, "-m", "protocol_models.launch", "--standalone", "--nproc_per_node", "2",
        "--max-restarts", "1", "-m", "protocol_models.train", "--toml", str(TINY),
        "--dump_folder", str(dump), *steps, *bound,
    ]  # fmt: skip
    launcher = subprocess.Popen(
        cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PROTOCOL_MODELS_DEVICE": "cpu"},
    )  # fmt: skip
    frozen: list[float] = []

    def freeze(pid: int, seconds: float) -> None:
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        with contextlib.suppress(ProcessLookupError):  # the agent may have killed it meanwhile
            os.kill(pid, signal.SIGCONT)
        frozen.append(seconds)

    def freeze_stage_1():
        for after_step, seconds in ((6, 2.0), (12, 10.0)):
            if _step_logged(dump, after_step, launcher):
                freeze(sorted(_children(launcher.pid))[1], seconds)

    freezer = threading.Thread(target=freeze_stage_1)
    freezer.start()
    output, _ = launcher.communicate(timeout=600)
    freezer.join()
    assert frozen == [2.0, 10.0], "the run finished before stage 1 could be frozen twice"
    assert launcher.returncode == 0, output[-4000:]
    (line,) = [x for x in output.splitlines() if x.startswith("error: step ")]
    assert "stall bound" in line and "from stage 1 (rank 1, node 0" in line, line
    waited = float(line.split("has run ")[1].split(" s")[0])
    bound_s = float(line.split("stall bound of ")[1].split(" s")[0])
    assert 6 <= bound_s < 20 and waited < bound_s + 2, line
    starts = [
        x.split("Training starts at step ")[1]
        for x in output.splitlines()
        if "Training starts at step" in x
    ]
    assert sorted(starts) == ["1", "1", "11", "11"], f"a stall within the bound restarted: {starts}"
    assert "Training starts at step 11" in output, "did not resume from the step-10 checkpoint"
    resumed = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted]


def test_a_broken_connection_is_a_one_line_link_fault_and_a_bug_is_not():
    """gloo's error for a peer that went away becomes one ``LinkFault`` line (restarted by the
    launcher); any other ``RuntimeError`` is left alone (a bug keeps its traceback)."""
    from protocol_models.tools.errors import LinkFault, as_link_fault

    gloo = RuntimeError(
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
        "[10.203.0.2]:6836: Connection reset by peer. This is typically caused by a remote "
        "worker hanging or bugs in the application."
    )
    fault = as_link_fault(gloo, "step 21: a message to or from another rank")
    assert isinstance(fault, LinkFault)
    assert str(fault) == (
        "step 21: a message to or from another rank failed (Read error [10.203.0.2]:6836: "
        "Connection reset by peer); restarting from the last complete checkpoint (needs "
        "--max-restarts)"
    )
    assert as_link_fault(RuntimeError("shape mismatch: [4, 8] vs [4, 9]"), "step 1") is None


def test_half_written_checkpoint_is_never_loaded(tmp_path, uninterrupted):
    """A save killed mid-write leaves a step folder without DCP's .metadata (written last) and
    with truncated shards; the next start must fall back to the previous complete checkpoint
    and continue exactly as the uninterrupted run (same data stream and LR schedule)."""
    dump = tmp_path / "run"
    schedule = ["--lr_scheduler.total_steps", "20", *CKPT, *STREAMED]  # the uninterrupted run's
    torchrun(2, dump, "--training.steps", "12", *schedule)
    broken = dump / "checkpoint" / "step-12"
    (broken / ".metadata").unlink()
    for shard in broken.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])

    resumed, output = torchrun(2, dump, "--training.steps", "15", *schedule, return_output=True)
    assert "Training starts at step 11" in output, "did not fall back to the step-10 checkpoint"
    assert [r["step"] for r in resumed] == list(range(1, 16))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted][:15]
    assert (dump / "checkpoint" / "step-15" / ".metadata").is_file()


def test_a_study_run_cut_short_resumes_from_its_checkpoint(tmp_path, uninterrupted, monkeypatch):
    """A recipe's run (``train_cached``) whose whole process tree is killed after step 12, as a
    session's end kills it, resumes from its step-10 checkpoint when the recipe asks again:
    every step's loss equals an uninterrupted run's, and its wall time sums both launches."""
    import recipes.common as common

    monkeypatch.setattr(common, "RUN_CACHE", tmp_path / "runs")
    overrides = ["--training.steps", "20", *CKPT, *STREAMED]
    folder = common.run_folder(overrides, toml=TINY, nproc=2)
    recipe = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; import recipes.common as c; "
         "c.RUN_CACHE = Path(sys.argv[1]); c.train_cached(sys.argv[3:], toml=Path(sys.argv[2]), "
         "nproc=2)", str(common.RUN_CACHE), str(TINY), *overrides],
        cwd=REPO,
    )  # fmt: skip
    try:
        assert _step_logged(folder, 12, recipe), "the run ended before step 12"
    finally:  # the whole tree (TorchTitan's workers run in sessions of their own)
        tree, found = [], [recipe.pid]
        while found:
            tree += found
            found = [kid for pid in found for kid in _children(pid)]
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        recipe.wait()
    assert not (folder / "done").exists()

    assert common.train_cached(overrides, toml=TINY, nproc=2) == folder
    log = (folder / "run.log").read_text()
    assert log.count(common.LAUNCH_MARK) == 2 and "Training starts at step 11" in log
    resumed = read_jsonl(folder / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(1, 21))
    assert [r["loss"] for r in resumed] == [r["loss"] for r in uninterrupted]
    walls = common.launch_seconds(folder)
    assert len(walls) == 2 and all(w > 0 for w in walls)
    assert common.wall_seconds(folder) == sum(walls)


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
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["run.json", "step-1"]


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


def test_first_failing_rank_is_reported_when_the_log_filter_hides_it(tmp_path):
    """Only rank 0 fails (a device error at step 2); the log filter shows rank 1 alone, whose own
    error is the "connection closed by peer" that follows. The launcher's last line is rank 0's
    error, and names the file with rank 0's full output."""
    from faulty_worker import FAULT

    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.launch", "--standalone", "--nproc_per_node", "2",
         "--local-ranks-filter", "1", "--tee", "3", "--log-line-prefix-template", "[rank${rank}]:",
         str(REPO / "tests" / "faulty_worker.py"), "--toml", str(TINY),
         "--dump_folder", str(tmp_path / "run"), "--training.steps", "4"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert "[rank1]:" in output and "[rank0]:" not in output, "the filter did not hide rank 0"
    last = result.stderr.strip().splitlines()[-1]
    prefix = f"error: worker rank 0 exited with code 1: RuntimeError: {FAULT} (its output: "
    assert last.startswith(prefix), last
    assert output.count(FAULT) == 1
    rank0_log = Path(last.removeprefix(prefix).removesuffix(")"))
    assert rank0_log.name == "stderr.log" and FAULT in rank0_log.read_text()


def test_root_cause_is_the_earliest_error_record(tmp_path):
    """torchelastic's error records carry whole seconds: within one, the earlier file wins; a
    user error whose own line was shown is not repeated."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from protocol_models.cluster.launch import failure_summary, first_failure

    def failure(local_rank: int, exitcode: int, message: str | None, mtime: float):
        folder = tmp_path / str(local_rank)
        folder.mkdir()
        (folder / "stderr.log").write_text("its full output\n")
        error_file = folder / "error.json"
        if message is not None:
            record = {"message": message, "extraInfo": {"py_callstack": "", "timestamp": "100"}}
            error_file.write_text(json.dumps({"message": record}))
            os.utime(error_file, (mtime, mtime))
        return ProcessFailure(local_rank, 1000 + local_rank, exitcode, str(error_file))

    late = failure(1, 1, "RuntimeError: Connection closed by peer", 100.5)
    early = failure(0, 1, "RuntimeError: CUDA error", 100.2)
    error = ChildFailedError("train", {1: late, 0: early})
    assert error.get_first_failure()[0] == 1  # torchelastic: a tie, first in the dict
    assert failure_summary(error, {1}) == (
        f"error: worker rank 0 exited with code 1: RuntimeError: CUDA error "
        f"(its output: {tmp_path / '0' / 'stderr.log'})"
    )
    assert failure_summary(error, None) == (
        "error: worker rank 0 exited with code 1: RuntimeError: CUDA error"
    )

    user = failure(2, 2, "StartupError: stages disagree", 100.1)
    same = failure(3, 2, "StartupError: stages disagree", 100.3)
    killed = failure(4, -15, None, 0)
    assert failure_summary(ChildFailedError("train", {2: user, 3: same}), {3}) is None
    assert failure_summary(ChildFailedError("train", {2: user, 4: killed}), {4}) == (
        f"error: worker rank 2 exited with code 2: StartupError: stages disagree "
        f"(its output: {tmp_path / '2' / 'stderr.log'})"
    )
    # both stages hit the same user error; the first recorder was terminated while exiting
    recorded_then_killed = failure(5, -15, "DataError: different token ids", 100.1)
    exited = failure(6, 2, "DataError: different token ids", 100.4)
    both = ChildFailedError("train", {5: recorded_then_killed, 6: exited})
    assert first_failure(both) == (6, exited)
    assert failure_summary(both, None) is None


def test_finished_runs_exit_zero(tmp_path):
    """A short run through the user's launcher, with the link simulator (its threads and sleeps
    on top of a plain run's), exits 0 and never aborts at interpreter exit after "Training
    completed" (a finished job must not look failed, or be restarted by MAX_RESTARTS). Its
    console shows the progress and none of TorchTitan's lines that are wrong here."""
    from protocol_models.training.console import MISLEADING_LOG_LINES, MISLEADING_WARNINGS

    result = subprocess.run(
        ["bash", "scripts/train.sh", str(TINY), "--dump_folder", str(tmp_path / "run"),
         "--training.steps", "2", "--wan.latency_ms", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Training completed" in output
    assert "terminate called" not in output and "Aborted" not in output
    assert "step 2/2 (100%)" in output and "ETA" in output  # the progress line
    for misleading in MISLEADING_LOG_LINES + MISLEADING_WARNINGS:
        assert misleading not in output, misleading
