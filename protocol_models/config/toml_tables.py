"""TOML tables -> config dataclasses: reading files (with ``base``) and ``--section.key value``
overrides into one table, then assigning it onto dataclass fields with type coercion.

Every problem is a ``ConfigError`` of one line naming the key and what is allowed. Which tables
exist and what they mean is ``protocol_models.config``'s business; this module knows only TOML,
dataclasses and the one layering rule of ``[dataloader]`` corpora.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import tomli

from protocol_models.tools import ranges
from protocol_models.tools.errors import ConfigError

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
    "persistent_workers",
    "prefetch_factor",
    "trace_post_processor",
}
"""Container fields TOML does not set (the dataloader's ``dataset``/``dataset_path`` are
TorchTitan's registry names, unused here; ``split`` is set on the validator's copy;
``persistent_workers``/``prefetch_factor`` configure loader worker processes, which
``dataloader.num_workers = 0`` never starts; the profiler's ``trace_post_processor`` is a
Python function)."""
CORPUS_KEYS = ("files", "hf_dataset")
CORPUS_DESCRIPTION = (
    *CORPUS_KEYS,
    *("hf_config", "hf_split", "text_field", "sample_by", "streaming"),
    *("validation_files", "validation_split", "validation_fraction"),
)
"""``[dataloader]`` keys that describe one corpus (the rest say where and how to tokenize)."""


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
    if not isinstance(loader, dict) or not set(CORPUS_KEYS) & layer_keys:
        return
    for key in CORPUS_DESCRIPTION:
        loader.pop(key, None)


def _merge(into: dict, table: dict) -> None:
    for key, value in table.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


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


def usage_asked(argv: list[str], usage: str) -> bool:
    """Whether ``argv`` asks for help (``-h`` or ``--help`` anywhere); then ``usage`` (the
    command's usage and what it does) is printed to stdout first, and the caller exits 0."""
    if not {"-h", "--help"} & set(argv):
        return False
    print(usage.strip())
    return True


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


def expect_table(value: Any, key: str) -> dict:
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


def assign(obj: Any, table: dict, prefix: str, also_allowed: tuple[str, ...] = ()) -> None:
    """Set ``obj``'s dataclass fields from ``table``, recursing into sub-tables (an unknown key's
    error lists the fields and ``also_allowed``, keys the caller handles itself)."""
    types_ = _field_types(obj)
    for key, value in table.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in types_:
            what = "table" if isinstance(value, dict) else "key"
            where = f"[{prefix}]" if prefix else "the top level"
            allowed = sorted([*types_, *also_allowed])
            raise ConfigError(f"unknown {what} '{name}' (allowed in {where}: {allowed})")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            assign(current, expect_table(value, name), name)
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


def rerun_post_init(obj: Any, prefix: str, tables: Mapping[str, ranges.Ranges]) -> None:
    """Re-run the dataclasses' own validation on the assembled config, as one-line errors: each
    table's declared ranges (``protocol_models.tools.ranges``: its class's ``RANGES``, else
    ``tables[table]``), then its ``__post_init__``."""
    for f in dataclasses.fields(obj):
        child = getattr(obj, f.name)
        if dataclasses.is_dataclass(child) and not isinstance(child, type):
            rerun_post_init(child, f"{prefix}.{f.name}" if prefix else f.name, tables)
    ranges.check(obj, prefix, tables)
    post_init = getattr(obj, "__post_init__", None)
    if post_init is not None:
        try:
            post_init()
        except (ValueError, AssertionError) as e:
            message = str(e).replace("\n", " ")
            named = not prefix or message.startswith(f"{prefix}.")  # names its key already
            raise ConfigError(message if named else f"[{prefix}] {message}") from None


def read_layers(toml_path: str | None, overrides: list[str]) -> dict[str, Any]:
    """The run's table: the TOML file (over its ``base``), then the overrides over it."""
    table = read_toml(Path(toml_path)) if toml_path is not None else {}
    pairs = parse_overrides(overrides)
    loader_keys = {key.split(".", 1)[1] for key, _ in pairs if key.startswith("dataloader.")}
    _replace_corpus(table, loader_keys)
    for key, value in pairs:
        _set_path(table, key.split("."), value)
    return table
