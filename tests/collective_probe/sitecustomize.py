"""Test probe, loaded into every worker through ``PYTHONPATH`` by ``test_devices.py``.

On a GPU run TorchTitan's process groups are NCCL-only, so a tensor that enters a collective on
another device than the training device fails there. On CPU every tensor is a CPU tensor, so the
probe makes the mistake visible: the plugin's methods that build tensors for collectives run
with ``meta`` as the default device, so a tensor created without an explicit device lands on
``meta`` instead of the training device. Every ``torch.distributed`` collective is wrapped and
checks the devices of its tensors; a collective called directly by plugin code outside those
methods is flagged too (so a new call site cannot escape the probe). Violations are appended to
``$COLLECTIVE_PROBE_LOG`` and raised.

With ``$COLLECTIVE_PROBE_COUNT`` set, every collective (point-to-point calls excluded) is also
appended to ``$COLLECTIVE_PROBE_COUNT.rank<r>`` (one file per rank) as ``<name> <group size>``,
every training step begins with ``step <n>``, and a stage posting the next step's forward
receives early writes ``post_next_forward``: what ``test_transport.py`` counts per step.

The pipeline's metadata-inference placeholders are filled with NaN (what uninitialised GPU
memory may hold), so a metric measured on them instead of real microbatches reads NaN. With
``$COLLECTIVE_PROBE_TIMEOUTS`` every group's timeout is recorded as each step starts; with
``$COLLECTIVE_PROBE_SLOW_FIRST_FORWARD`` one rank's first forward sleeps.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import torch
import torch.distributed as dist

from protocol_models.tools import cpu_shim

cpu_shim.install()  # as protocol_models.train does, before the trainer is imported here
import protocol_models.cluster.fsdp_probe  # noqa: E402
import protocol_models.model.model  # noqa: E402
import protocol_models.tools.gather  # noqa: E402
import protocol_models.training.grassmann  # noqa: E402
import protocol_models.training.mapl_sync  # noqa: E402
import protocol_models.training.metrics  # noqa: E402
import protocol_models.training.optimizers  # noqa: E402
import protocol_models.training.trainer  # noqa: E402
import protocol_models.wire.norm_exchange  # noqa: E402
import protocol_models.wire.stage  # noqa: E402

SCOPED = {
    protocol_models.training.metrics.ProtocolMetricsProcessor: (
        "_from_last_stage",
        "_agree_over_pipeline",
    ),
    protocol_models.wire.norm_exchange.NormExchange: ("_connect", "post", "global_norm"),
    protocol_models.training.optimizers.GuardedOptimizers: ("_gradients_finite",),
    protocol_models.training.grassmann.SubspaceTracker: ("_update",),
    protocol_models.training.mapl_sync.BoundarySync: ("sum_gradients", "metrics"),
    protocol_models.wire.stage.WirePipelineStage: (
        "get_fwd_send_ops", "get_bwd_send_ops", "get_fwd_recv_ops", "get_bwd_recv_ops",
        "_post_step",
    ),
    protocol_models.cluster.fsdp_probe: ("time_collectives",),
    protocol_models.tools.gather: ("all_gather_json",),
}  # fmt: skip
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
               "reduce_scatter_tensor", "reduce_scatter_single", "send", "recv", "batch_isend_irecv")  # fmt: skip
POINT_TO_POINT = ("send", "recv", "batch_isend_irecv")
"""(``isend``/``irecv`` stay unwrapped: ``P2POp`` checks their identity; the pipeline's
point-to-point ops are checked in ``batch_isend_irecv``.)"""
PLUGIN_DIR = os.path.dirname(protocol_models.__file__)
scoped_names = {name for names in SCOPED.values() for name in names}


def _report(message: str) -> None:
    with open(os.environ["COLLECTIVE_PROBE_LOG"], "a") as f:
        f.write(message + "\n")
    raise RuntimeError(f"collective probe: {message}")


def _scoped(method):
    @functools.wraps(method)
    def run(*args, **kwargs):
        with torch.device("meta"):
            return method(*args, **kwargs)

    return run


def _tensors(args) -> list[torch.Tensor]:
    found = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, dist.P2POp):
            found.append(arg.tensor)
        elif isinstance(arg, list | tuple):
            found.extend(_tensors(arg))
    return found


def _count(line: str) -> None:
    path = os.environ.get("COLLECTIVE_PROBE_COUNT")
    if path:
        with open(f"{path}.rank{os.environ.get('RANK', '0')}", "a") as f:
            f.write(line + "\n")


def _counted_steps(train_step):
    @functools.wraps(train_step)
    def run(self, *args, **kwargs):
        _count(f"step {self.step}")
        _record_timeouts(self)
        return train_step(self, *args, **kwargs)

    return run


def _record_timeouts(trainer) -> None:
    """With ``$COLLECTIVE_PROBE_TIMEOUTS``: one line per step, ``step <n> <seconds>:<size>
    ...``, the timeout and size of every group of the run as the step starts (the world, each
    mesh axis', the plugin's own), appended to ``$COLLECTIVE_PROBE_TIMEOUTS.rank<r>``."""
    path = os.environ.get("COLLECTIVE_PROBE_TIMEOUTS")
    if not path:
        return
    meshes = trainer.parallel_dims.get_all_one_dimensional_meshes()
    groups = [dist.group.WORLD, *(m.get_group() for m in meshes.values()),
              *trainer.plugin_groups()]  # fmt: skip
    entries = [
        f"{g._get_backend(torch.device('cpu')).options._timeout.total_seconds():g}:{g.size()}"
        for g in groups
    ]
    with open(f"{path}.rank{os.environ.get('RANK', '0')}", "a") as f:
        f.write(" ".join(["step", str(trainer.step), *entries]) + "\n")


def _checked(name, collective):
    @functools.wraps(collective)
    def run(*args, **kwargs):
        if name not in POINT_TO_POINT:
            group = kwargs.get("group")
            _count(f"{name} {dist.get_world_size(group)}")
        device = torch.device(os.environ.get("COLLECTIVE_PROBE_DEVICE", "cpu"))
        for t in _tensors([*args, *kwargs.values()]):
            if t.device.type != device.type:
                _report(f"dist.{name} got a tensor on {t.device}, training device {device}")
        caller = sys._getframe(1)
        if caller.f_code.co_filename.startswith(PLUGIN_DIR):
            stack, frame = [], caller
            while frame is not None:
                stack.append(frame.f_code.co_name)
                frame = frame.f_back
            if not scoped_names & set(stack):
                _report(f"dist.{name} called by plugin code outside the probed methods: "
                        f"{caller.f_code.co_filename}:{caller.f_lineno}")  # fmt: skip
        return collective(*args, **kwargs)

    return run


for cls, names in SCOPED.items():
    for method_name in names:
        setattr(cls, method_name, _scoped(getattr(cls, method_name)))
for collective_name in COLLECTIVES:
    setattr(dist, collective_name, _checked(collective_name, getattr(dist, collective_name)))
trainer_class = protocol_models.training.trainer.ProtocolTrainer
trainer_class.train_step = _counted_steps(trainer_class.train_step)
stage_class = protocol_models.wire.stage.WirePipelineStage
post_next_forward = stage_class.post_next_forward


def _counted_post(self):
    _count("post_next_forward")
    return post_next_forward(self)


stage_class.post_next_forward = _counted_post


def _nan_placeholders(to_tensor):
    """The pipeline's metadata inference runs the stages on placeholder inputs made from
    metadata (``torch.empty``: on a GPU, whatever the memory held); filled with NaN here, so a
    metric computed on them shows it."""

    @functools.wraps(to_tensor)
    def run(self, arg):
        tensor = to_tensor(self, arg)
        if not isinstance(arg, torch.Tensor) and tensor.is_floating_point():
            with torch.no_grad():
                tensor.fill_(float("nan"))
        return tensor

    return run


stage_class._to_tensor = _nan_placeholders(stage_class._to_tensor)


def _slow_first_forward(forward):
    """With ``$COLLECTIVE_PROBE_SLOW_FIRST_FORWARD`` = ``<rank>:<seconds>``: that rank's first
    forward (the metadata inference's) sleeps that long first, as a cold compile would."""
    setting = os.environ.get("COLLECTIVE_PROBE_SLOW_FIRST_FORWARD")
    if not setting:
        return forward
    rank, seconds = setting.split(":")
    slept = []

    @functools.wraps(forward)
    def run(self, *args, **kwargs):
        if not slept and os.environ.get("RANK") == rank:
            slept.append(True)
            time.sleep(float(seconds))
        return forward(self, *args, **kwargs)

    return run


model_class = protocol_models.model.model.ProtocolModel
model_class.forward = _slow_first_forward(model_class.forward)
