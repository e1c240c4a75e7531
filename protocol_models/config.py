"""The strict TOML layer: TOML tables (+ ``--section.key value`` overrides) -> ``Trainer.Config``.

TorchTitan 0.3.0 configures runs with Python functions; users of this plugin edit TOML instead.
Each TOML table maps by name onto a field of ``ProtocolTrainer.Config`` (``[training]``,
``[parallelism]``, ``[metrics]``, ``[checkpoint]``, ``[validator]``, ...), plus the plugin's
``[model]`` (architecture) and ``[protocol]`` (method) tables and a compact ``[optimizer]`` table.
Unknown keys, wrong types and impossible values raise ``ConfigError`` with one line naming the key
and what is allowed -- before any worker process starts.

Run ``python -m protocol_models.config --toml FILE [overrides]`` to check a config; it prints the
number of processes the run needs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal

import tomli
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from protocol_models.errors import ConfigError
from protocol_models.model import stage_layer_ranges
from protocol_models.optimizers import OptimizerSettings
from protocol_models.pipeline import SCHEDULES
from protocol_models.trainer import ProtocolTrainer

__all__ = ["ConfigError", "load_config", "parse_overrides", "split_argv", "validate", "world_size"]

ACTIVATION_CHECKPOINT = {"none": None, "selective": SelectiveAC.Config, "full": FullAC.Config}
_TOP_LEVEL_SPECIAL = ("activation_checkpoint", "optimizer")
_WHOLE_MATRIX_OPTIMIZERS = {
    "Muon": "muon",
    "RowwiseAdamW": "adamw_rowwise",
    "ProjectedAdamW": "adamw_project",
}
"""Optimizers (container names -> TOML names) that need unsharded parameters."""
_HIDDEN = {
    "model_spec",
    "optimizer",
    "activation_checkpoint",
    "override",
    "loss",
    "tokenizer",
    "parametrization",
    "dataset",
    "dataset_path",
    "split",
}
"""Container fields TOML does not set (the dataloader's ``dataset``/``dataset_path`` are
TorchTitan's registry names, unused here; ``split`` is set on the validator's copy)."""
_CORPUS_KEYS = ("files", "hf_dataset")
CORPUS_DESCRIPTION = (
    *_CORPUS_KEYS,
    *("hf_config", "hf_split", "text_field", "sample_by", "streaming"),
    *("validation_files", "validation_split", "validation_fraction"),
)
"""``[dataloader]`` keys that describe one corpus (the rest say where and how to tokenize)."""


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
        checkpoint=CheckpointManager.Config(enable=False, last_save_model_only=False),
        activation_checkpoint=None,
    )


def load_config(
    toml_path: str | None, overrides: list[str], *, check_environment: bool = True
) -> ProtocolTrainer.Config:
    """Build the run's config from a TOML file and ``--section.key value`` overrides.

    ``check_environment=False`` skips the file-system checks (data, tokenizer, dump folder,
    checkpoint), e.g. to plan a cluster run on a laptop.
    """
    table = read_toml(Path(toml_path)) if toml_path is not None else {}
    pairs = parse_overrides(overrides)
    loader_keys = {key.split(".", 1)[1] for key, _ in pairs if key.startswith("dataloader.")}
    _replace_corpus(table, loader_keys)
    for key, value in pairs:
        _set_path(table, key.split("."), value)

    with _quiet_warnings():
        config = _build(table)
    if check_environment:
        validate_environment(config)
    return config


def read_toml(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Parse ``path``; a top-level ``base = "other.toml"`` (relative to the file) is read first
    and this file's tables are merged over it, key by key."""
    if not path.is_file():
        raise ConfigError(f"--toml {path}: no such file")
    try:
        table = tomli.loads(path.read_text())
    except tomli.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    base = table.pop("base", None)
    if base is None:
        return table
    parent = (path.parent / base).resolve()
    if parent in _seen:
        raise ConfigError(f"{path}: base = {base!r} includes itself")
    merged = read_toml(parent, (*_seen, path.resolve()))
    loader = table.get("dataloader")
    _replace_corpus(merged, set(loader) if isinstance(loader, dict) else set())
    _merge(merged, table)
    return merged


