"""The TOML layer: tables map onto TorchTitan's config, CLI overrides win, types are enforced."""

from __future__ import annotations

import shutil

import pytest
from conftest import REPO

from protocol_models.config.run_config import ConfigError, load_config, parse_overrides

DEBUG = str(REPO / "configs" / "debug_cpu.toml")
ASYNC = ["--parallelism.pipeline_parallel_schedule", "Async1F1B"]


def test_tables_reach_trainer_config():
    config = load_config(DEBUG, [])
    assert config.model.dim == 256 and config.protocol.k == 8
    assert config.parallelism.pipeline_parallel_schedule == "GPipe"
    assert config.training.local_batch_size == 8
    (group,) = config.optimizer.param_groups
    assert group.optimizer_name == "AdamW" and group.optimizer_kwargs["lr"] == 1e-3
    assert config.loss.global_vocab_size == config.model.vocab_size


def test_cli_overrides_win_over_toml():
    config = load_config(
        DEBUG, ["--protocol.mode", "dense", "--training.steps=7", "--optimizer.lr", "2e-4"]
    )
    assert config.protocol.mode == "dense"
    assert config.training.steps == 7
    assert config.optimizer.param_groups[0].optimizer_kwargs["lr"] == 2e-4


@pytest.mark.parametrize(
    "toml",
    sorted([*(REPO / "configs").glob("*.toml"), *(REPO / "tests").glob("*.toml")]),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_every_bundled_config_passes_the_check(toml):
    """Every key of every bundled TOML lies in its declared range (``protocol_models.tools.ranges``)."""
    load_config(str(toml), [], check_environment=False)


def test_override_literals():
    assert parse_overrides(["--a.b", "3", "--c", "--d.e=x y", "--f", "[1, 2]"]) == [
        ("a.b", 3), ("c", True), ("d.e", "x y"), ("f", [1, 2]),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--protocol.k", "1.5"], "protocol.k = 1.5: expected an integer"),
        (["--training.dtype", "float8"], "training.dtype = 'float8': expected one of"),
        (["--model", "3"], "model = 3: expected a table [model]"),
        (["--activation_checkpoint", "some"], "activation_checkpoint = 'some'"),
        (["--protocol.stages", "3"], "protocol.stages = 3: must equal"),
        (["--checkpoint.create_seed_checkpoint"], "needs checkpoint.enable"),
        (
            ["--protocol.layers_per_stage", "[4, 2, 2]"],
            "protocol.layers_per_stage = [4, 2, 2]: expected 2 entries, one per pipeline stage",
        ),
        (
            ["--protocol.layers_per_stage", "[8, 0]"],
            "protocol.layers_per_stage = [8, 0]: every entry must be >= 1 (every stage needs at "
            "least one block)",
        ),
        (["--protocol.layers_per_stage", "[4, 3]"], "sums to 7, expected model.n_layers = 8"),
        (["--protocol.layers_per_stage", "[4, 'x']"], "expected a list of integers"),
        (["--dataloader.num_workers", "2"], "dataloader.num_workers = 2: must be 0"),
        (
            ["--training.global_batch_size", "12"],
            "training.global_batch_size = 12: must be a multiple of training.local_batch_size x "
            "the data-parallel degree = 8",
        ),
        (
            ["--profiler.enable_profiling", "--profiler.profile_freq", "2"],
            "profiler.profile_freq = 2: must be >= profiler.profiler_warmup + "
            "profiler.profiler_active = 4",
        ),
        (
            ["--dataloader.validation_split", "validation", "--dataloader.validation_files", ""],
            "names a split of dataloader.hf_dataset",
        ),
        (["--dataloader.validation_fraction", "0.1"], "at most one of dataloader.validation_files"),
        (
            ["--dataloader.validation_fraction", "1.5", "--dataloader.validation_files", ""],
            "must be in [0, 1)",
        ),
        (
            ["--validator.dataloader.files", "x.jsonl"],
            "[validator.dataloader]: the validation data is part of [dataloader]",
        ),
        *(
            ([*ASYNC, *extra], message)
            for extra, message in [
                (["--parallelism.data_parallel_shard_degree", "2"],
                 "parallelism.data_parallel_shard_degree = 2: parallelism.pipeline_parallel_schedule"
                 " = 'Async1F1B' runs one process per pipeline stage"),
                (["--protocol.mode", "mapl"], "protocol.mode = 'mapl': parallelism.pipeline"),
                (["--protocol.update_every", "10"], "protocol.update_every = 10: parallelism."),
                (["--activation_checkpoint", "full"], "activation_checkpoint = 'full': "),
                (["--training.global_batch_size", "16"], "training.global_batch_size = 16: "),
                (["--transport.prepost_receives", "false"], "transport.prepost_receives = false"),
                (["--transport.async_hop_depth", "4"],
                 "transport.async_hop_depth = 4: with 2 stages and 4 microbatches per step the "
                 "first stage's backwards may trail by at most 3, so the hop depth must be in "
                 "[1, 3]"),
                (["--parallelism.pipeline_parallel_microbatch_size", "8"],
                 "which needs at least 2 microbatches per step"),
            ]
        ),
    ],
)
def test_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=None) as err:
        load_config(DEBUG, overrides)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_no_silent_cpu_fallback(monkeypatch):
    """A GPU config on a machine without usable CUDA is refused with the driver's reason; a CPU
    config is accepted, and refused only in a worker that TorchTitan bound to the GPU."""
    from protocol_models.tools.cpu_shim import check_device

    monkeypatch.delenv("PROTOCOL_MODELS_DEVICE", raising=False)
    with pytest.raises(
        ConfigError, match=r"hardware.device = 'cuda', but CUDA is unusable: .*driver"
    ):
        check_device("cuda", "cpu")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    check_device("cpu", "cuda")  # the config check on a GPU login node: trains nothing
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError, match="PROTOCOL_MODELS_DEVICE=cpu"):
        check_device("cpu", "cuda")
    check_device("cpu", "cpu")


