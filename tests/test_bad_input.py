"""Bad input is refused with one line naming the problem and what is allowed: by the launcher's
check before any worker starts (and without touching the dump folder), or -- for a seed mismatch
between nodes, which only the stages themselves can see -- at start-up, before step 1. The table
of cases runs the check the launcher runs (``protocol_models.config``) in this process; that
``scripts/train.sh`` stops on its line before any worker is tested through the script."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, torchrun
from safetensors.torch import save_file

from protocol_models.config import run_config
from protocol_models.model.subspace import orthonormalize

DEBUG = REPO / "configs" / "debug_cpu.toml"

NO_VALIDATION = ["--validator.enable", "false"]
CASES = {
    "k below 1": (["--protocol.k", "0"], "protocol.k"),
    "k above d": (["--protocol.k", "257"], "protocol.k"),
    "more stages than layers": (["--parallelism.pipeline_parallel_degree", "9"], "pipeline_parallel_degree"),
    "microbatch does not divide batch": (["--parallelism.pipeline_parallel_microbatch_size", "3"], "microbatch_size"),
    "unknown key": (["--training.stepz", "3"], "training.stepz"),
    "unknown table": (["--nosuch.key", "1"], "nosuch"),
    "wrong type": (["--training.steps", "many"], "training.steps"),
    "unknown mode": (["--protocol.mode", "sparse"], "protocol.mode"),
    "unsupported schedule": (["--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"], "pipeline_parallel_schedule"),
    "unknown optimizer": (["--optimizer.name", "sgd"], "optimizer.name"),
    "negative bandwidth": (["--wan.bandwidth_mbps", "-5"], "wan.bandwidth_mbps"),
    "negative learning rate (a TorchTitan key's declared range)": (["--optimizer.lr", "-1.0"], "optimizer.lr = -1.0: must be > 0"),
    "warmup below 0 (a TorchTitan table)": (["--lr_scheduler.warmup_steps", "-1"], "lr_scheduler.warmup_steps = -1: must be >= 0"),
    "per-boundary list of wrong length": (["--wan.latency_ms_per_boundary", "[10, 20]"], "wan.latency_ms_per_boundary"),
    "missing data file": (["--dataloader.files", "/nonexistent/corpus.jsonl", *NO_VALIDATION], "dataloader.files"),
    "empty glob": (["--dataloader.files", "/nonexistent/*.parquet", *NO_VALIDATION], "dataloader.files"),
    "unsupported file format": (["--dataloader.files", "README.md", *NO_VALIDATION], "dataloader.files"),
    "missing text field": (["--dataloader.text_field", "body"], "dataloader.text_field"),
    "two corpora": (["--dataloader.files", "a.jsonl", "--dataloader.hf_dataset", "allenai/c4"], "dataloader.files"),
    "validation without validation data": (["--dataloader.validation_files", ""], "validator.enable"),
    "TorchTitan's dataset names": (["--dataloader.dataset", "c4"], "dataloader.dataset"),
    "tokenizer larger than the model vocabulary": (["--model.vocab_size", "4096"], "model.vocab_size"),
    "missing tokenizer": (["--hf_assets_path", "/nonexistent/tokenizer"], "hf_assets_path"),
    "unwritable dump folder": (["--dump_folder", "/proc/protocol_models_run"], "dump_folder"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_by_the_check(tmp_path, case):
    overrides, key = CASES[case]
    dump = tmp_path / "dump"
    _assert_refused(["--dump_folder", str(dump), *overrides], key)
    assert not dump.exists(), "the check wrote into the dump folder"


@pytest.mark.parametrize("case", ["unknown key", "unwritable dump folder"])
def test_the_launcher_stops_before_any_worker(tmp_path, case):
    overrides, key = CASES[case]
    dump = tmp_path / "dump"
    _assert_refused(["--dump_folder", str(dump), *overrides], key, launcher=True)
    assert not dump.exists(), "a worker started and wrote into the dump folder"


def _assert_refused(args: list[str], key: str, toml=DEBUG, launcher: bool = False) -> str:
    """The one ``error:`` line naming ``key``: of ``scripts/train.sh`` (``launcher``), else of
    the check it runs first, called in this process."""
    if launcher:
        result = subprocess.run(
            ["bash", "scripts/train.sh", str(toml), *args],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        code, out, err = result.returncode, result.stdout, result.stderr
    else:
        out_buffer, err_buffer = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out_buffer), contextlib.redirect_stderr(err_buffer):
            code = run_config.main(["--toml", str(toml), *args])
        out, err = out_buffer.getvalue(), err_buffer.getvalue()
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("error: ") and key in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert "Mbit" not in out and "step:" not in out, "a worker started"
    return lines[0]


@pytest.mark.parametrize(
    ("name", "content"),
    [("empty.jsonl", b""), ("corrupt.parquet", b"PAR1 this is not a parquet file PAR1"),
     ("broken.jsonl", b'{"text": "unterminated\n')],
)  # fmt: skip
def test_unreadable_data_file_is_refused(tmp_path, name, content):
    bad = tmp_path / name
    bad.write_bytes(content)
    line = _assert_refused(
        ["--dump_folder", str(tmp_path / "dump"), "--dataloader.files", str(bad), *NO_VALIDATION],
        "dataloader.files",
    )
    assert str(bad) in line


def test_tokenizer_without_eos_is_refused(tmp_path):
    """Documents must be separated: a tokenizer folder whose config names no EOS token."""
    assets = tmp_path / "tokenizer"
    assets.mkdir()
    shutil.copy(REPO / ".cache" / "shakespeare" / "tokenizer" / "tokenizer.json", assets)
    line = _assert_refused(
        ["--dump_folder", str(tmp_path / "dump"), "--hf_assets_path", str(assets)], "hf_assets_path"
    )
    assert "names no EOS token" in line


def test_worker_refuses_unprepared_bundled_data(tmp_path):
    """The worker started directly (``torchrun ... -m protocol_models.train``, not through
    ``scripts/train.sh``) in a checkout whose bundled data was never prepared: one line naming
    the missing tokenizer file and the prepare command, before TorchTitan loads the tokenizer.
    The launcher's check still lets it through there (``train.sh`` prepares the data next)."""
    shutil.copy(DEBUG, tmp_path / "debug_cpu.toml")  # its paths: .cache/shakespeare/, absent here
    args = ["--toml", "debug_cpu.toml", "--dump_folder", str(tmp_path / "dump")]
    env = {**os.environ, "PROTOCOL_MODELS_DEVICE": "cpu"}
    check = subprocess.run([sys.executable, "-m", "protocol_models.config", *args], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert check.returncode == 0, check.stderr
    worker = subprocess.run([sys.executable, "-m", "protocol_models.train", *args], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
    assert worker.returncode == 2
    assert "Traceback" not in worker.stdout + worker.stderr
    (line,) = worker.stderr.strip().splitlines()
    missing = tmp_path / ".cache" / "shakespeare" / "tokenizer" / "tokenizer.json"
    assert line.startswith("error: hf_assets_path = '.cache/shakespeare/tokenizer'"), line
    assert f"({missing} is missing)" in line and "`python -m protocol_models.prepare`" in line
    assert not (tmp_path / ".cache").exists() and not (tmp_path / "dump").exists()


def test_resume_with_a_different_k_is_refused(tmp_path):
    dump = tmp_path / "run"
    torchrun(2, dump, "--training.steps", "2", "--checkpoint.enable")
    before = sorted(str(p) for p in dump.rglob("*"))
    line = _assert_refused(
        ["--dump_folder", str(dump), "--checkpoint.enable", "--protocol.k", "8"],
        "protocol.k",
        toml=TINY,
        launcher=True,
    )
    assert "basis is [64, 4] there but [64, 8]" in line
    assert sorted(str(p) for p in dump.rglob("*")) == before, "the dump folder was modified"


def _launch_two_nodes(tmp_path, node_ranks: list[int], *per_node: list[str], restarts: int = 0) -> list:
    """Two torchrun "nodes" (one process each, c10d rendezvous on localhost), started with the
    given ``--node_rank`` values, ``--max-restarts restarts`` and per-node extra overrides."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [
        subprocess.Popen(
            [sys.executable, "-m", "protocol_models.launch", "--nnodes", "2", "--node_rank", str(rank),
             "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--nproc_per_node", "1",
             "--max-restarts", str(restarts),
             "-m", "protocol_models.train", "--toml", str(TINY), *extra],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for rank, extra in zip(node_ranks, per_node, strict=True)
    ]  # fmt: skip


@pytest.mark.parametrize("differs", ["seed", "basis file"])
def test_subspace_mismatch_between_nodes_is_refused_at_startup_and_not_restarted(tmp_path, differs):
    """Two torchrun "nodes" (one stage each) launched with different protocol.seed, or each with
    a basis file of other contents on its own disk, and two restarts allowed: a user error is
    deterministic, so the run ends after the first attempt, its last line the error."""
    if differs == "seed":
        settings = [["--protocol.seed", "7"], ["--protocol.seed", "8"]]
        named = ["seed=7", "seed=8"]
    else:
        for rank in (0, 1):  # each node its own file
            (tmp_path / f"node{rank}").mkdir()
            u = orthonormalize(torch.randn(64, 4, generator=torch.Generator().manual_seed(rank)))
            save_file({"basis": u.contiguous()}, str(tmp_path / f"node{rank}" / "u.safetensors"))
        settings = [["--protocol.basis_file", str(tmp_path / f"node{r}" / "u.safetensors")]
                    for r in (0, 1)]  # fmt: skip
        named = ["stage(s) [0] on rank(s) [0]", "stage(s) [1] on rank(s) [1]", "basis_file"]
    nodes = _launch_two_nodes(
        tmp_path, [0, 1],
        *(["--dump_folder", str(tmp_path / f"node{rank}"), *settings[rank]] for rank in (0, 1)),
        restarts=2,
    )  # fmt: skip
    for node in nodes:
        out, err = node.communicate(timeout=300)
        assert node.returncode == 2, err[-3000:]
        assert "error: pipeline stages disagree on the subspace" in err
        assert all(n in err for n in named), err[-3000:]
        # the worker's line, then the launcher's: no second attempt met the error again
        assert err.count("pipeline stages disagree") == 2, err[-3000:]
        assert err.strip().splitlines()[-1].endswith("(not restarted: a user error would recur)")
        assert "Traceback" not in out + err
        assert "step:  1" not in out + err, "training started"


def test_two_nodes_with_one_node_rank_are_refused(tmp_path):
    """Both nodes started with --node_rank 0: the rendezvous refuses the pair (no worker starts)."""
    run = ["--dump_folder", str(tmp_path / "run")]
    nodes = _launch_two_nodes(tmp_path, [0, 0], run, run)
    for node in nodes:
        out, err = node.communicate(timeout=120)
        assert node.returncode == 2
        assert err.strip() == (
            "error: rendezvous failed: the 2 nodes were started with node ranks [0, 0]; each of "
            "0..1 must be given to exactly one node"
        )
    assert not (tmp_path / "run").exists(), "a worker started"


def test_toml_syntax_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps = 3\n")
    result = subprocess.run(
        ["bash", "scripts/train.sh", str(bad)], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "bad.toml" in line and "TOML" in line


HELP_PROBE = """
import runpy, sys
for name in sys.argv[1:]:  # protocol_models.train ends its process (os._exit): last
    print(f"@@ {name}", flush=True)
    sys.argv = [name, "--help"]
    try:
        runpy.run_module(name, run_name="__main__")
    except SystemExit as e:
        print(f"@@ exit {e.code or 0}", flush=True)
"""
"""Runs ``python -m NAME --help`` for every module named on its command line in one interpreter;
each answer follows a ``@@ NAME`` line."""


def help_texts(modules: list[str]) -> dict[str, str]:
    """``--help``'s answer of every module (``HELP_PROBE``), by module name."""
    result = subprocess.run([sys.executable, "-c", HELP_PROBE, *modules], cwd=REPO,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "error:" not in result.stderr, result.stderr[-2000:]
    return dict(c.split("\n", 1) for c in result.stdout.split("@@ ")[1:] if "\n" in c)


def test_quickstart_help_moves_nothing():
    """``bash scripts/quickstart.sh --help`` prints its usage and exits 0 before anything runs:
    an earlier quick start's folder stays where it is."""
    dump = REPO / "outputs" / "quickstart"
    before = sorted(p.name for p in dump.parent.glob("quickstart*"))
    script = subprocess.run(["bash", "scripts/quickstart.sh", "--training.steps", "2", "--help"],
                            cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert script.returncode == 0 and "bash scripts/quickstart.sh" in script.stdout, script.stderr
    assert sorted(p.name for p in dump.parent.glob("quickstart*")) == before


def test_every_command_answers_help_with_its_usage():
    """``--help`` on ``scripts/train.sh`` (alone, or after a config and overrides: no worker, no
    traceback) and on every ``python -m protocol_models.X`` (the top-level commands and
    ``config``) prints what the command takes on stdout and exits 0 (one interpreter runs every
    command's ``__main__``)."""
    for args in (["--help"], ["configs/debug_cpu.toml", "--training.steps", "2", "--help"]):
        script = subprocess.run(["bash", "scripts/train.sh", *args], cwd=REPO,
                                capture_output=True, text=True, timeout=60)  # fmt: skip
        assert script.returncode == 0 and "bash scripts/train.sh CONFIG.toml" in script.stdout
        assert "Traceback" not in script.stderr, script.stderr[-2000:]
    names = sorted(p.stem for p in (REPO / "protocol_models").glob("*.py") if p.stem != "__init__")
    names = [f"protocol_models.{n}" for n in [n for n in names if n != "train"] + ["config", "train"]]
    chunks = help_texts(names)
    for name in names:
        usage = chunks.get(name, "")
        assert name in usage or "usage:" in usage, (name, usage[:300])
    assert all(f"exit {code}" not in chunks for code in (1, 2)), chunks


DOCUMENTED = ["README.md", "docs/*.md", "results/README.md", "configs/*.toml", "scripts/*.sh"]
"""Where the commands a user copies are written."""


def documented_commands() -> list[tuple[str, str, str]]:
    """``(file, module, the rest of the line)`` of every ``python -m protocol_models.X`` or
    ``python -m recipes.X`` written in ``DOCUMENTED`` (up to a comment or the code span's end;
    a capitalised placeholder such as ``X`` is not a module)."""
    found = []
    for pattern in DOCUMENTED:
        for path in sorted(REPO.glob(pattern)):
            for match in re.finditer(r"python -m ((?:protocol_models|recipes)\.[a-z_][\w.]*)([^`|#\n]*)",
                                      path.read_text()):  # fmt: skip
                found.append((str(path.relative_to(REPO)), match[1], match[2]))
    return found


def test_documented_commands_exist_with_the_options_they_are_given():
    """Every documented ``python -m`` command of the package or the recipes is a module that
    answers ``--help``, and every ``--option`` the docs give it (not a ``--section.key``
    config override, not ``--toml``, which every command takes) is one its usage names; every
    ``bash scripts/...`` and ``configs/...toml`` the docs name exists."""
    commands = documented_commands()
    modules = sorted({m for _, m, _ in commands} - {"protocol_models.train"})
    assert len(commands) > 50 and "recipes.quality_gap" in modules
    helps = help_texts(modules)
    for where, module, rest in commands:
        if module == "protocol_models.train":
            continue
        usage = helps.get(module, "")
        assert "usage:" in usage or module in usage, (where, module, usage[:300])
        for option in re.findall(r"(?<![\w.-])--([a-z][\w-]*)(?=[\s=]|$)", rest):
            if option not in {"toml", "help"}:
                assert f"--{option}" in usage, (where, module, option)
    for pattern in DOCUMENTED:
        for path in sorted(REPO.glob(pattern)):
            text = path.read_text()
            for named in re.findall(r"bash (scripts/\w[\w/.-]*\.sh)", text) + re.findall(
                    r"(?<![\w/])(configs/\w[\w.-]*\.toml)", text):  # fmt: skip
                assert (REPO / named).is_file(), (str(path.relative_to(REPO)), named)
