"""The plugin against the TorchTitan and torch it is pinned to: every private dependency holds
(``protocol_models.tools.private_api``), and the plugin patches nothing in them: importing the
package rebinds no attribute of theirs, and the package's source assigns to another package's
attribute only in its one explicit opt-in at launch (the CPU binding)."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

from conftest import REPO

from protocol_models.tools import private_api

PACKAGE = REPO / "protocol_models"
OPT_INS = {
    ("tools/cpu_shim.py", "titan_utils.device_type"),  # a CPU worker's binding (install)
    ("tools/cpu_shim.py", "titan_utils.device_module"),
}
"""The assignments to another package's attributes the package may make: each runs only when
the launch asks for it (``cpu_shim.install``), never on import."""


def test_every_private_dependency_holds():
    """``python -m protocol_models.tools.private_api``: nothing the plugin relies on moved."""
    result = subprocess.run([sys.executable, "-m", "protocol_models.tools.private_api"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nothing moved" in result.stdout


def test_the_check_names_what_moved(monkeypatch):
    """A release that removes a listed symbol or changes its signature fails the check, with
    one line per symbol naming what moved and where the plugin uses it."""
    from torch.distributed.pipelining.stage import PipelineStage
    from torchtitan.trainer import Trainer

    monkeypatch.delattr(Trainer, "forward_backward_step")
    monkeypatch.setattr(PipelineStage, "forward_one_chunk",
                        lambda self, fwd_chunk_id, args, kwargs=None: None)  # fmt: skip
    found = [p for d in private_api.DEPENDENCIES for p in private_api.check(d)]
    assert len(found) == 2, found
    gone, changed = found
    assert gone.startswith("torchtitan.trainer:Trainer.forward_backward_step: gone (")
    assert gone.endswith("used by training/trainer.py ProtocolTrainer (overrides)")
    assert changed == (
        "torch.distributed.pipelining.stage:PipelineStage.forward_one_chunk: parameters "
        "('self', 'fwd_chunk_id', 'args', 'kwargs'), the plugin relies on ('self', "
        "'fwd_chunk_id', 'args', 'kwargs', 'save_forward_output'); used by wire/stage.py "
        "WirePipelineStage (overrides)"
    )


def test_importing_the_package_changes_nothing_in_torch_or_torchtitan():
    """Every module of the package imported in a fresh interpreter leaves every attribute of
    torch's and TorchTitan's imported modules as it was; the same check sees a planted
    replacement of ``clip_grad_norm_`` (what the plugin once did for each step)."""
    script = str(REPO / "tests" / "import_purity.py")
    clean, planted = (subprocess.run([sys.executable, script, *extra], cwd=REPO,
                                     capture_output=True, text=True, timeout=300)
                      for extra in ([], ["--plant"]))  # fmt: skip
    assert clean.returncode == 0 and clean.stdout == "", clean.stdout + clean.stderr
    assert planted.stdout.splitlines() == ["torchtitan.distributed.utils.clip_grad_norm_ rebound"]


def _foreign_names(tree: ast.Module) -> set[str]:
    """Names a module binds by importing from another package than ``protocol_models``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("protocol_models"):
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            if not (node.module or "").startswith("protocol_models"):
                names.update(alias.asname or alias.name for alias in node.names)
    return names


def foreign_assignments(package: Path = PACKAGE) -> set[tuple[str, str]]:
    """``(file, target)`` for every assignment (or ``setattr``) in the package's source to an
    attribute of something imported from another package."""
    found = set()
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text())
        foreign = _foreign_names(tree)
        where = str(path.relative_to(package))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = list(node.targets)
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            while targets:
                target = targets.pop()
                if isinstance(target, ast.Tuple | ast.List | ast.Starred):
                    targets.extend(target.elts if not isinstance(target, ast.Starred)
                                   else [target.value])  # fmt: skip
                elif (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                        and target.value.id in foreign):  # fmt: skip
                    found.add((where, f"{target.value.id}.{target.attr}"))
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "setattr" and isinstance(node.args[0], ast.Name)
                    and node.args[0].id in foreign):  # fmt: skip
                found.add((where, f"{node.args[0].id}.<setattr>"))
    return found


def test_no_assignment_to_another_packages_attributes():
    """The package's source assigns to attributes of what it imports from torch, TorchTitan or
    any other package only in its explicit opt-ins (``OPT_INS``); the scan finds a planted
    one."""
    assert foreign_assignments() == OPT_INS
    assert importlib.util.find_spec("torchtitan") is not None


def test_the_scan_finds_a_planted_patch(tmp_path):
    """Plain, ``setattr`` and tuple assignments to an imported module's attribute are found; a
    subscript assignment inside one (``os.environ[...] = ...``) is not a patch."""
    (tmp_path / "patch.py").write_text(
        "import time\nfrom torchtitan import trainer as t\n\n\ndef f():\n"
        "    t.time = time\n    setattr(time, 'sleep', None)\n    a, t.b = 1, 2\n"
        "    t.c[0] = 3\n"
    )
    assert foreign_assignments(tmp_path) == {
        ("patch.py", "t.time"), ("patch.py", "time.<setattr>"), ("patch.py", "t.b")
    }  # fmt: skip


OBJECT_COLLECTIVES = ("all_gather_object", "gather_object", "broadcast_object_list",
                      "scatter_object_list", "send_object_list", "recv_object_list")  # fmt: skip
"""torch's collectives that unpickle what other ranks send."""


def test_the_plugin_exchanges_no_pickles():
    """No module of the package calls one of torch's object collectives: its own exchanges of
    small values are JSON in byte tensors (``tools.gather``), so a port reached from outside
    cannot make a worker unpickle code through them."""
    calls = [
        f"{path.relative_to(PACKAGE)}:{node.lineno} {node.func.attr}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr in OBJECT_COLLECTIVES
    ]  # fmt: skip
    assert calls == []