def _replace_corpus(table: dict, layer_keys: set[str]) -> None:
    """A layer (a TOML file over its ``base``, the overrides over the file) whose
    ``[dataloader]`` keys ``layer_keys`` name a corpus replaces the lower layer's corpus whole:
    no validation split, Hub config or streaming setting of another corpus carries over."""
    loader = table.get("dataloader")
    if not isinstance(loader, dict) or not set(_CORPUS_KEYS) & layer_keys:
        return
    for key in CORPUS_DESCRIPTION:
        loader.pop(key, None)


def _merge(into: dict, table: dict) -> None:
    for key, value in table.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


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
    if isinstance(loader_table, dict) and set(_CORPUS_KEYS) & set(loader_table):
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
            _assign(optimizer, _expect_table(value, key), key)
        elif key == "activation_checkpoint":
            if value not in ACTIVATION_CHECKPOINT:
                raise ConfigError(
                    f"activation_checkpoint = {value!r}: expected one of "
                    f"{sorted(ACTIVATION_CHECKPOINT)}"
                )
            factory = ACTIVATION_CHECKPOINT[value]
            config.activation_checkpoint = factory() if factory else None
        else:
            _assign(config, {key: value}, "")
    config.optimizer = optimizer.to_container_config()
    config.protocol.parametrization = optimizer.parametrization
    config.loss = CrossEntropyLoss.Config(global_vocab_size=config.model.vocab_size)
    _rerun_post_init(config, "")
    config.validator.dataloader = dataclasses.replace(config.dataloader, split="validation")
    validate(config)
    return config


def parse_overrides(argv: list[str]) -> list[tuple[str, Any]]:
    """``--a.b value`` / ``--a.b=value`` / bare ``--a.b`` (true) -> ``[("a.b", value)]``.

    Values are read as TOML literals (``20``, ``1e-3``, ``true``, ``[1, 2]``) and otherwise kept
    as strings (``dense``).
    """
    pairs, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or len(arg) == 2:
            raise ConfigError(
                f"unexpected argument {arg!r}: overrides look like --section.key value"
            )
        key, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                raw, i = argv[i + 1], i + 1
            else:
                raw = "true"
        pairs.append((key, _parse_literal(raw)))
        i += 1
    return pairs


def _parse_literal(raw: str) -> Any:
    try:
        return tomli.loads(f"v = {raw}")["v"]
    except tomli.TOMLDecodeError:
        return raw