@pytest.mark.parametrize(
    ("toml", "repo"),
    [("llama3_2b_protocol", "openai-community/gpt2"), ("llama3_2b_dense", "openai-community/gpt2"),
     ("llama3_8b_protocol", "meta-llama/Llama-3.1-8B"), ("llama3_8b_dense", "meta-llama/Llama-3.1-8B")],
)  # fmt: skip
def test_production_configs_start_once_the_tokenizer_is_fetched(
    tmp_path, monkeypatch, capsys, toml, repo
):
    """Before the fetch: one line naming the command that fetches the config's tokenizer. After
    it (a tokenizer.json in hf_assets_path, here the bundled one standing in): the check passes.
    (On this CPU machine the check runs with hardware.device = 'cpu'; the Hub is not asked, and
    wandb logs offline: online it would want a key, test_cluster_start.py.)"""
    from protocol_models.config.run_config import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("WANDB_MODE", "offline")
    assets = tmp_path / "assets"
    args = ["--toml", str(REPO / "configs" / f"{toml}.toml"), "--hardware.device", "cpu",
            "--hf_assets_path", str(assets), "--dump_folder", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.endswith(f"fetch it with: python -m protocol_models.assets {repo} --dest {assets}")
    shutil.copytree(REPO / ".cache" / "shakespeare" / "tokenizer", assets)
    assert main(args) == 0
    assert "nproc=" in capsys.readouterr().out


def test_a_corpus_named_over_a_base_replaces_the_bases_corpus(tmp_path):
    """A file built on the 2B config (C4 from the Hub, streamed, validation split) that names
    its own files, or the same by an override: nothing of C4 carries over."""
    mine = tmp_path / "mine.toml"
    mine.write_text(
        f'base = "{REPO / "configs" / "llama3_2b_protocol.toml"}"\n'
        '[dataloader]\nfiles = "/data/*.parquet"\nvalidation_fraction = 0.01\n'
    )
    by_base = load_config(str(mine), [], check_environment=False).dataloader
    by_override = load_config(
        str(REPO / "configs" / "llama3_2b_protocol.toml"),
        ["--dataloader.files", "/data/*.parquet", "--dataloader.validation_fraction", "0.01"],
        check_environment=False,
    ).dataloader
    for loader in (by_base, by_override):
        assert loader.files == "/data/*.parquet" and loader.validation_fraction == 0.01
        assert not loader.hf_dataset and not loader.hf_config and not loader.validation_split
        assert not loader.streaming and not loader.validation_files
