"""Optimizers (TOML table ``[optimizer]``) and the non-finite guard around them.

* ``adamw``: AdamW on every parameter (on the reparametrized factors ``A`` of the constrained
  writers, so every update stays in span(U) by construction);
* ``muon``: Muon -- Nesterov momentum orthogonalized by a Newton-Schulz iteration -- on the 2-D
  block weights (attention and MLP projections, including the factors ``A``), AdamW on the
  embedding, head and norms (METHOD §6.2). Newton-Schulz is an odd matrix polynomial, so for
  orthonormal ``U``: ``NS(U Y) = U NS(Y)``: Muon on ``A`` is exactly Muon with projected
  gradients on ``W = U A`` and never leaves the subspace. The dense twin gets the same split.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.tools.logging import logger

from protocol_models.errors import NonFiniteError, UserError

BLOCK_MATRICES = r"^layers\.\d+\.(attention|feed_forward)\."
"""Parameter names Muon trains: every projection inside a block (norms are ``*_norm``)."""


def newton_schulz(g: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """Approximate the orthogonal polar factor of a matrix ``g`` ``[m, n]`` (fp32).

    The quintic iteration ``X <- a X + (b X X^T + c (X X^T)^2) X`` after Frobenius
    normalization, with the (a, b, c) used by Muon's reference implementation. It is an odd
    polynomial in ``X``, hence equivariant under left multiplication by orthonormal columns.
    """
    a, b, c = 3.4445, -4.7750, 2.0315
    x = g.float()
    transposed = x.shape[0] > x.shape[1]
    if transposed:
        x = x.T
    x = x / (x.norm() + 1e-7)
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if transposed else x


class Muon(torch.optim.Optimizer):
    """Muon for 2-D weights: ``p <- p (1 - lr wd) - lr max(1, rows/cols)^0.5 NS(nesterov(m))``.

    Parameters must be whole matrices on this rank (no FSDP sharding of Muon's parameters).
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 ns_steps=5, **_implementation_flags):  # fmt: skip
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps)  # fmt: skip
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                weight, grad = _local(p), _local(p.grad)
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(grad))
                buf.lerp_(grad, 1 - mu)
                update = grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = newton_schulz(update.reshape(update.shape[0], -1), group["ns_steps"])
                scale = max(1.0, weight.shape[0] / weight[0].numel()) ** 0.5
                weight.mul_(1 - lr * wd)
                weight.add_(ortho.view_as(weight).to(weight.dtype), alpha=-lr * scale)
        return None


def _local(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() > 1:
        raise UserError(
            "optimizer.name = 'muon' needs whole matrices on each rank: use "
            "parallelism.data_parallel_shard_degree = 1 (replicate, not FSDP-shard)"
        )
    return t.to_local()


class GuardedOptimizers(OptimizersContainer):
    """TorchTitan's optimizer container that refuses non-finite steps.

    Before each step every rank checks its gradients; the ranks agree (all-reduce) so the whole
    job skips or stops together. A non-finite step is never applied: it is skipped (gradients
    dropped) up to ``skip_nonfinite_steps`` times in a run, then ``NonFiniteError`` stops the run
    before the step's checkpoint, so the last good checkpoint stays the newest one. The LR
    schedule still advances on a skipped step.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        skip_nonfinite_steps: int = 0

    current_step: int = 0
    """Set by the trainer before each step; named in the error."""

    def __init__(self, config: Config, *, model_parts):
        super().__init__(config, model_parts=model_parts)
        self.skip_budget = config.skip_nonfinite_steps
        self.skipped_steps: list[int] = []

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == "Muon":
            return Muon
        return OptimizersContainer._resolve_optimizer_factory(name)

    def step(self, closure=None):
        if self._gradients_finite():
            return super().step(closure)
        self.skipped_steps.append(self.current_step)
        if len(self.skipped_steps) > self.skip_budget:
            raise NonFiniteError(
                f"non-finite loss or gradient at step {self.current_step}; the step was not "
                f"applied and no checkpoint was written after it (skipped so far: "
                f"{self.skipped_steps[:-1] or 'none'}, optimizer.skip_nonfinite_steps = "
                f"{self.skip_budget})"
            )
        logger.warning(f"non-finite gradient at step {self.current_step}: step skipped")
        self.zero_grad()
        return None

    def _gradients_finite(self) -> bool:
        grads = [p.grad for m in self.model_parts for p in m.parameters() if p.grad is not None]
        local = torch.stack([torch.isfinite(g).all() for g in grads]).all() if grads else None
        flag = torch.tensor([1.0 if local is None or bool(local) else 0.0])
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())


@dataclass(kw_only=True, slots=True)
class OptimizerSettings:
    """TOML table ``[optimizer]``: one optimizer over all parameters."""

    name: Literal["adamw", "muon"] = "adamw"
    lr: float = 8e-4
    """AdamW's learning rate (with ``muon``: for the embedding, head and norms)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: Literal["for-loop", "foreach", "fused"] = "foreach"
    skip_nonfinite_steps: int = 0
    """Non-finite steps to skip before the run stops (0: stop at the first)."""
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0

    def to_container_config(self) -> GuardedOptimizers.Config:
        kwargs = {
            "lr": self.lr,
            "betas": tuple(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        groups = [ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kwargs)]
        if self.name == "muon":
            muon = {"lr": self.muon_lr, "momentum": self.muon_momentum,
                    "weight_decay": self.muon_weight_decay}  # fmt: skip
            groups.insert(
                0,
                ParamGroupConfig(
                    pattern=BLOCK_MATRICES, optimizer_name="Muon", optimizer_kwargs=muon
                ),
            )
        return GuardedOptimizers.Config(
            param_groups=groups,
            implementation=self.implementation,
            skip_nonfinite_steps=self.skip_nonfinite_steps,
        )
