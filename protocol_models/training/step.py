"""One training step of the Protocol trainer: the gradient clipping a pipeline over slow links
needs, called directly by the trainer's own step (``ProtocolTrainer.train_step``) -- TorchTitan's
module functions are never replaced.

TorchTitan's ``Trainer.train_step`` clips with ``torchtitan.distributed.utils.clip_grad_norm_``,
whose all-reduce over the pipeline group crosses every slow link on the step's critical path.
``StepClipping`` reduces the norm with the plugin's gradient-norm exchange instead
(``wire.norm_exchange``), and ``optimizer_step`` runs one step in TorchTitan's order (the
microbatches of every gradient-accumulation step, the loss normalized by the global count of
valid tokens, the clipping, the optimizer and scheduler steps, the log) with that clipping.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor
from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.distributed import utils as dist_utils

from protocol_models.training.delayed import DelayedUpdates
from protocol_models.training.metrics import ProtocolMetricsProcessor
from protocol_models.wire import Wire
from protocol_models.wire.norm_exchange import NormExchange


@dataclass(kw_only=True)
class StepClipping:
    """The gradient clipping of one step: the norm reduced over the pipeline stages with
    ``exchange`` (no all-reduce on the critical path across the slow links) -- everything else
    as TorchTitan's ``clip_grad_norm_`` does it (the norm over each stage's FSDP shards, then
    ``clip_grads_with_norm_``) -- and the global norm handed to the optimizer container, whose
    non-finite guard reads it instead of agreeing on a flag in a collective of its own. Without
    an exchange (no pipeline parallelism, ``[transport] exchange_grad_norm = false``), with
    expert parallelism or a norm other than 2, TorchTitan's ``clip_grad_norm_`` runs (with
    pipeline parallelism its all-reduce is counted on ``wire``'s meter and link).

    ``schedule_done`` runs first thing in the clipping (the step's schedule is over). With
    ``metrics_row`` (a log step), this stage's metrics row (``[width]`` float64) travels in the
    exchange, and every stage's rows go to ``metrics.exchanged_rows`` for the log. With
    ``delayed`` (``Async1F1B``) the clipping gathers the step's due updates instead, each
    clipped by its own norm (``DelayedUpdates.collect``: the norms travel in batch-keyed
    exchanges of their own)."""

    optimizers: object
    exchange: NormExchange | None
    wire: Wire
    metrics: ProtocolMetricsProcessor
    delayed: DelayedUpdates | None = None
    schedule_done: Callable[[], None] | None = None
    metrics_row: Callable[[], torch.Tensor] | None = None

    def begin(self) -> None:
        """Before the step's forwards: the exchange posts its receives (gloo)."""
        if self.exchange is not None and self.delayed is None:
            self.exchange.post(self.metrics.stage_row_width() if self.metrics_row else 0)

    def end(self) -> None:
        """After the step (or its failure): the container forgets the norm."""
        self.optimizers.reduced_grad_norm = None

    def __call__(self, parameters, max_norm: float, *, foreach: bool | None, pp_mesh,
                 ep_enabled: bool, norm_type: float = 2.0) -> torch.Tensor:  # fmt: skip
        """Clip ``parameters``' gradients to ``max_norm`` by the global norm; return it."""
        if self.schedule_done is not None:
            self.schedule_done()
        if self.delayed is not None:
            norm = self.delayed.collect(max_norm, foreach)
        elif self.exchange is None or pp_mesh is None or ep_enabled or norm_type != 2.0:
            norm = dist_utils.clip_grad_norm_(parameters, max_norm, norm_type, False, foreach,
                                              pp_mesh, ep_enabled)  # fmt: skip
            if pp_mesh is not None:  # its all-reduce over the pipeline group
                self.wire.collective("grad_norm", "all_reduce", pp_mesh.size())
        else:
            parameters = list(parameters)
            grads = [p.grad for p in parameters if p.grad is not None]
            local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
            if isinstance(local, DTensor):  # partial over the data-parallel shards
                local = local.full_tensor()
            row = self.metrics_row() if self.metrics_row else None
            norm = self.exchange.global_norm(local, row)
            if self.metrics_row is not None:
                self.metrics.exchanged_rows = self.exchange.rows
            torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm, foreach)
        self.optimizers.reduced_grad_norm = norm
        return norm


