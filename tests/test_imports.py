"""The package's import graph: no cycles (function-level and type-checking imports included), and
the model knows nothing of the wire."""

from __future__ import annotations

import ast

from conftest import REPO

PACKAGE = REPO / "protocol_models"


def module_imports() -> dict[str, set[str]]:
    """Every plugin module -> the plugin modules it imports anywhere in its source."""
    files = {
        ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__"): p
        for p in PACKAGE.rglob("*.py")
    }
    graph = {}
    for name, path in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PACKAGE.name):
                deps.add(node.module)
                deps |= {f"{node.module}.{a.name}" for a in node.names} & files.keys()
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith(PACKAGE.name)}
        graph[name] = deps & files.keys() - {name, PACKAGE.name}
    return graph


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
    assert not {m for m in module_imports()["protocol_models.model"] if ".wire" in m}
