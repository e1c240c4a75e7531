"""Every numeric and enumerated key a TOML file can set has a declared range (``ranges``), and the
config check refuses a value outside it in one line naming the key, the value and what is allowed.

The schema is walked as the TOML layer walks it (``toml_tables._field_types``), so a key added
later -- to a plugin table or by a TorchTitan upgrade -- fails ``test_every_key_is_declared`` until
it gets a declaration (or, a free-text string, a place in ``FREE_TEXT``)."""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Literal

import pytest
from conftest import TINY, config_error

from protocol_models.config.run_config import default_config, load_config
from protocol_models.config.toml_tables import _field_types
from protocol_models.config.torchtitan_ranges import TORCHTITAN_RANGES
from protocol_models.tools import ranges
from protocol_models.tools.ranges import Declaration, OneOf, Range
from protocol_models.training.optimizers import OptimizerSettings

FREE_TEXT = {
    *("hf_assets_path", "dump_folder", "hf_assets_repo"),
    *("profiler.save_traces_folder", "profiler.save_memory_snapshot_folder"),
    *("metrics.save_tb_folder", "metrics.wandb_project", "metrics.wandb_entity"),
    *("metrics.wandb_run_name", "metrics.wandb_group", "metrics.wandb_tags"),
    "metrics.sample_prompts",
    *("dataloader.files", "dataloader.hf_dataset", "dataloader.hf_config", "dataloader.hf_split"),
    *("dataloader.text_field", "dataloader.validation_files", "dataloader.validation_split"),
    "dataloader.cache_dir",
    *("parallelism.module_fqns_per_model_part", "parallelism.pipeline_parallel_schedule_csv"),
    "parallelism.context_parallel_ptrr_mask_key",
    *("checkpoint.folder", "checkpoint.initial_load_path", "protocol.basis_file"),
    *("comm.save_traces_folder", "comm.save_traces_file_prefix", "debug.save_config_file"),
}
"""String keys that hold paths, names, prompts or tags: any text is meant. Every other string key
is enumerated and needs a declaration."""
DERIVED = {"validator.dataloader"}
"""Tables the TOML layer refuses (set from ``[dataloader]``)."""


@dataclasses.dataclass(frozen=True)
class Key:
    """One user-settable key: its dotted name, table, field name and type."""

    name: str
    table: str
    field: str
    tp: Any


def schema() -> list[Key]:
    """Every key of the default config's tables, and ``[optimizer]``'s."""
    keys: list[Key] = []

    def walk(obj: Any, table: str) -> None:
        for name, tp in _field_types(obj).items():
            dotted = f"{table}.{name}" if table else name
            value = getattr(obj, name)
            if dataclasses.is_dataclass(value):
                if dotted not in DERIVED:
                    walk(value, dotted)
            else:
                keys.append(Key(dotted, table, name, tp))

    walk(default_config(), "")
    walk(OptimizerSettings(), "optimizer")
    return keys


def _table_object(table: str) -> Any:
    """A fresh default object of TOML table ``table``."""
    if table == "optimizer":
        return OptimizerSettings()
    obj = default_config()
    for part in table.split(".") if table else []:
        obj = getattr(obj, part)
    return obj


