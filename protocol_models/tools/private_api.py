"""Every TorchTitan and torch symbol the plugin relies on beyond their documented extension
points, in one list, and the check a version bump runs first.

    python -m protocol_models.tools.private_api    # one line per symbol that moved; exit 1 if any

The pins (``torchtitan==0.3.0``, torch 2.14) hide drift until someone bumps them; these are the
places where a new release can break the plugin without an import error. Each ``Dependency``
names a symbol (``module:Qualified.name``), where the plugin uses it, and what it relies on:
the parameter names of a function it calls or overrides (in order), the instance attributes a
class's own source assigns (``self.name = ...``) that the plugin reads, the fields of a config
dataclass it sets, or texts in a module's source (log lines the console filters). Besides the
list, every ``torchtitan`` import in the package must resolve (``import_problems``).
``tests/test_private_api.py`` runs the check and shows that it fails when a listed symbol is
removed or its signature changes.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Dependency:
    """One symbol of TorchTitan or torch and what the plugin relies on of it."""

    symbol: str
    """``module:Qualified.name`` (``module:`` alone: the module itself)."""
    used_by: str
    """The plugin's place that relies on it."""
    parameters: tuple[str, ...] | None = None
    """The callable's parameter names, in order (None: not checked)."""
    sets: tuple[str, ...] = ()
    """Attributes the class's source assigns on ``self`` that the plugin reads."""
    fields: tuple[str, ...] = ()
    """Fields of the config dataclass the plugin reads or sets."""
    texts: tuple[str, ...] = ()
    """Texts in the source of the symbol's module."""


def _signatures(module: str, owner: str, used_by: str, methods: dict[str, tuple[str, ...]]):
    return [Dependency(f"{module}:{owner}.{name}", used_by, params)
            for name, params in methods.items()]  # fmt: skip


TRAINER = "torchtitan.trainer"
STAGE = "torch.distributed.pipelining.stage"
SCHEDULES = "torch.distributed.pipelining.schedules"
CHECKPOINTER = "torchtitan.components.checkpointer.dcp"
METRICS = "torchtitan.components.metrics"
DIST_UTILS = "torchtitan.distributed.utils"

