"""The strict TOML layer: TOML tables (+ ``--section.key value`` overrides) -> ``Trainer.Config``.

TorchTitan 0.3.0 configures runs with Python functions; users of this plugin edit TOML instead.
Each TOML table maps by name onto a field of ``ProtocolTrainer.Config`` (``[training]``,
``[parallelism]``, ``[metrics]``, ``[checkpoint]``, ``[validator]``, ...), plus the plugin's
``[model]`` (architecture) and ``[protocol]`` (method) tables and a compact ``[optimizer]`` table.
Unknown keys, wrong types and impossible values raise ``ConfigError`` with one line naming the key
and what is allowed -- before any worker process starts.

Three layers: ``protocol_models.config.toml_tables`` reads the TOML (``base`` files, overrides)
and assigns it with type coercion; each table's numeric and enumerated keys are checked against
their declared ranges (``protocol_models.tools.ranges``; TorchTitan's tables:
``protocol_models.config.torchtitan_ranges``) and each settings dataclass checks its own table
(``__post_init__``), both on the assembled config; ``validate`` below checks what needs several
keys at once, and ``protocol_models.config.preflight`` checks the config against this machine
(data, tokenizer, dump folder, checkpoint).

Run ``python -m protocol_models.config [--prepare] --toml FILE [overrides]`` to check a config
(and prepare its data); it prints the number of processes the run needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from typing import Any

import torch
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from protocol_models.config.preflight import validate_environment
from protocol_models.config.toml_tables import (
    CORPUS_KEYS,
    assign,
    expect_table,
    parse_overrides,
    read_layers,
    rerun_post_init,
    split_argv,
    usage_asked,
)
from protocol_models.config.torchtitan_ranges import TORCHTITAN_RANGES
from protocol_models.model.layout import stage_layer_ranges
from protocol_models.tools import nccl_rules
from protocol_models.tools.errors import ConfigError, require
from protocol_models.tools.ranges import OneOf
from protocol_models.training.checkpointing import ProtocolCheckpointManager
from protocol_models.training.optimizers import OPTIMIZERS, OptimizerSettings
from protocol_models.training.trainer import ProtocolTrainer
from protocol_models.wire.async_schedule import ASYNC_SCHEDULE, max_hop_depth

__all__ = ["ConfigError", "load_config", "parse_overrides", "split_argv", "usage_asked",
           "validate"]  # fmt: skip

ACTIVATION_CHECKPOINT = {"none": None, "selective": SelectiveAC.Config, "full": FullAC.Config}
_TOP_LEVEL_SPECIAL = ("activation_checkpoint", "optimizer")


def default_config() -> ProtocolTrainer.Config:
    """What a TOML file starts from: the bundled Shakespeare data, GPipe, CPU-friendly settings.
    (The validator's dataloader is derived from ``[dataloader]`` in ``_build``.)"""
    return ProtocolTrainer.Config(
        hf_assets_path=".cache/shakespeare/tokenizer",
        dump_folder="outputs/run",
        training=TrainingConfig(disable_cuda_graphs=True, mixed_precision_param="float32"),
        parallelism=ParallelismConfig(
            pipeline_parallel_schedule="GPipe", spmd_backend="partial_dtensor"
        ),
        checkpoint=ProtocolCheckpointManager.Config(enable=False, last_save_model_only=False),
        activation_checkpoint=None,
    )


def load_config(
    toml_path: str | None,
    overrides: list[str],
    *,
    check_environment: bool = True,
    worker: bool = False,
) -> ProtocolTrainer.Config:
    """Build the run's config from a TOML file and ``--section.key value`` overrides.

    ``check_environment=False`` skips the file-system checks (data, tokenizer, dump folder,
    checkpoint), e.g. to plan a cluster run on a laptop. ``worker=True`` (the training worker)
    also refuses bundled data that is not prepared yet, which the launcher's check leaves to
    ``scripts/train.sh``.
    """
    table = read_layers(toml_path, overrides)
    with _quiet_warnings():
        config = _build(table)
    if check_environment:
        validate_environment(config, worker=worker)
    return config


@contextlib.contextmanager
def _quiet_warnings():
    """TorchTitan's config dataclasses log warnings about their own defaults (e.g. checkpoint's
    ``initial_load_model_only``); keep the check's output to the one line that matters."""
    logging.disable(logging.WARNING)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


def _build(table: dict[str, Any]) -> ProtocolTrainer.Config:
    config = default_config()
    optimizer = OptimizerSettings()
    loader_table = table.get("dataloader", {})
    if isinstance(loader_table, dict) and set(CORPUS_KEYS) & set(loader_table):
        # a [dataloader] that names a corpus replaces the bundled one, validation files included
        config.dataloader.files = config.dataloader.validation_files = ""
    validator_table = table.get("validator", {})
    if isinstance(validator_table, dict) and "dataloader" in validator_table:
        raise ConfigError(
            "[validator.dataloader]: the validation data is part of [dataloader] "
            "(validation_files, validation_fraction, or validation_split for hf_dataset)"
        )
    for key, value in table.items():
        if key == "optimizer":
            assign(optimizer, expect_table(value, key), key)
        elif key == "activation_checkpoint":
            OneOf(ACTIVATION_CHECKPOINT).require(key, value)
            factory = ACTIVATION_CHECKPOINT[value]
            config.activation_checkpoint = factory() if factory else None
        else:
            assign(config, {key: value}, "", also_allowed=_TOP_LEVEL_SPECIAL)
    rerun_post_init(optimizer, "optimizer", TORCHTITAN_RANGES)
    learned = config.protocol.mode == "mapl" and config.layout_stages > 1
    require(
        optimizer.writer_lr_scale == 1.0 or config.layout_stages > 1,
        f"optimizer.writer_lr_scale = {optimizer.writer_lr_scale}: no block is upstream of a "
        "boundary in a 1-stage layout (set protocol.stages)",
    )
    config.optimizer = optimizer.to_container_config(
        config.protocol.projection_lr if learned else None
    )
    config.protocol.parametrization = optimizer.parametrization
    config.loss = CrossEntropyLoss.Config(global_vocab_size=config.model.vocab_size)
    rerun_post_init(config, "", TORCHTITAN_RANGES)
    config.validator.dataloader = dataclasses.replace(config.dataloader, split="validation")
    validate(config)
    return config


def validate(config: ProtocolTrainer.Config) -> None:
    """Checks that need several keys at once; each failure names the offending key."""
    model, protocol, par, training = (
        config.model,
        config.protocol,
        config.parallelism,
        config.training,
    )
    pp = par.pipeline_parallel_degree
    require(
        protocol.k <= model.dim,
        f"protocol.k = {protocol.k}: must be an integer in [1, model.dim = {model.dim}]",
    )
    config.codec.check(
        protocol.mode, model.dim, par.pipeline_parallel_microbatch_size * training.seq_len,
        protocol.k,
    )  # fmt: skip
    whole_matrices = OPTIMIZERS[config.optimizer.name].whole_matrices
    if par.data_parallel_shard_degree > 1 and (whole_matrices or protocol.update_every):
        needs = (
            f"optimizer.name = {config.optimizer.name!r}"
            if whole_matrices
            else f"protocol.update_every = {protocol.update_every}"
        )
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree = {par.data_parallel_shard_degree}: "
            f"{needs} acts on whole matrices; use data_parallel_replicate_degree for data "
            "parallelism (or optimizer.name = 'adamw' with update_every = 0 to shard)"
        )
    require(
        pp <= model.n_layers,
        f"parallelism.pipeline_parallel_degree = {pp}: more pipeline stages than "
        f"model.n_layers = {model.n_layers} (each stage needs at least one layer)",
    )
    if protocol.stages is not None:
        require(
            protocol.stages <= model.n_layers,
            f"protocol.stages = {protocol.stages}: must be in [1, model.n_layers = "
            f"{model.n_layers}]",
        )
        require(
            pp == 1 or protocol.stages == pp,
            f"protocol.stages = {protocol.stages}: must equal "
            f"parallelism.pipeline_parallel_degree = {pp} when the run is pipelined",
        )
    if protocol.layers_per_stage is not None:
        stage_layer_ranges(model.n_layers, config.layout_stages, protocol.layers_per_stage)
    mb = par.pipeline_parallel_microbatch_size
    require(
        pp == 1 or training.local_batch_size % mb == 0,
        f"parallelism.pipeline_parallel_microbatch_size = {mb}: must divide "
        f"training.local_batch_size = {training.local_batch_size}",
    )
    per_step = training.local_batch_size * config.replicas
    require(
        training.global_batch_size == -1 or training.global_batch_size % per_step == 0,
        f"training.global_batch_size = {training.global_batch_size}: must be a multiple of "
        f"training.local_batch_size x the data-parallel degree = {per_step}",
    )
    profiler = config.profiler
    require(
        not profiler.enable_profiling
        or profiler.profile_freq >= profiler.profiler_warmup + profiler.profiler_active,
        f"profiler.profile_freq = {profiler.profile_freq}: must be >= profiler.profiler_warmup "
        f"+ profiler.profiler_active = {profiler.profiler_warmup + profiler.profiler_active}",
    )
    config.wan.check_boundaries(pp - 1)
    require(
        not config.checkpoint.create_seed_checkpoint or config.checkpoint.enable,
        "checkpoint.create_seed_checkpoint = true needs checkpoint.enable = true",
    )
    prompts = config.metrics.sample_prompts
    require(
        len(prompts) <= training.local_batch_size,
        f"metrics.sample_prompts: {len(prompts)} prompts: at most "
        f"training.local_batch_size = {training.local_batch_size}",
    )
    require(
        not prompts or not model.loss_chunk_tokens,
        "metrics.sample_prompts needs the logits: model.loss_chunk_tokens = 0",
    )
    if par.pipeline_parallel_schedule == ASYNC_SCHEDULE:
        check_async(config)
    nccl_rules.check_device(config.hardware.device)
    for key in ("delay_compensation", "weight_prediction"):
        value = getattr(config.optimizer, key)
        require(
            value == 0 or par.pipeline_parallel_schedule == ASYNC_SCHEDULE,
            f"optimizer.{key} = {value}: corrects a delayed gradient, which only "
            "parallelism.pipeline_parallel_schedule = 'Async1F1B' has",
        )
    require(
        not config.validator.enable or config.dataloader.has_validation,
        "validator.enable = true, but [dataloader] names no validation data: set "
        "dataloader.validation_files, validation_fraction or (with hf_dataset) validation_split",
    )


