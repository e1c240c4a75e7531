"""Two weight versions of one pipeline stage, for the asynchronous schedule (``async_schedule``).

Under ``Async1F1B`` a stage runs the forwards of batch ``t + 1`` while the backwards of batch
``t``'s last microbatches are still ahead, and the update from batch ``t - 1`` lands between the
two. Each backward must differentiate the weights its forward used (PipeDream-2BW), so a stage
keeps two versions ``V[0]``, ``V[1]`` of its parameters: batch ``t``'s forwards run the stage's
module with ``V[t % 2]`` in place of its parameters (``torch.func.functional_call``), so autograd
records, and its backwards accumulate gradients into, that version's leaf tensors. The module's
own parameters ``P`` are the optimizer's: an update writes ``P``, and ``refresh`` then copies
``P`` into the version whose batch has just been applied, for the batch after next.

Invariant: between two schedule calls, ``V[b % 2]`` holds the weights batch ``b``'s forwards
used for every batch ``b`` whose backward is not finished, and ``V[b % 2].grad`` that batch's
gradient so far. Memory: two more copies of the stage's parameters (and their gradients) beside
``P``, its gradients and the optimizer state.
"""

from __future__ import annotations

import torch
from torch import nn


class WeightVersions:
    """``V[0]`` and ``V[1]`` of ``module``'s parameters (module docstring), keyed as
    ``module.named_parameters()``; ``reset`` makes both equal to its parameters."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.versions: list[dict[str, torch.Tensor]] = []

    def reset(self) -> None:
        """Both versions := the module's parameters, gradients dropped: the pipeline is empty
        (the first training call, after a flush; the parameters are initialized or loaded by
        then, whereas the stage is built on the meta device)."""
        if not self.versions:
            self.versions = [
                {name: torch.empty_like(p).requires_grad_(p.requires_grad)
                 for name, p in self.module.named_parameters()}  # fmt: skip
                for _ in range(2)
            ]
        self.refresh(0)
        self.refresh(1)

    def forward(self, version: int, *args, **kwargs):
        """``module(*args, **kwargs)`` with ``V[version]`` as its parameters."""
        return torch.func.functional_call(self.module, self.versions[version], args, kwargs)

    def grads(self, version: int) -> list[torch.Tensor | None]:
        """``V[version]``'s gradients, in ``module.parameters()`` order."""
        return [self.versions[version][name].grad for name, _ in self.module.named_parameters()]

    def weights(self, version: int) -> list[torch.Tensor]:
        """``V[version]``'s tensors, in ``module.parameters()`` order."""
        return [self.versions[version][name] for name, _ in self.module.named_parameters()]

    @torch.no_grad()
    def refresh(self, version: int, ahead: list[torch.Tensor] | None = None,
                alpha: float = 0.0) -> None:  # fmt: skip
        """``V[version]`` := the module's parameters (just updated), gradients dropped; with
        ``ahead`` (``module.parameters()`` order), plus ``alpha * ahead`` (weight prediction)."""
        for i, (name, p) in enumerate(self.module.named_parameters()):
            leaf = self.versions[version][name]
            leaf.grad = None
            leaf.copy_(p)
            if ahead is not None:
                leaf.add_(ahead[i], alpha=alpha)