def _set_path(table: dict, keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        table = table.setdefault(key, {})
        if not isinstance(table, dict):
            raise ConfigError(f"--{'.'.join(keys)}: '{key}' is not a table")
    table[keys[-1]] = value


def _expect_table(value: Any, key: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{key} = {value!r}: expected a table [{key}]")
    return value


def _field_types(obj: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(type(obj))
    return {
        f.name: hints.get(f.name, Any)
        for f in dataclasses.fields(obj)
        if not f.name.startswith("_") and f.name not in _HIDDEN
    }


def _assign(obj: Any, table: dict, prefix: str) -> None:
    """Set ``obj``'s dataclass fields from ``table``, recursing into sub-tables."""
    types_ = _field_types(obj)
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in types_:
            what = "table" if isinstance(value, dict) else "key"
            where = f"[{prefix}]" if prefix else "the top level"
            allowed = sorted([*types_, *([] if prefix else _TOP_LEVEL_SPECIAL)])
            raise ConfigError(f"unknown {what} '{name}' (allowed in {where}: {allowed})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _assign(current, _expect_table(value, name), name)
        else:
            setattr(obj, key, _coerce(value, types_[key], name))


def _coerce(value: Any, tp: Any, name: str) -> Any:
    if isinstance(value, dict):
        raise ConfigError(f"'{name}' is a value, not a table")
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for arm in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arm, name)
            except ConfigError:
                continue
        raise ConfigError(f"{name} = {value!r}: expected {_describe(tp)}")
    if origin is Literal:
        if value in args:
            return value
        raise ConfigError(f"{name} = {value!r}: expected one of {list(args)}")
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{name} = {value!r}: expected {_describe(tp)}")
        inner = args[0] if args else Any
        return [_coerce(v, inner, f"{name}[{i}]") for i, v in enumerate(value)]
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool):
        raise ConfigError(f"{name} = {value!r}: expected an integer")
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{name} = {value!r}: expected {_describe(tp)}")


def _describe(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    if tp in names:
        return names[tp]
    if typing.get_origin(tp) is Literal:
        return f"one of {list(typing.get_args(tp))}"
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if typing.get_origin(tp) in (list, tuple):
        return f"a list of {_describe(args[0]).removeprefix('an ').removeprefix('a ')}s"
    return getattr(tp, "__name__", str(tp))


def _rerun_post_init(obj: Any, prefix: str) -> None:
    """Re-run the dataclasses' own validation on the assembled config, as one-line errors."""
    for f in dataclasses.fields(obj):
        child = getattr(obj, f.name)
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            _rerun_post_init(child, f"{prefix}.{f.name}" if prefix else f.name)
    post_init = getattr(obj, "__post_init__", None)
    if post_init is not None:
        try:
            post_init()
        except (ValueError, AssertionError) as e:
            where = f"[{prefix}] " if prefix else ""
            raise ConfigError(f"{where}{e}".replace("\n", " ")) from None


def validate(config: ProtocolTrainer.Config) -> None:
    """Checks that need several keys at once; each failure names the offending key."""
    model, protocol, par, training = (
        config.model,
        config.protocol,
        config.parallelism,
        config.training,
    )
    pp = par.pipeline_parallel_degree
    _check(model.dim >= 1, f"model.dim = {model.dim}: must be >= 1")
    _check(model.n_layers >= 1, f"model.n_layers = {model.n_layers}: must be >= 1")
    _check(
        model.loss_chunk_tokens >= 0,
        f"model.loss_chunk_tokens = {model.loss_chunk_tokens}: must be >= 0 (0 = full logits)",
    )
    _check(
        model.n_heads >= 1 and model.dim % model.n_heads == 0,
        f"model.n_heads = {model.n_heads}: must divide model.dim = {model.dim}",
    )
    if model.n_kv_heads is not None:
        _check(
            model.n_kv_heads >= 1 and model.n_heads % model.n_kv_heads == 0,
            f"model.n_kv_heads = {model.n_kv_heads}: must divide model.n_heads = {model.n_heads}",
        )
    _check(
        1 <= protocol.k <= model.dim,
        f"protocol.k = {protocol.k}: must be an integer in [1, model.dim = {model.dim}]",
    )
    _validate_codec(config)
    whole_matrices = sorted(
        {g.optimizer_name for g in config.optimizer.param_groups} & set(_WHOLE_MATRIX_OPTIMIZERS)
    )
    if par.data_parallel_shard_degree > 1 and (whole_matrices or protocol.update_every):
        needs = (
            f"optimizer.name = {_WHOLE_MATRIX_OPTIMIZERS[whole_matrices[0]]!r}"
            if whole_matrices
            else f"protocol.update_every = {protocol.update_every}"
        )
        raise ConfigError(
            f"parallelism.data_parallel_shard_degree = {par.data_parallel_shard_degree}: "
            f"{needs} acts on whole matrices; use data_parallel_replicate_degree for data "
            "parallelism (or optimizer.name = 'adamw' with update_every = 0 to shard)"
        )
    _check(
        protocol.update_every >= 0,
        f"protocol.update_every = {protocol.update_every}: must be >= 0 (0 = no updates)",
    )
    _check(
        protocol.update_every == 0 or protocol.mode == "subspace",
        f"protocol.update_every = {protocol.update_every}: subspace updates need "
        f"protocol.mode = 'subspace' (got {protocol.mode!r})",
    )
    _check(
        0 < protocol.update_angle_deg <= 90,
        f"protocol.update_angle_deg = {protocol.update_angle_deg}: must be in (0, 90]",
    )
    _check(pp >= 1, f"parallelism.pipeline_parallel_degree = {pp}: must be >= 1")
    _check(
        pp <= model.n_layers,
        f"parallelism.pipeline_parallel_degree = {pp}: more pipeline stages than "
        f"model.n_layers = {model.n_layers} (each stage needs at least one layer)",
    )
    if protocol.stages is not None:
        _check(
            1 <= protocol.stages <= model.n_layers,
            f"protocol.stages = {protocol.stages}: must be in [1, model.n_layers = "
            f"{model.n_layers}]",
        )
        _check(
            pp == 1 or protocol.stages == pp,
            f"protocol.stages = {protocol.stages}: must equal "
            f"parallelism.pipeline_parallel_degree = {pp} when the run is pipelined",
        )
    if protocol.layers_per_stage is not None:
        stage_layer_ranges(model.n_layers, config.layout_stages, protocol.layers_per_stage)
    if pp > 1:
        _check(
            par.pipeline_parallel_schedule in SCHEDULES,
            f"parallelism.pipeline_parallel_schedule = {par.pipeline_parallel_schedule!r}: "
            f"expected one of {list(SCHEDULES)}",
        )
        mb = par.pipeline_parallel_microbatch_size
        _check(
            mb >= 1 and training.local_batch_size % mb == 0,
            f"parallelism.pipeline_parallel_microbatch_size = {mb}: must divide "
            f"training.local_batch_size = {training.local_batch_size}",
        )
    _check(training.steps >= 1, f"training.steps = {training.steps}: must be >= 1")
    _check(training.seq_len >= 1, f"training.seq_len = {training.seq_len}: must be >= 1")
    _check(
        training.local_batch_size >= 1,
        f"training.local_batch_size = {training.local_batch_size}: must be >= 1",
    )
    wan = config.wan
    for key in ("bandwidth_mbps", "latency_ms"):
        value = getattr(wan, key)
        _check(value >= 0, f"wan.{key} = {value}: must be >= 0 (0 = unlimited / none)")
        per = getattr(wan, f"{key}_per_boundary")
        _check(
            not per or (len(per) == pp - 1 and min(per) >= 0),
            f"wan.{key}_per_boundary = {per}: expected {pp - 1} non-negative values "
            f"(one per pipeline boundary)",
        )
    _check(
        not config.checkpoint.create_seed_checkpoint or config.checkpoint.enable,
        "checkpoint.create_seed_checkpoint = true needs checkpoint.enable = true",
    )
    _check(
        config.metrics.log_freq >= 1,
        f"metrics.log_freq = {config.metrics.log_freq}: must be >= 1",
    )
    _check(
        not config.validator.enable or config.dataloader.has_validation,
        "validator.enable = true, but [dataloader] names no validation data: set "
        "dataloader.validation_files, validation_fraction or (with hf_dataset) validation_split",
    )


def _validate_codec(config: ProtocolTrainer.Config) -> None:
    """``[codec]`` against the width and microbatch shape of a lossy ``protocol.mode``."""
    mode, codec, dim = config.protocol.mode, config.codec, config.model.dim
    if mode == "topk":
        _check(
            1 <= codec.topk <= min(dim, 32768),
            f"codec.topk = {codec.topk}: must be in [1, model.dim = {dim}] "
            "(indices travel as int16: model.dim <= 32768)",
        )
    if mode == "quant":
        _check(
            dim % (8 // codec.bits) == 0,
            f"codec.bits = {codec.bits}: model.dim = {dim} must be a multiple of "
            f"{8 // codec.bits} to bit-pack {codec.bits}-bit codes",
        )
    if mode in ("lowrank", "svd"):
        _check(
            1 <= codec.rank <= dim,
            f"codec.rank = {codec.rank}: must be an integer in [1, model.dim = {dim}]",
        )
    if mode == "svd":
        tokens = config.parallelism.pipeline_parallel_microbatch_size * config.training.seq_len
        _check(
            codec.rank <= tokens,
            f"codec.rank = {codec.rank}: must be <= the {tokens} tokens of a microbatch "
            "(parallelism.pipeline_parallel_microbatch_size x training.seq_len)",
        )


def validate_environment(config: ProtocolTrainer.Config) -> None:
    """Checks against the file system: data, tokenizer, dump folder, checkpoint to resume. The
    bundled Shakespeare data, when read and not yet prepared, is left to ``scripts/train.sh``
    (which prepares it before the workers start; they check again)."""
    from protocol_models import DEVICE_TYPE, corpus, cpu_shim, data

    cpu_shim.check_device(config.hardware.device, DEVICE_TYPE)
    pending = data.bundled_data_pending(config)
    parts = {}
    for side in ["train", "validation"] if config.validator.enable else ["train"]:
        if not (pending and data.is_bundled(config.dataloader, side)):
            parts[side] = corpus.part_of(config.dataloader, side)
            corpus.check_readable(parts[side])
    if len(parts) == 2:
        corpus.check_disjoint(parts["train"], parts["validation"])
    if not (pending and data.is_bundled_path(config.hf_assets_path)):
        _check_tokenizer(config)
    _check_writable(config.dump_folder)
    _check_resumable(config)
    if config.dataloader.hf_dataset and "LOCAL_RANK" not in os.environ:
        corpus.check_hub_dataset(config.dataloader.hf_dataset)


def _check_tokenizer(config: ProtocolTrainer.Config) -> None:
    """``hf_assets_path`` holds a ``tokenizer.json`` whose vocabulary fits ``model.vocab_size``;
    when it is missing, the error names the command that fetches it."""
    path = config.hf_assets_path
    tokenizer_json = Path(path) / "tokenizer.json"
    if not tokenizer_json.is_file():
        repo = config.hf_assets_repo or "REPO_ID"
        fetch = f"python -m protocol_models.assets {repo} --dest {path}"
        raise ConfigError(
            f"hf_assets_path = {path!r}: no tokenizer.json there; fetch it with: {fetch}"
            + ("" if config.hf_assets_repo else " (REPO_ID: the tokenizer's Hub repository)")
        )
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    except Exception as e:  # the tokenizers library's own words
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"hf_assets_path = {path!r}: {tokenizer_json} does not load: {reason}"
        ) from None
    _check(
        size <= config.model.vocab_size,
        f"model.vocab_size = {config.model.vocab_size}: smaller than the tokenizer's {size} "
        f"tokens ({tokenizer_json}); use model.vocab_size >= {size}",
    )
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    logging.disable(logging.WARNING)  # e.g. "no tokenizer_config.json": the check below says it
    try:
        eos = HuggingFaceTokenizer(tokenizer_path=path).eos_id
    finally:
        logging.disable(logging.NOTSET)
    _check(
        eos is not None,
        f"hf_assets_path = {path!r}: the tokenizer names no EOS token, so documents would run "
        f"together; name one as eos_token (and bos_token) in {Path(path, 'tokenizer_config.json')}",
    )


def _check_writable(dump_folder: str) -> None:
    """The nearest existing ancestor of ``dump_folder`` must be a directory we can write in
    (probed with a temporary file that is removed at once; nothing is left behind)."""
    import tempfile

    path = Path(dump_folder).absolute()
    ancestor = next(p for p in [path, *path.parents] if p.exists())
    try:
        _check(ancestor.is_dir(), f"dump_folder = {dump_folder!r}: {ancestor} is not a directory")
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as e:
        raise ConfigError(
            f"dump_folder = {dump_folder!r}: not writable ({e.strerror}: {ancestor})"
        ) from None


def _check_resumable(config: ProtocolTrainer.Config) -> None:
    """A checkpoint the run would load must hold this config's parameter shapes."""
    checkpoint = _checkpoint_to_load(config)
    if checkpoint is None:
        return
    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from protocol_models.model import build_model_config

    with torch.device("meta"):
        model = build_model_config(config.model, config.protocol, config.layout_stages).build()
    saved = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    for name, tensor in model.state_dict().items():
        _check(
            name in saved,
            f"checkpoint {checkpoint} does not hold parameter {name} of this model "
            "([model] or [protocol] differ from the run that wrote it)",
        )
        saved_shape = tuple(getattr(saved[name], "size", ()))
        _check(
            saved_shape == tuple(tensor.shape),
            f"checkpoint {checkpoint} was written by a different model: {name} is "
            f"{list(saved_shape)} there but {list(tensor.shape)} with this config "
            f"(protocol.k = {config.protocol.k}, model.dim = {config.model.dim}); "
            "resume with the settings that wrote it or use another dump_folder",
        )


def _checkpoint_to_load(config: ProtocolTrainer.Config) -> Path | None:
    """What TorchTitan's checkpointer would load at start: the newest complete ``step-N`` in
    the run's checkpoint folder, else ``checkpoint.initial_load_path``."""
    ckpt = config.checkpoint
    if not ckpt.enable or ckpt.create_seed_checkpoint:
        return None
    folder = Path(config.dump_folder) / ckpt.folder
    steps = sorted(
        (int(p.name.split("-")[1]), p)
        for p in folder.glob("step-*")
        if p.name.split("-")[1].isdigit() and (p / ".metadata").is_file()
    )
    if steps:
        return steps[-1][1]
    if ckpt.initial_load_path and (Path(ckpt.initial_load_path) / ".metadata").is_file():
        return Path(ckpt.initial_load_path)
    return None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def world_size(config: ProtocolTrainer.Config) -> int:
    """Processes the run needs: pipeline stages x data-parallel replicas/shards."""
    par = config.parallelism
    dp = par.data_parallel_replicate_degree * max(par.data_parallel_shard_degree, 1)
    return par.pipeline_parallel_degree * dp * par.tensor_parallel_degree


def split_argv(argv: list[str]) -> tuple[str | None, list[str]]:
    """Pull ``--toml FILE`` out of ``argv``; the rest are overrides."""
    rest, toml_path, i = [], None, 0
    while i < len(argv):
        if argv[i] == "--toml" and i + 1 < len(argv):
            toml_path, i = argv[i + 1], i + 2
        elif argv[i].startswith("--toml="):
            toml_path, i = argv[i].split("=", 1)[1], i + 1
        else:
            rest.append(argv[i])
            i += 1
    return toml_path, rest


def main(argv: list[str] | None = None) -> int:
    """Check a config. On success print ``nproc=<N>`` (processes the run needs),
    ``device=<cuda|cpu>`` and ``prepare_data=<0|1>`` (whether ``python -m protocol_models.data``
    has work to do before the workers start: the bundled data or a map-style corpus to
    tokenize); on failure print one ``error:`` line to stderr and return 2."""
    from protocol_models import data

    toml_path, overrides = split_argv(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(toml_path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"nproc={world_size(config)}")
    print(f"device={config.hardware.device}")
    prepare = not config.dataloader.streaming or data.bundled_data_pending(config)
    print(f"prepare_data={int(prepare)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