DEPENDENCIES: list[Dependency] = [
    Dependency("torchtitan.tools.utils:", "tools/cpu_shim.py install (a CPU worker rebinds them)",
               sets=(), texts=("device_type, device_module = get_device_info()",)),
    *_signatures(TRAINER, "Trainer", "training/trainer.py ProtocolTrainer (overrides)", {
        "train_step": ("self", "data_iterator"),
        "forward_backward_step": ("self", "input_dict", "labels", "global_valid_tokens"),
        "post_dataloading_process": ("self", "input_dict", "labels"),
        "init_distributed": ("self",),
        "state_dict": ("self",),
        "load_state_dict": ("self", "state_dict"),
        "close": ("self",),
    }),
    Dependency(f"{TRAINER}:Trainer", "training/step.py optimizer_step, training/trainer.py",
               sets=("gradient_accumulation_steps", "num_pipeline_parallel_microbatches",
                     "ntokens_seen", "parallel_dims", "model_parts", "optimizers",
                     "lr_schedulers", "metrics_processor", "checkpointer", "pp_schedule",
                     "validator", "device", "step")),
    Dependency(f"{DIST_UTILS}:clip_grad_norm_", "training/step.py StepClipping (its fallback)",
               ("parameters", "max_norm", "norm_type", "error_if_nonfinite", "foreach",
                "pp_mesh", "ep_enabled")),
    *(Dependency(f"{DIST_UTILS}:{name}", "training/step.py optimizer_step",
                 ("x", "mesh", "extra_pg")) for name in ("dist_sum_tensor", "dist_sum",
                                                         "dist_max")),
    Dependency("torchtitan.components.optimizer:OptimizersContainer._resolve_optimizer_factory",
               "training/optimizers.py GuardedOptimizers (overrides)", ("name",)),
    Dependency("torchtitan.components.optimizer:OptimizersContainer.step",
               "training/optimizers.py GuardedOptimizers (overrides)", ("self", "closure")),
    *_signatures(METRICS, "MetricsProcessor", "training/metrics.py ProtocolMetricsProcessor", {
        "_build_metric_logger": ("self", "config", "parallel_dims", "dump_folder", "pp_schedule",
                                 "ft_enable", "ft_replica_id", "config_dict", "tag"),
        "log": ("self", "step", "global_avg_loss", "global_max_loss", "grad_norm",
                "extra_metrics"),
        "log_validation": ("self", "loss", "step", "extra_metrics"),
        "should_log": ("self", "step"),
    }),
    Dependency(f"{METRICS}:MetricsProcessor.__init__", "training/metrics.py (the run's config "
               "at construction)", ("self", "config", "parallel_dims", "dump_folder",
               "pp_schedule", "ft_enable", "ft_replica_id", "config_dict", "tag",
               "has_quantization")),
    Dependency(f"{METRICS}:MetricsProcessor", "training/metrics.py (sets the peak FLOPS)",
               sets=("gpu_peak_flops", "optimizers", "model_parts", "device_memory_monitor")),
    Dependency(f"{METRICS}:DeviceMemoryMonitor", "training/metrics.py (the device's name)",
               sets=("device_name",)),
    Dependency("torchtitan.tools.utils:get_peak_flops", "training/trainer.py mfu_peak",
               ("device_name",), texts=("fallback to A100", "return 312e12")),
    Dependency(f"{METRICS}:LoggerContainer", "training/metrics.py _leaf_loggers",
               sets=("_loggers",)),
    Dependency("torchtitan.components.validate:Validator.validate",
               "training/trainer.py ProtocolValidator (overrides)",
               ("self", "model_parts", "step")),
    Dependency("torchtitan.components.validate:Validator.post_dataloading_process",
               "training/trainer.py ProtocolValidator (overrides)",
               ("self", "input_dict", "labels", "model_parts")),
    *_signatures(CHECKPOINTER, "CheckpointManager",
                 "training/checkpointing.py ProtocolCheckpointManager (overrides)", {
        "dcp_save": ("self", "state_dict", "checkpoint_id", "async_mode",
                     "enable_garbage_collection", "to_hf"),
        "dcp_load": ("self", "state_dict", "checkpoint_id", "from_hf", "from_quantized"),
        "_should_purge": ("self",),
        "load": ("self", "step"),
        "maybe_wait_for_staging": ("self",),
    }),
    Dependency(f"{CHECKPOINTER}:CheckpointManager", "training/checkpointing.py",
               sets=("folder",)),
    Dependency("torchtitan.models.llama3.model:Llama3Model._init_self_buffers",
               "model/model.py ProtocolModel (overrides)", ("self", "buffer_device")),
    Dependency("torchtitan.models.llama3.model:Llama3Model.init_states",
               "model/model.py ProtocolModel (overrides)", ("self", "buffer_device")),
    Dependency("torchtitan.protocols.module:Module._init_self_parameters",
               "model/mapl.py MaplCodec (overrides)", ("self",)),
    Dependency("torchtitan.models.common.rope:ComplexRoPE.Config", "model/model.py",
               fields=("dim", "max_seq_len", "theta", "scaling")),
    Dependency("torchtitan.config.configs:TrainingConfig", "config/run_config.py checks",
               fields=("local_batch_size", "global_batch_size", "seq_len", "steps",
                       "max_norm", "disable_cuda_graphs")),
    Dependency("torchtitan.components.validate:Validator", "training/samples.py",
               sets=("local_batch_size",)),
    *_signatures(STAGE, "PipelineStage", "wire/stage.py WirePipelineStage (overrides)", {
        "forward_maybe_with_nosync": ("self", "args", "kwargs"),
        "get_fwd_send_ops": ("self", "fwd_chunk_id"),
        "get_bwd_send_ops": ("self", "bwd_chunk_id"),
        "get_fwd_recv_ops": ("self", "fwd_chunk_id"),
        "get_bwd_recv_ops": ("self", "bwd_chunk_id"),
        "forward_one_chunk": ("self", "fwd_chunk_id", "args", "kwargs", "save_forward_output"),
        "backward_one_chunk": ("self", "bwd_chunk_id", "loss", "full_backward", "last_backward"),
        "clear_runtime_states": ("self",),
    }),
    Dependency(f"{STAGE}:PipelineStage", "wire/stage.py (receive infrastructure)",
               sets=("args_recv_info", "grad_recv_info", "fwd_cache", "output_chunks",
                     "has_backward")),
    *_signatures(SCHEDULES, "PipelineScheduleSingle",
                 "wire/async_schedule.py ScheduleAsync1F1B", {
        "_step_microbatches": ("self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses",
                               "return_outputs", "loss_kwargs"),
        "_check_inputs": ("self", "arg_mbs", "kwarg_mbs", "target_mbs", "losses"),
        "_initialize_stage": ("self", "args", "kwargs", "target", "loss_kwargs"),
        "_maybe_compute_loss": ("self", "stage", "output", "target_mbs", "mb_index",
                                "loss_kwargs"),
        "_maybe_get_loss": ("self", "stage", "mb_index"),
        "_update_losses": ("self", "stages", "losses"),
    }),
    Dependency(f"{SCHEDULES}:PipelineScheduleSingle", "wire/async_schedule.py",
               sets=("_stage", "_n_microbatches", "_has_backward")),
    Dependency("torch.distributed.checkpoint.default_planner:DefaultSavePlanner."
               "_create_global_plan", "training/checkpointing.py NodeSavePlanner (overrides)",
               ("self", "all_plans")),
    Dependency("torch.distributed.checkpoint.default_planner:DefaultLoadPlanner."
               "create_local_plan", "training/checkpointing.py NodeLoadPlanner (overrides)",
               ("self",)),
    Dependency("torch.distributed.checkpoint._fsspec_filesystem:FsspecReader.__init__",
               "config/preflight.py (a checkpoint in an object store: its parameter shapes)",
               ("self", "path", "kwargs")),
    Dependency("torch.distributed.distributed_c10d:_resolve_process_group",
               "tools/nccl_rules.py (a group's description in reports; test mode only)"),
    Dependency("torch.distributed.distributed_c10d:Backend.register_backend",
               "tools/nccl_rules.py register (experimental in torch; test mode only)",
               ("name", "func", "extended_api", "devices", "_backend_type")),
    Dependency("torch.distributed.distributed_c10d:batch_isend_irecv",
               "tools/nccl_rules.py (its NCCL branch runs on a backend that supports coalescing)",
               texts=('"supports_coalescing"', "_coalescing_manager(group, device, async_ops=True)",
                      "return cm.works")),
    *(Dependency(f"torch._C._distributed_c10d:Backend.{name}",
                 "tools/nccl_rules.py NcclRulesBackend (overrides; test mode only)")
      for name in ("supports_coalescing", "send", "recv", "allreduce", "all_gather_single",
                   "reduce_scatter_single", "set_timeout")),
    Dependency(f"{TRAINER}:", "training/console.py (filtered log lines)",
               texts=("Sleeping 2 seconds for other ranks to complete",
                      "Peak FLOPS used for computing MFU")),
    Dependency(f"{DIST_UTILS}:", "training/console.py (filtered log lines)",
               texts=("torch.distributed is already initialized. Skipping init_distributed",)),
    Dependency(f"{METRICS}:", "training/console.py (filtered log lines)",
               texts=("Pipeline Parallel loss is not visible",)),
]  # fmt: skip


