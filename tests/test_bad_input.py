"""Bad configs are refused by the launcher with one line naming the key, before any worker."""

from __future__ import annotations

import subprocess
import time

import pytest
from conftest import REPO

DEBUG = REPO / "configs" / "debug_cpu.toml"

CASES = {
    "k below 1": (["--protocol.k", "0"], "protocol.k"),
    "k above d": (["--protocol.k", "257"], "protocol.k"),
    "more stages than layers": (["--parallelism.pipeline_parallel_degree", "9"], "pipeline_parallel_degree"),
    "microbatch does not divide batch": (["--parallelism.pipeline_parallel_microbatch_size", "3"], "microbatch_size"),
    "unknown key": (["--training.stepz", "3"], "training.stepz"),
    "unknown table": (["--nosuch.key", "1"], "nosuch"),
    "wrong type": (["--training.steps", "many"], "training.steps"),
    "unknown mode": (["--protocol.mode", "topk"], "protocol.mode"),
    "unsupported schedule": (["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], "pipeline_parallel_schedule"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_any_worker(tmp_path, case):
    overrides, key = CASES[case]
    dump = tmp_path / "dump"
    start = time.monotonic()
    result = subprocess.run(
        ["bash", "scripts/train.sh", str(DEBUG), "--dump_folder", str(dump), *overrides],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and key in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    assert not dump.exists(), "a worker started and wrote into the dump folder"
    assert elapsed < 10, f"refusal took {elapsed:.1f}s"


def test_toml_syntax_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    result = subprocess.run(
        ["bash", "scripts/train.sh", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "bad.toml" in line and "TOML" in line