def kind(tp: Any) -> str:
    """``bool``, ``literal`` (the type declares the set), ``number``, ``text`` or ``other``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        kinds = {kind(a) for a in args if a is not type(None)}
        return kinds.pop() if len(kinds) == 1 else "other"
    if origin is list:
        return kind(args[0])
    if origin is Literal:
        return "literal"
    return {bool: "bool", int: "number", float: "number", str: "text"}.get(tp, "other")


def declared(key: Key) -> Declaration | None:
    return ranges.declarations(_table_object(key.table), key.table, TORCHTITAN_RANGES).get(
        key.field
    )


def missing_declarations() -> list[str]:
    """Keys whose classification is wrong: a number or enumerated string without a declaration,
    a declaration next to a ``Literal`` type or a free-text key, an unclassifiable type, and
    declarations or free-text entries of keys that do not exist."""
    problems, names = [], set()
    for key in schema():
        names.add(key.name)
        what, declaration = kind(key.tp), declared(key)
        if what == "other":
            problems.append(f"{key.name}: unclassified type {key.tp}")
        elif what in ("bool", "literal") or key.name in FREE_TEXT:
            if declaration is not None:
                problems.append(f"{key.name}: declared, but its type or FREE_TEXT says it all")
        elif declaration is None:
            problems.append(f"{key.name}: no declared range")
    tables = {key.table for key in schema()}
    for table in tables:
        for field in ranges.declarations(_table_object(table), table, TORCHTITAN_RANGES):
            if f"{table}.{field}" not in names:
                problems.append(f"{table}.{field}: declared, but no such key")
    problems += [f"{name}: in FREE_TEXT, but no such key" for name in FREE_TEXT - names]
    return problems


def outside(declaration: Declaration, tp: Any) -> list[Any]:
    """Values just outside ``declaration`` for a key of type ``tp`` (its entries' type for a
    list), non-finite numbers for a float key."""
    if isinstance(declaration, OneOf):
        allowed = declaration.allowed()
        if all(isinstance(a, str) for a in allowed):
            return ["not-a-choice"]
        return [v for v in (min(allowed) - 1, max(allowed) + 1) if v not in allowed]
    assert isinstance(declaration, Range)
    is_int = _number_type(tp) is int
    step = (lambda v, d: v + d) if is_int else (lambda v, d: math.nextafter(v, d * math.inf))
    candidates: list[float] = []
    for bound, direction, is_open in (
        (declaration.low, -1, declaration.low_open),
        (declaration.high, 1, declaration.high_open),
    ):
        if bound is not None:
            candidates.append(bound if is_open else step(bound, direction))
    candidates += [step(s, d) for s in declaration.also if math.isfinite(s) for d in (-1, 1)]
    if not is_int:
        candidates += [math.nan, math.inf, -math.inf]
    return [v for v in dict.fromkeys(candidates) if not declaration.allows(v)]


def boundaries(declaration: Declaration, tp: Any) -> list[Any]:
    """The values at the edges of ``declaration`` that must be accepted (every choice of a
    set)."""
    if isinstance(declaration, OneOf):
        return declaration.allowed()
    assert isinstance(declaration, Range)
    is_int = _number_type(tp) is int
    step = (lambda v, d: v + d) if is_int else (lambda v, d: math.nextafter(v, d * math.inf))
    values = list(declaration.also)
    for bound, inward, is_open in (
        (declaration.low, 1, declaration.low_open),
        (declaration.high, -1, declaration.high_open),
    ):
        if bound is not None:
            values.append(step(bound, inward) if is_open else bound)
    return [float(v) if not is_int else v for v in values]


def _number_type(tp: Any) -> type:
    """``int`` or ``float``: the number type a (possibly optional or list) key holds."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return _number_type(args[0])
    if args:
        return float if float in args else _number_type(args[0])
    return tp


def _literal(value: Any) -> str:
    """``value`` as a TOML literal for an override."""
    if isinstance(value, list):
        return f"[{', '.join(_literal(v) for v in value)}]"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return repr(value)


def _is_list(tp: Any) -> bool:
    """Whether a key of type ``tp`` (possibly optional) holds a list."""
    arms = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return len(arms) == 1 and _is_list(arms[0])
    return typing.get_origin(tp) is list


def _refusals() -> list[tuple[str, Any, str]]:
    """(key, out-of-range value, what the refusal must say) for every declared and every
    ``Literal`` key."""
    cases = []
    for key in schema():
        what, declaration, is_list = kind(key.tp), declared(key), _is_list(key.tp)
        if declaration is not None:
            for bad in outside(declaration, key.tp):
                allowed = declaration.describe(bad, entries=is_list)
                cases.append((key.name, [bad] if is_list else bad, allowed))
        elif what == "literal":
            choices = [a for a in typing.get_args(key.tp) if a is not type(None)]
            choices = [c for arm in choices for c in (typing.get_args(arm) or [arm])]
            bad = "not-a-choice" if isinstance(choices[0], str) else max(choices) + 1
            cases.append((key.name, bad, "expected one of"))
    return cases