def _resolve(symbol: str):
    module_name, _, qualified = symbol.partition(":")
    obj = importlib.import_module(module_name)
    for part in filter(None, qualified.split(".")):
        obj = getattr(obj, part)
    return obj


def _assigned_attributes(cls: type) -> set[str]:
    """Attributes the source of ``cls`` and its TorchTitan or torch bases assigns on ``self``
    (plain, annotated, augmented and tuple assignments)."""
    found: set[str] = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] not in ("torchtitan", "torch"):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign | ast.AugAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                for leaf in ast.walk(target):
                    if (isinstance(leaf, ast.Attribute) and isinstance(leaf.value, ast.Name)
                            and leaf.value.id == "self"):  # fmt: skip
                        found.add(leaf.attr)
    return found


def check(dependency: Dependency) -> list[str]:
    """What of ``dependency`` no longer holds (empty: all of it)."""
    name = dependency.symbol
    try:
        obj = _resolve(name)
    except (ImportError, AttributeError) as e:
        return [f"{name}: gone ({type(e).__name__}: {e}); used by {dependency.used_by}"]
    problems = []
    if dependency.parameters is not None:
        try:
            found = tuple(inspect.signature(obj).parameters)
        except (TypeError, ValueError) as e:
            found = (f"<no signature: {e}>",)
        if found != dependency.parameters:
            problems.append(f"{name}: parameters {found}, the plugin relies on "
                            f"{dependency.parameters}; used by {dependency.used_by}")  # fmt: skip
    if dependency.sets:
        lacking = sorted(set(dependency.sets) - _assigned_attributes(obj))
        if lacking:
            problems.append(f"{name}: no longer sets {lacking}; used by {dependency.used_by}")
    if dependency.fields:
        have = {f.name for f in dataclasses.fields(obj)}
        lacking = sorted(set(dependency.fields) - have)
        if lacking:
            problems.append(f"{name}: has no field {lacking}; used by {dependency.used_by}")
    if dependency.texts:
        source = inspect.getsource(obj)
        lacking = [t for t in dependency.texts if t not in source]
        if lacking:
            problems.append(f"{name}: its source lacks {lacking}; used by {dependency.used_by}")
    return problems


