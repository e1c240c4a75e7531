"""Declared ranges: what each numeric and enumerated TOML key allows, and the one-line refusal.

Every numeric key (``int``, ``float``, optional ones, lists of numbers) and every enumerated
string key a user can set has one declaration (a ``Range`` or a ``OneOf``), in one place per
TOML table:

* a table whose dataclass the plugin defines (``[model]``, ``[protocol]``, ``[optimizer]``,
  ``[codec]``, ``[wan]``, ``[transport]``, ``[hardware]``, ``[dataloader]``, ``[metrics]``,
  ``[checkpoint]``, ``[validator]``) declares all of its keys, inherited TorchTitan ones
  included, in the class's ``RANGES``;
* a table whose dataclass is TorchTitan's (``[training]``, ``[parallelism]``,
  ``[lr_scheduler]``, ``[comm]``, ``[profiler]``, ``[compile]``, ``[debug]``) is declared in
  ``protocol_models.config.torchtitan_ranges``, keyed by table and key.

A ``Literal`` type is its own declaration (``protocol_models.toml_tables`` refuses other values);
booleans and free text (paths, names, prompts) need none. ``toml_tables.rerun_post_init`` checks
each table's declarations before that table's own ``__post_init__`` rules; rules that need
several keys stay in ``protocol_models.config.validate``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from protocol_models.tools.errors import ConfigError


class Declaration(ABC):
    """What one key allows; a list-valued key allows a list whose every entry is allowed."""

    @abstractmethod
    def allows(self, value: Any) -> bool:
        """Whether ``value`` (one entry of a list-valued key) is allowed."""

    @abstractmethod
    def describe(self, bad: Any, *, entries: bool = False) -> str:
        """What is allowed, as the refusal of ``bad`` says it (``entries``: of a list's
        entries)."""

    def require(self, name: str, value: Any) -> None:
        """Raise a one-line ``ConfigError`` naming ``name`` unless ``value`` is allowed (None,
        the default of an optional key that TOML cannot write, always is)."""
        entries = isinstance(value, list)
        bad = [v for v in (value if entries else [value]) if v is not None and not self.allows(v)]
        if bad:
            raise ConfigError(f"{name} = {value!r}: {self.describe(bad[0], entries=entries)}")


@dataclass(frozen=True, slots=True)
class Range(Declaration):
    """Finite numbers from ``low`` to ``high`` (an end may be open or absent), plus the sentinel
    values in ``also`` (-1: infer, 0: off, inf: no limit), which ``note`` explains."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    also: tuple[float, ...] = ()
    note: str = ""

    def allows(self, value: Any) -> bool:
        if value in self.also:
            return True
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        high = self.high
        return high is None or (value < high if self.high_open else value <= high)

    def describe(self, bad: Any, *, entries: bool = False) -> str:
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            span = f"in {left}{_number(self.low)}, {_number(self.high)}{right}"
        elif self.low is not None:
            span = f"{'>' if self.low_open else '>='} {_number(self.low)}"
        else:
            span = f"{'<' if self.high_open else '<='} {_number(self.high)}"
        if not math.isfinite(bad):
            span = f"a finite number {span}"
        below = [_number(v) for v in self.also if self.low is not None and v < self.low]
        above = [_number(v) for v in self.also if self.low is None or v >= self.low]
        text = " or ".join([*below, span, *above])
        note = f" ({self.note})" if self.note else ""
        return f"{'every entry ' if entries else ''}must be {text}{note}"


@dataclass(frozen=True, slots=True)
class OneOf(Declaration):
    """Values from a set: a fixed one, or a registry read when checked (a callable returning
    it, or the registry itself), so plug-ins registered later count."""

    choices: Collection[Any] | Callable[[], Collection[Any]]
    note: str = ""

    def allowed(self) -> list[Any]:
        return list(self.choices() if callable(self.choices) else self.choices)

    def allows(self, value: Any) -> bool:
        return value in self.allowed()

    def describe(self, bad: Any, *, entries: bool = False) -> str:
        allowed = self.allowed()
        note = f" ({self.note})" if self.note else ""
        if entries:
            return f"every entry must be one of {allowed}{note}"
        if len(allowed) == 1:
            return f"must be {allowed[0]!r}{note}"
        return f"expected one of {allowed}{note}"


Ranges = Mapping[str, Declaration]
"""One table's declarations, by key."""


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"


AT_LEAST_0 = Range(low=0)
AT_LEAST_1 = Range(low=1)
POSITIVE = Range(low=0, low_open=True)
FRACTION = Range(low=0, high=1)
SEED = Range(low=0)
SECONDS = Range(low=1)
"""The commonest ranges, shared by the declarations."""


def declarations(obj: Any, table: str, tables: Mapping[str, Ranges]) -> Ranges:
    """The declarations of ``obj``'s table: its class's ``RANGES`` (a plugin settings class), or
    else ``tables[table]`` (TorchTitan's tables)."""
    own = getattr(type(obj), "RANGES", None)
    return own if own is not None else tables.get(table, {})


def check(obj: Any, table: str, tables: Mapping[str, Ranges]) -> None:
    """Refuse the first key of ``obj`` (the dataclass of TOML table ``table``) whose value its
    declaration does not allow, as one line naming the key, the value and what is allowed."""
    for key, declared in declarations(obj, table, tables).items():
        declared.require(f"{table}.{key}" if table else key, getattr(obj, key))