def _accepted() -> list[tuple[str, Any]]:
    cases = []
    for key in schema():
        declaration = declared(key)
        if declaration is not None:
            for good in boundaries(declaration, key.tp):
                cases.append((key.name, [good] if _is_list(key.tp) else good))
    return cases


def test_every_key_is_declared():
    assert missing_declarations() == []


@pytest.mark.parametrize(
    ("table", "key"),
    [("training", "steps"), ("optimizer", "lr"), ("parallelism", "pipeline_parallel_schedule")],
)
def test_a_key_without_a_declaration_fails_the_completeness_check(monkeypatch, table, key):
    where = OptimizerSettings.RANGES if table == "optimizer" else TORCHTITAN_RANGES[table]
    monkeypatch.delitem(where, key)
    assert f"{table}.{key}: no declared range" in missing_declarations()


def test_a_string_key_must_be_classified(monkeypatch):
    monkeypatch.setitem(globals(), "FREE_TEXT", FREE_TEXT - {"dump_folder"})
    assert "dump_folder: no declared range" in missing_declarations()


@pytest.mark.parametrize(("key", "value", "allowed"), _refusals(), ids=repr)
def test_out_of_range_is_refused_in_one_line(key, value, allowed):
    message = config_error(f"--{key}", _literal(value))
    assert message.startswith(f"{key} = ") and allowed in message, message


def test_a_refusal_of_two_lines_fails_the_check(monkeypatch):
    def two_lines(self, bad, *, entries=False):
        return "must be > 0\n(and more)"

    monkeypatch.setattr(Range, "describe", two_lines)
    with pytest.raises(AssertionError):
        test_out_of_range_is_refused_in_one_line("optimizer.lr", -1.0, "")


@pytest.mark.parametrize(("key", "value"), _accepted(), ids=repr)
def test_boundary_values_are_accepted(key, value):
    """Checked against the key's own declaration: a value at the edge of its range may still
    break a rule that needs several keys (``model.dim = 1`` with four heads)."""
    table, _, field = key.rpartition(".")
    obj = _table_object(table)
    setattr(obj, field, value)
    ranges.check(obj, table, TORCHTITAN_RANGES)


def test_a_boundary_value_passes_the_whole_check():
    config = load_config(
        str(TINY),
        ["--optimizer.lr", "5e-324", "--optimizer.betas", "[0.0, 0.9999999999999999]",
         "--lr_scheduler.warmup_steps", "0", "--training.max_norm", "inf",
         "--checkpoint.keep_latest_k", "0", "--parallelism.data_parallel_shard_degree", "-1"],
        check_environment=False,
    )  # fmt: skip
    assert config.training.max_norm == math.inf


def test_activation_checkpoint_is_enumerated():
    assert "expected one of ['none', 'selective', 'full']" in config_error(
        "--activation_checkpoint", "partial"
    )
    for choice in ("none", "selective", "full"):
        load_config(str(TINY), ["--activation_checkpoint", choice], check_environment=False)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--optimizer.lr", "-1.0"], "optimizer.lr = -1.0: must be > 0"),
        (["--optimizer.lr", "inf"], "optimizer.lr = inf: must be a finite number > 0"),
        (["--optimizer.betas", "[0.9, 1.0]"],
         "optimizer.betas = [0.9, 1.0]: every entry must be in [0, 1)"),
        (["--checkpoint.keep_latest_k", "1"],
         "checkpoint.keep_latest_k = 1: must be 0 or >= 2 (0 = keep every checkpoint)"),
        (["--training.global_batch_size", "0"],
         "training.global_batch_size = 0: must be -1 or >= 1 (-1 = local_batch_size x the "
         "data-parallel degree)"),
        (["--training.max_norm", "0"],
         "training.max_norm = 0.0: must be > 0 or inf (inf = no clipping)"),
        (["--compile.components", '["model", "optimizer"]'],
         "compile.components = ['model', 'optimizer']: every entry must be one of "
         "['model', 'loss']"),
    ],
)  # fmt: skip
def test_refusals_say_what_is_allowed(overrides, message):
    assert config_error(*overrides) == message
