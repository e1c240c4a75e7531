"""What each GPU node checks before any worker starts, tested on the CPU.

Flex attention on a 99 KB-shared-memory GPU (the L4), with faked device properties: Inductor's
default flex kernel does not fit there, so a run whose flex kernels are built without
max-autotune and without pinned tiles is refused. And the SLURM scripts, with stand-ins for
``scontrol`` and ``srun``: every node needs the checkout and its ``.venv`` at the same path, with
the same code."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import pytest
from conftest import REPO, TINY, fake_commands
from torchtitan.models.common.attention import FlexAttention

from protocol_models.config import preflight
from protocol_models.config.preflight import (
    SMALL_SHARED_MEMORY,
    check_flex_shared_memory,
    flex_kernel_options,
)
from protocol_models.config.run_config import ConfigError, load_config

L4 = SimpleNamespace(name="NVIDIA L4", shared_memory_per_block_optin=101376)
A100 = SimpleNamespace(name="NVIDIA A100-SXM4-80GB", shared_memory_per_block_optin=167936)
FLEX_ON_CUDA = ["--model.attention", "flex", "--hardware.device", "cuda"]
COMPILED = ["--compile.enable", "true"]  # components ["model", "loss"], backend "inductor"


def _config(*overrides: str):
    return load_config(str(TINY), [*FLEX_ON_CUDA, *overrides], check_environment=False)


def _unprobed():
    raise AssertionError("the settings alone rule the failure out: no GPU probe needed")


def _refusal(config, gpus, env=None) -> str:
    with pytest.raises(ConfigError) as err:
        check_flex_shared_memory(config, env or {}, lambda: gpus)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_blocks_compiled_without_max_autotune_are_refused_on_an_l4():
    """``[compile]`` on the model at backend ``inductor`` lowers flex inside each block at
    Inductor's defaults: refused on the L4 (one line naming the key, the card and the fixes),
    accepted on an A100 and with ``TORCHINDUCTOR_MAX_AUTOTUNE=1``."""
    config = _config(*COMPILED)
    message = _refusal(config, [L4])
    assert message.startswith('model.attention = "flex": compile.enable = true')
    assert "TORCHINDUCTOR_MAX_AUTOTUNE unset" in message
    assert "GPU 0 (NVIDIA L4: 101376 bytes)" in message
    assert "set TORCHINDUCTOR_MAX_AUTOTUNE=1 on every node" in message
    assert 'compile.backend = "aot_eager"' in message
    assert "GPU 1 (NVIDIA L4" in _refusal(config, [A100, L4])
    assert "= '0'" in _refusal(config, [L4], {"TORCHINDUCTOR_MAX_AUTOTUNE": "0"})
    check_flex_shared_memory(config, {}, lambda: [A100, A100])
    check_flex_shared_memory(config, {"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}, _unprobed)
    assert L4.shared_memory_per_block_optin == SMALL_SHARED_MEMORY  # the limit is refused


@pytest.mark.parametrize(
    "overrides",
    [
        [],  # no [compile]: TorchTitan compiles flex alone, at max-autotune
        [*COMPILED, "--compile.backend", "aot_eager"],  # flex: an Inductor region, max-autotune
        [*COMPILED, "--compile.components", '["loss"]'],  # the blocks are not compiled
        [*COMPILED, "--model.attention", "sdpa"],
        [*COMPILED, "--hardware.device", "cpu"],
    ],
)
def test_settings_that_keep_flex_at_max_autotune_are_accepted(overrides):
    check_flex_shared_memory(_config(*overrides), {}, _unprobed)


def test_torchtitan_without_max_autotune_needs_pinned_tiles(monkeypatch):
    """TorchTitan's own flex compile with ``max_autotune`` off (its comment's advice once
    ``kernel_options`` are known) is refused on the L4 unless every block pins the forward
    kernel's tiles (``BLOCK_M``, ``BLOCK_N``, ``num_stages``, bare or ``fwd_``)."""
    monkeypatch.setitem(FlexAttention.inductor_configs, "max_autotune", False)
    config = _config()
    message = _refusal(config, [L4])
    assert "TorchTitan's FlexAttention.inductor_configs has max_autotune off" in message
    assert "BLOCK_M = 128, BLOCK_N = 64, num_stages = 2, num_warps = 8" in message
    assert flex_kernel_options(config) == [{}] * 4  # the plugin pins none: one per block
    pinned = [{"fwd_num_stages": 2, "fwd_num_warps": 8}] * 4
    monkeypatch.setattr(preflight, "flex_kernel_options", lambda config: pinned)
    check_flex_shared_memory(config, {}, _unprobed)
    monkeypatch.setattr(preflight, "flex_kernel_options", lambda config: [{"num_warps": 4}] * 4)
    _refusal(config, [L4])  # warps alone leave the default tiles


