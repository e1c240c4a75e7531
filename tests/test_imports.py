"""The package's import graph: no cycles (function-level and type-checking imports included), the
model knows nothing of the wire, and every import runs down the layers of ``LAYERS``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE = REPO / "protocol_models"

LAYERS = {
    "tools": set(),
    "model": {"tools"},
    "data": {"tools"},
    "wire": {"tools", "model"},
    "training": {"tools", "model", "data", "wire"},
    "config": {"tools", "model", "data", "wire", "training"},
    "hf": {"tools", "model", "data", "wire", "training", "config"},
    "cluster": {"tools", "model", "data", "wire", "training", "config"},
}
"""Subpackage -> the subpackages its modules may import (besides its own modules and the package
root, which holds nothing but its docstring). The user commands (the modules beside ``__init__`` and a
subpackage's ``__main__``) may import every subpackage, but no other command."""

ANNOTATION_ONLY = {("protocol_models.model.model", "protocol_models.training.protocol")}
"""Imports against the layers allowed for annotations only (under ``if TYPE_CHECKING:``):
``build_model_config`` takes the ``[protocol]`` table, which checks its mode against the wire's
registries and so lives above the model."""


def module_files(package: Path = PACKAGE) -> dict[str, Path]:
    """Every plugin module's dotted name -> its file."""
    return {
        ".".join(p.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): p
        for p in package.rglob("*.py")
    }


def imported(source: str, modules: set[str], *, annotation_only: bool = False) -> set[str]:
    """The plugin modules ``source`` imports anywhere (at any depth: functions, ``TYPE_CHECKING``);
    with ``annotation_only``, only those imported under ``if TYPE_CHECKING:``."""
    tree = ast.parse(source)
    if annotation_only:
        blocks = [n for n in ast.walk(tree) if isinstance(n, ast.If)
                  and ast.unparse(n.test).endswith("TYPE_CHECKING")]  # fmt: skip
        nodes = [n for block in blocks for stmt in block.body for n in ast.walk(stmt)]
    else:
        nodes = list(ast.walk(tree))
    deps = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE.name):
            deps.add(node.module)
            deps |= {f"{node.module}.{a.name}" for a in node.names} & modules
        elif isinstance(node, ast.Import):
            deps |= {a.name for a in node.names if a.name.startswith(PACKAGE.name)}
    return deps & modules


def module_imports(files: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """Every plugin module -> the plugin modules it imports anywhere in its source."""
    files = files or module_files()
    return {
        name: imported(path.read_text(), set(files)) - {name, PACKAGE.name}
        for name, path in files.items()
    }


def layer(module: str) -> str:
    """A module's subpackage, or ``command`` for a user command. The package root imports only
    the CPU shim, as a module of ``tools`` would."""
    parts = module.split(".")
    if len(parts) == 1:
        return "tools"
    if parts[-1] == "__main__" or (PACKAGE / f"{parts[1]}.py").is_file():
        return "command"
    return parts[1]


def against_the_layers(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Every import ``(module, dependency)`` the layers do not allow."""
    wrong = []
    for module, deps in graph.items():
        for dep in deps:
            own, theirs = layer(module), layer(dep)
            allowed = (
                theirs == own != "command"
                or (own == "command" and theirs != "command")
                or theirs in LAYERS.get(own, ())
            )
            if not allowed and (module, dep) not in ANNOTATION_ONLY:
                wrong.append((module, dep))
    return sorted(wrong)


def test_no_import_cycles():
    graph, state, cycles = module_imports(), {}, []

    def visit(module: str, path: list[str]) -> None:
        state[module] = "open"
        for dep in sorted(graph[module]):
            if state.get(dep) == "open":
                cycles.append([*path[path.index(dep) :], dep])
            elif dep not in state:
                visit(dep, [*path, dep])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles


def test_the_model_does_not_import_the_wire():
    graph = module_imports()
    assert not {m for name in graph if layer(name) == "model" for m in graph[name] if ".wire" in m}


def test_no_module_outside_a_subpackage_but_the_commands():
    top = {p.stem for p in PACKAGE.glob("*.py")} - {"__init__"}
    commands = {"assets", "emulate", "evaluate", "export", "generate", "gpu_check", "launch",
                "overlay", "pilot_basis", "plan", "prepare", "report", "shakespeare", "train"}  # fmt: skip
    assert top == commands
    assert {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(
        LAYERS
    )
    for command in top:  # each runs as ``python -m protocol_models.<name>``
        assert re.search(r'^if __name__ == "__main__":', (PACKAGE / f"{command}.py").read_text(),
                         re.M), command  # fmt: skip


def test_imports_run_down_the_layers():
    assert not against_the_layers(module_imports())


def test_the_exceptions_are_annotations_and_still_needed():
    files = module_files()
    for module, dep in ANNOTATION_ONLY:
        assert dep in imported(files[module].read_text(), set(files), annotation_only=True)
        assert dep in module_imports()[module]


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("protocol_models.model.model", "from protocol_models.training.trainer import X"),
        ("protocol_models.model.subspace", "def f():\n    import protocol_models.wire.link\n"),
        ("protocol_models.wire.stage", "from protocol_models.training import metrics"),
        ("protocol_models.data.loader", "from protocol_models.model.model import X"),
        ("protocol_models.tools.errors", "from protocol_models.config.run_config import X"),
        ("protocol_models.training.trainer", "from protocol_models.hf.export import X"),
        ("protocol_models.plan", "from protocol_models.export import X"),
    ],
)
def test_a_deliberate_violation_is_caught(module, source):
    files = module_files()
    graph = module_imports()
    graph[module] = graph[module] | imported(source, set(files))
    assert against_the_layers(graph)


def test_the_module_map_follows_the_tree():
    """docs/architecture.md names every module once, at its path, and states ``LAYERS``."""
    doc = (REPO / "docs" / "architecture.md").read_text()
    mapped = re.findall(r"^\| `(protocol_models/[^`]+\.py)` \|", doc, re.M)
    assert sorted(mapped) == sorted(str(p.relative_to(REPO)) for p in PACKAGE.rglob("*.py"))
    stated = {}
    for subpackages, allowed in re.findall(r"^\| (`\w+/`(?:, `\w+/`)*) \| ([^|]+) \|$", doc, re.M):
        for sub in re.findall(r"`(\w+)/`", subpackages):
            stated[sub] = set(re.findall(r"`(\w+)`", allowed))
    assert stated == LAYERS