def optimizer_step(trainer, data_iterator, clip: StepClipping) -> None:
    """One optimizer step of ``trainer`` (a ``ProtocolTrainer``) in TorchTitan's order, with
    ``clip`` as its gradient clipping; logs the step's metrics on a log step.

    The microbatches of each gradient-accumulation step (``num_pipeline_parallel_microbatches``
    of them with pipeline parallelism, else one) are read first, their valid tokens counted and
    summed over the batch mesh (the loss is normalized by that global count, kept on the
    device); each accumulation step's forward and backward is ``forward_backward_step``. On a
    log step the summed loss is reduced as TorchTitan reduces it (sum and max over the loss
    mesh with data or context parallelism), a non-finite loss stops the run, and the metrics
    processor logs the loss, the norm and the tokens seen."""
    config, dims = trainer.config, trainer.parallel_dims
    trainer.optimizers.zero_grad(set_to_none=config.training.disable_cuda_graphs)
    lr_metrics = trainer.lr_schedulers.get_metrics()
    should_log = trainer.metrics_processor.should_log(trainer.step)
    groups, local_valid_tokens = [], torch.tensor(0, dtype=torch.int64)
    per_group = trainer.num_pipeline_parallel_microbatches if dims.pp_enabled else 1
    for _ in range(trainer.gradient_accumulation_steps):
        group = [next(data_iterator) for _ in range(per_group)]
        for _, labels in group:
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
        groups.append(group)
    global_valid_tokens = local_valid_tokens.to(trainer.device)
    if dims.dp_enabled:
        global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens,
                                                         dims.get_mesh("batch"))  # fmt: skip

    accumulated: torch.Tensor | None = None
    for group in groups:
        inputs, labels = [], []
        for input_dict, label in group:
            for key, value in input_dict.items():
                if isinstance(value, torch.Tensor):
                    input_dict[key] = value.to(trainer.device)
            inputs.append(input_dict)
            labels.append(label.to(trainer.device))
        loss = trainer.forward_backward_step(
            input_dict=inputs if dims.pp_enabled else inputs[0],
            labels=labels if dims.pp_enabled else labels[0],
            global_valid_tokens=global_valid_tokens,
        )
        if should_log:
            loss = loss.detach()
            accumulated = loss.clone() if accumulated is None else accumulated.add_(loss)

    grad_norm = clip([p for m in trainer.model_parts for p in m.parameters()],
                     config.training.max_norm, foreach=True,
                     pp_mesh=dims.get_optional_mesh("pp"), ep_enabled=dims.ep_enabled)  # fmt: skip
    trainer.checkpointer.maybe_wait_for_staging()
    trainer.optimizers.step()
    trainer.lr_schedulers.step()
    if not should_log:
        return
    if dims.dp_cp_enabled:
        loss_mesh = dims.get_optional_mesh("loss")
        local_avg = accumulated * global_valid_tokens / local_valid_tokens.to(trainer.device)
        seen = torch.tensor(trainer.ntokens_seen, dtype=torch.int64, device=trainer.device)
        avg_loss = dist_utils.dist_sum(accumulated, loss_mesh)
        max_loss = dist_utils.dist_max(local_avg, loss_mesh)
        tokens_seen = dist_utils.dist_sum(seen, loss_mesh)
    else:
        avg_loss = max_loss = float(accumulated.item())
        tokens_seen = trainer.ntokens_seen
    if not math.isfinite(avg_loss):
        raise RuntimeError(f"Loss is not finite ({avg_loss}) at step {trainer.step}")
    extra = {"n_tokens_seen": tokens_seen, **lr_metrics}
    trainer.metrics_processor.log(trainer.step, avg_loss, max_loss, float(grad_norm.item()),
                                  extra_metrics=extra)  # fmt: skip


__all__ = ["StepClipping", "optimizer_step"]