def test_the_config_check_runs_it(monkeypatch, tmp_path):
    """``validate_environment`` (the config check on each node, before the workers) calls it
    with this machine's GPUs."""
    from protocol_models.tools import cpu_shim

    monkeypatch.setattr(cpu_shim, "check_device", lambda requested, bound: None)
    monkeypatch.setattr(preflight, "visible_gpus", lambda: [L4])
    monkeypatch.delenv("TORCHINDUCTOR_MAX_AUTOTUNE", raising=False)
    args = [*FLEX_ON_CUDA, *COMPILED, "--dump_folder", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=r"GPU 0 \(NVIDIA L4: 101376 bytes\)"):
        load_config(str(TINY), args)


def test_flex_inside_an_inductor_compiled_block_loses_max_autotune():
    """The premise of ``flex_max_autotune``, on Inductor-CPU (whose flex lowering reads the same
    ``max_autotune`` setting): TorchTitan's own flex compile lowers at max-autotune, but inside an
    outer ``torch.compile`` (backend ``inductor``, as ``[compile]`` compiles each block) at the
    outer compile's settings, max-autotune only with ``TORCHINDUCTOR_MAX_AUTOTUNE=1``."""
    probe = """
import torch, torch._inductor.config as inductor
import torch._inductor.kernel.flex.flex_attention as lowering
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask
from torchtitan.models.common.attention import FlexAttention
seen, lower_cpu = [], lowering.lower_cpu
def spy(*args, **kwargs):
    seen.append(inductor.max_autotune)
    return lower_cpu(*args, **kwargs)
lowering.lower_cpu = spy
q = torch.randn(1, 2, 128, 16)
mask = create_block_mask(lambda b, h, q, kv: q >= kv, 1, 1, 128, 128, device="cpu")
def flex(q):
    return FlexAttention.compiled_flex_attn(q, q, q, score_mod=None, block_mask=mask,
        scale=None, enable_gqa=False, return_aux=AuxRequest(), kernel_options={})[0]
import sys
if sys.argv[1:] == ["alone"]:
    flex(q)
torch.compile(flex, backend="inductor", fullgraph=True)(q)
print(seen)
"""
    env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}  # lower, not load
    env.pop("TORCHINDUCTOR_MAX_AUTOTUNE", None)
    for extra, args, seen in [({}, ["alone"], "[True, False]"),
                              ({"TORCHINDUCTOR_MAX_AUTOTUNE": "1"}, [], "[True]")]:  # fmt: skip
        result = subprocess.run(
            [sys.executable, "-c", probe, *args], env={**env, **extra},
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert result.stdout.strip().splitlines()[-1:] == [seen], result.stderr[-2000:]


def test_slurm_nodes_need_the_checkout_at_the_same_path(tmp_path):
    """``scripts/slurm/train_nodes.sh`` (through ``llama3_2b_l4.sbatch``) on 3 stand-in nodes,
    where ``srun`` runs each node's task with ``ROOT_ON_<node>`` as that node's view of the
    checkout's path: a node without the checkout, without its ``.venv`` or with other code stops
    the job with one line naming the node and the path; a copy of the same code passes."""
    bin_dir = fake_commands(tmp_path / "bin", {
        "scontrol": 'tr , "\\n" <<<"$3"',  # scontrol show hostnames n1,n2,...
        "srun": 'while [[ $1 == --* ]]; do shift; done\n'
        'for h in ${SLURM_JOB_NODELIST//,/ }; do root="ROOT_ON_$h"\n'
        '  PM_CHECKOUT_ROOT="${!root:-$PM_CHECKOUT_ROOT}" SLURMD_NODENAME=$h "$@" || exit; done',
        "python": 'if [ "$2" = protocol_models.config ]; then printf "nproc=3\\ndevice=cuda\\n"; exit; fi\n'
        'echo "$SLURMD_NODENAME launched in $PWD"',
    })  # fmt: skip
    copy = tmp_path / "copy"  # another node's checkout: the code, and a .venv with a python
    for part in ("protocol_models", "scripts", "configs"):
        shutil.copytree(REPO / part, copy / part, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", copy)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHON": str(bin_dir / "python"),
           "SLURM_JOB_NODELIST": "n1,n2,n3", "SLURM_NNODES": "3", "SLURM_SUBMIT_DIR": str(REPO),
           "SLURMD_NODENAME": "n1"}  # fmt: skip

    def sbatch(**extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["bash", "scripts/slurm/llama3_2b_l4.sbatch"],
            cwd=REPO, env={**env, **extra}, capture_output=True, text=True, timeout=60,
        )  # fmt: skip

    def refused(node: str, **extra: str) -> str:
        """The one line the job ends with; ``node`` launched nothing (the stand-in ``srun``
        runs the nodes in turn: a real one runs them at once and kills the rest)."""
        result = sbatch(**extra)
        assert result.returncode == 2 and f"{node} launched" not in result.stdout, result.stdout
        return result.stderr.strip()

    result = sbatch(ROOT_ON_n2=str(copy))  # the same code, as every node should have it
    assert result.returncode == 0, result.stderr
    assert f"n2 launched in {copy}" in result.stdout and f"n3 launched in {REPO}" in result.stdout
    assert refused("n2", ROOT_ON_n2=str(tmp_path / "elsewhere")) == (
        f"error: node n2: no checkout of this repository at {tmp_path / 'elsewhere'}; every node "
        "needs it (with its .venv) at the same path as n1, where the job runs"
    )
    assert refused("n1", ROOT_ON_n1=str(copy), PYTHON=".venv/bin/python") == (
        f"error: node n1: no .venv/bin/python in {copy} (PYTHON); every node needs the .venv at "
        f"the same path as n1: run `source scripts/env.sh` in {copy} on n1 once"
    )
    with open(copy / "protocol_models" / "__init__.py", "a") as f:
        f.write("# edited on n2 only\n")
    line = refused("n2", ROOT_ON_n2=str(copy))
    assert line.startswith(f"error: node n2: the checkout at {copy} differs from n1's (")
    assert line.endswith("there); put the same code at that path on every node")


def test_train_sh_without_its_python_is_one_line():
    """``scripts/train.sh`` on a node whose checkout has no ``.venv`` (``PYTHON``) yet."""
    result = subprocess.run(
        ["bash", "scripts/train.sh", str(TINY)], cwd=REPO, capture_output=True, text=True,
        env={**os.environ, "PYTHON": ".venv/bin/nosuch", "NNODES": "2"}, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and not result.stdout
    assert result.stderr.startswith(f"error: PYTHON = .venv/bin/nosuch: no such program in {REPO} ")
    assert result.stderr.endswith(", on every node: each needs the checkout and its .venv\n")
    assert result.stderr.count("\n") == 1