def check_async(config: ProtocolTrainer.Config) -> None:
    """What the asynchronous schedule (``Async1F1B``, one GPU per stage) cannot run, each refused
    with the reason."""
    par, protocol, training = config.parallelism, config.protocol, config.training
    pp, name = par.pipeline_parallel_degree, "parallelism.pipeline_parallel_schedule = 'Async1F1B'"
    require(
        pp == 1 or tuple(map(int, torch.__version__.split(".")[:2])) < (2, 15),
        f"{name} needs torch 2.14 (this is {torch.__version__}): from 2.15 a pipeline stage owns "
        "each receive buffer until its microbatch's step is complete and refuses a receive "
        "posted into it earlier, and this schedule posts the next batch's receives while the "
        "last batch's backwards still trail; use GPipe or 1F1B",
    )
    for key in ("data_parallel_replicate_degree", "data_parallel_shard_degree",
                "tensor_parallel_degree", "context_parallel_degree"):  # fmt: skip
        value = getattr(par, key)
        require(
            value in (1, -1) if key == "data_parallel_shard_degree" else value == 1,
            f"parallelism.{key} = {value}: {name} runs one process per pipeline stage (its "
            "gradients live in per-stage weight versions that no data-parallel reduction "
            "sees); use GPipe or 1F1B to combine pipelining with data parallelism",
        )
    require(
        training.global_batch_size in (-1, training.local_batch_size),
        f"training.global_batch_size = {training.global_batch_size}: {name} takes one schedule "
        f"call per step (no gradient accumulation): set it to -1 or local_batch_size",
    )
    require(
        protocol.mode != "mapl",
        f"protocol.mode = 'mapl': {name} cannot delay MAPL's per-step boundary synchronization; "
        "use GPipe or 1F1B",
    )
    require(
        protocol.update_every == 0,
        f"protocol.update_every = {protocol.update_every}: {name} does not move the subspace "
        "(the dL/dU of two batches in flight would mix); set it to 0",
    )
    ac = next((key for key, kind in ACTIVATION_CHECKPOINT.items()
               if kind and isinstance(config.activation_checkpoint, kind)), "none")  # fmt: skip
    require(
        ac == "none",
        f"activation_checkpoint = {ac!r}: {name} "
        "forwards each batch with its own weight version, which a recompute in the backward "
        "would not use; set activation_checkpoint = 'none'",
    )
    transport = config.transport
    require(
        pp == 1 or (transport.prepost_receives and transport.exchange_grad_norm),
        f"transport.prepost_receives = {str(transport.prepost_receives).lower()}, "
        f"exchange_grad_norm = {str(transport.exchange_grad_norm).lower()}: {name} posts each "
        "step's receives and its norm exchange ahead; set both to true",
    )
    if pp > 1:
        n_mb = training.local_batch_size // par.pipeline_parallel_microbatch_size
        limit = max_hop_depth(pp, n_mb)
        require(
            transport.async_hop_depth <= limit,
            f"transport.async_hop_depth = {transport.async_hop_depth}: with {pp} stages and {n_mb} "
            f"microbatches per step the first stage's backwards may trail by at most {n_mb - 1}, "
            + (f"so the hop depth must be in [1, {limit}]" if limit else
               f"which needs at least {pp} microbatches per step (training.local_batch_size / "
               "parallelism.pipeline_parallel_microbatch_size)"),
        )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    """Check a config. On success print ``nproc=<N>`` (processes the run needs) and
    ``device=<cuda|cpu>``; on failure print one ``error:`` line to stderr and return 2. With
    ``--prepare`` before the config's arguments, the same process then makes ready what the
    config reads before any worker starts (``protocol_models.data.loader.prepare``: the bundled
    data, the token-id cache of a map-style corpus), one ``data:`` line per part on stderr, a
    part it cannot prepare being one ``error:`` line. With ``[transport] link_mbps`` and
    ``link_latency_ms`` stated, a node whose TCP settings would slow that link gets one
    ``warning:`` line on stderr with the ``sysctl`` command that fixes them; on one of several
    nodes (``NNODES`` > 1), one whose NCCL interface choice could pick a private address next
    to a VPN gets one too (``protocol_models.tools.interfaces``)."""
    from protocol_models.data import loader as data
    from protocol_models.tools.interfaces import interface_warning
    from protocol_models.wire.transport import tcp_advice

    args = sys.argv[1:] if argv is None else argv
    usage = "usage: python -m protocol_models.config [--prepare] --toml FILE [--section.key v ...]"
    if usage_asked(args, f"{usage}\n\n{main.__doc__}"):
        return 0
    make_ready = args[:1] == ["--prepare"]
    toml_path, overrides = split_argv(args[1:] if make_ready else args)
    try:
        config = load_config(toml_path, overrides)
        for line in data.prepare(config) if make_ready else ():
            print(f"data: {line}", file=sys.stderr)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"nproc={config.world_size}")
    print(f"device={config.hardware.device}")
    transport = config.transport
    advice = transport.link_stated and tcp_advice(
        transport.link_mbps, transport.link_latency_ms, loss=transport.link_packet_loss
    )
    if advice:
        print(advice, file=sys.stderr)
    interfaces = int(os.environ.get("NNODES", "1")) > 1 and interface_warning()
    if interfaces:
        print(interfaces, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
