"""The delayed update rule of the asynchronous pipeline (``[parallelism] pipeline_parallel_schedule
= "Async1F1B"``): each batch's gradient is applied one step late.

With ``W_t`` the weights batch ``t``'s forwards use and ``g_t`` its gradient::

    W_{t+1} = W_t - update(g_{t-1})     at step t's learning rate, g_{t-1} clipped by its own
                                        global norm, the non-finite guard reading that norm

The first step of a run (or of a resumed one) and the step after a flush apply nothing. A flush
step ``t`` (``flush``: a checkpoint, a validation, the last step) drains the pipeline and applies
``g_{t-1}`` and then ``g_t``, each a full optimizer step at step t's learning rate, so after it no
gradient is pending and the weights are exactly what a checkpoint holds: a run resumed there goes
on as the uninterrupted one does.

Weight prediction (``[optimizer] weight_prediction = a > 0``; SpecTrain, Chen et al. 2018): while
``g_{t-1}`` is pending, batch ``t``'s forwards and backwards run on ``W_t + a (W_t - W_{t-1})``,
the weights its gradient will be applied to extrapolated by the last update, instead of ``W_t``
(the update applied is still ``update(g_{t-1})`` on ``W_t``). ``W_t - W_{t-1}`` is the update of
the step before, when that step was no flush and applied one (else nothing is predicted), so a
run resumed at a flush's checkpoint predicts as the uninterrupted one does.

``DelayedUpdates`` runs the rule for the trainer, in one of two places the gradient lives:

* a pipeline stage under ``Async1F1B`` (``versions``): batch ``b``'s gradient accumulates in
  weight version ``b % 2`` (``wire.weight_versions``); its global norm is the pipeline's sum of
  the stages' squared norms, each sent by the schedule's ``gradients_ready`` as soon as the stage's
  last backward of the batch is done (``wire.norm_exchange``), and after ``b``'s update that version
  takes the new weights;
* one process (``protocol.stages``, no pipeline): the same rule over the whole model, the emulation
  the pipelined run is tested against: each step's gradient is taken out of the parameters
  (``.grad``) after its backward and put back when due.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from protocol_models.wire.norm_exchange import NormExchange
from protocol_models.wire.weight_versions import WeightVersions


@dataclass
class DueUpdate:
    """One batch's update: its gradients (in parameter order), global gradient norm and the
    weights its forward used (parameter order; kept in one process only for the delay
    compensation, ``keep_weights``)."""

    batch: int
    grads: list[torch.Tensor | None]
    norm: torch.Tensor
    weights: list[torch.Tensor] | None = None


class DelayedUpdates:
    """The delayed rule over ``params`` (the optimizer's parameters, the stage's
    ``module.parameters()`` order when ``versions`` is given), module docstring."""

    def __init__(self, params: list[nn.Parameter], *, versions: WeightVersions | None = None,
                 exchange: NormExchange | None = None, keep_weights: bool = False,
                 predict: float = 0.0):  # fmt: skip
        if (versions is None) != (exchange is None):
            raise ValueError("a pipeline stage's delayed updates need versions and an exchange")
        self.params, self.versions, self.exchange = params, versions, exchange
        self.keep_weights, self.predict = keep_weights, predict
        self._last_update: list[torch.Tensor] | None = None
        """``W_t - W_{t-1}`` (parameter order) while the weights are to be predicted (``predict``):
        the last step's update; before it is applied, ``W_{t-1}``. None: nothing to predict by."""
        self._unpredicted: list[torch.Tensor] | None = None
        """One process: the parameters' own values while a batch runs on the predicted ones."""
        self.step = 0
        self.flush = True
        self._held: dict[int, DueUpdate] = {}
        """One process: the gradients taken out of the parameters, by batch, norm included."""
        self._complete: set[int] = set()
        """Pipeline: the batches whose gradient this stage holds in full."""
        self.due: list[DueUpdate] = []
        """The updates this step applies, in order (``collect``); the optimizers apply them."""

    def begin(self, step: int, flush: bool) -> None:
        """Step ``step`` starts; ``flush``: it drains the pipeline. Posts the receives of its
        batch's gradient norm (pipeline)."""
        self.step, self.flush = step, flush
        if self.exchange is not None:
            self.exchange.post_batch(step)
        elif self._last_update is not None and step - 1 in self._held:  # one process
            self._unpredicted = [p.detach().clone() for p in self.params]
            with torch.no_grad():
                for p, change in zip(self.params, self._last_update, strict=True):
                    p.add_(change, alpha=self.predict)

    def gradients_ready(self, batch: int) -> None:
        """Pipeline: this stage's gradient of ``batch`` is complete (the schedule's callback):
        its local norm goes to the other stages now."""
        self._complete.add(batch)
        grads = [g for g in self.versions.grads(batch % 2) if g is not None]
        self.exchange.send(batch, torch.nn.utils.get_total_norm(grads, foreach=True))

    def collect(self, max_norm: float, foreach: bool | None = None) -> torch.Tensor:
        """At the step's gradient clipping: gather the due updates (``due``), each clipped by its
        own global norm, and return the norm to log (the last due one's; 0 when none is due)."""
        step = self.step
        if self.versions is None:  # one process: this step's gradient is complete now
            grads = [p.grad for p in self.params]
            present = [g for g in grads if g is not None]
            norm = torch.nn.utils.get_total_norm(present, foreach=foreach)
            weights = [p.detach().clone() for p in self.params] if self.keep_weights else None
            self._held[step] = DueUpdate(step, grads, norm, weights)
            for p in self.params:
                p.grad = None
            if self._unpredicted is not None:  # back from the predicted weights
                with torch.no_grad():
                    for p, own in zip(self.params, self._unpredicted, strict=True):
                        p.copy_(own)
                self._unpredicted = None
        batches = [b for b in (step - 1, step) if b == step - 1 or self.flush]
        self.due = [u for u in map(self._take, batches) if u is not None]
        self._last_update = None
        if self.predict and self.due and not self.flush:  # W_t, to take the update's size
            self._last_update = [p.detach().clone() for p in self.params]
        for update in self.due:  # scales the update's gradient tensors in place
            self.load(update)
            torch.nn.utils.clip_grads_with_norm_(self.params, max_norm, update.norm, foreach)
        if not self.due:
            return torch.zeros((), device=self.params[0].device)
        return self.due[-1].norm

    def _take(self, batch: int) -> DueUpdate | None:
        """``batch``'s update, if this run computed its gradient (not before a start or resume,
        nor one a flush applied already)."""
        if self.versions is None:
            return self._held.pop(batch, None)
        if batch not in self._complete:
            return None
        self._complete.remove(batch)
        version = batch % 2
        return DueUpdate(batch, self.versions.grads(version), self.exchange.total(batch),
                         self.versions.weights(version))  # fmt: skip

    def load(self, update: DueUpdate) -> None:
        """Put ``update``'s gradients into the parameters for the optimizer step."""
        for p, g in zip(self.params, update.grads, strict=True):
            p.grad = g

    def applied(self) -> None:
        """The due updates were applied (or skipped): drop the parameters' gradients, take the
        update's size for the weight prediction, and give the weight version of the next batch
        the new weights (predicted), or at a flush each applied batch's version (the next
        schedule call resets both)."""
        for p in self.params:
            p.grad = None
        if self._last_update is not None:  # W_{t+1} - W_t, in the buffer that held W_t
            with torch.no_grad():
                for p, change in zip(self.params, self._last_update, strict=True):
                    change.neg_().add_(p)
        if self.versions is not None:
            if self.flush:
                for update in self.due:
                    self.versions.refresh(update.batch % 2)
            else:
                self.versions.refresh((self.step + 1) % 2, self._last_update, self.predict)
        self.due = []