def import_problems(package: Path = PACKAGE) -> list[str]:
    """Every ``from torchtitan... import name`` (and ``import torchtitan...``) in the package's
    source that does not resolve, as ``file:line: what``."""
    problems = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torchtitan"):
                wanted = [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                wanted = [(alias.name, None) for alias in node.names
                          if alias.name.startswith("torchtitan")]  # fmt: skip
            else:
                continue
            for module, name in wanted:
                try:
                    imported = importlib.import_module(module)
                    if name is not None and not hasattr(imported, name):
                        importlib.import_module(f"{module}.{name}")
                except ImportError as e:
                    where = f"{path.relative_to(package.parent)}:{node.lineno}"
                    what = f"from {module} import {name}" if name else f"import {module}"
                    problems.append(f"{where}: {what} fails ({e})")
    return problems


def problems(dependencies: list[Dependency] = DEPENDENCIES) -> list[str]:
    """Everything that moved: the listed dependencies', then the package's imports'."""
    return [p for d in dependencies for p in check(d)] + import_problems()


def main(argv: list[str] | None = None) -> int:
    import argparse

    import torch
    import torchtitan

    argparse.ArgumentParser(
        prog="python -m protocol_models.tools.private_api",
        description="Check every private torch/TorchTitan symbol the plugin relies on: one line "
        "per symbol that moved; exit 1 if any.",
    ).parse_args(argv)
    found = problems()
    versions = f"torch {torch.__version__}, torchtitan {getattr(torchtitan, '__version__', '?')}"
    for line in found:
        print(line)
    print(f"{len(DEPENDENCIES)} private dependencies and the package's torchtitan imports "
          f"checked against {versions}: {len(found) or 'nothing'} moved")  # fmt: skip
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
