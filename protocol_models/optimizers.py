"""Optimizers (TOML table ``[optimizer]``) and the non-finite guard around them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.distributed as dist
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.tools.logging import logger

from protocol_models.errors import NonFiniteError


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

    name: Literal["adamw"] = "adamw"
    lr: float = 8e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: Literal["for-loop", "foreach", "fused"] = "foreach"
    skip_nonfinite_steps: int = 0
    """Non-finite steps to skip before the run stops (0: stop at the first)."""

    def to_container_config(self) -> GuardedOptimizers.Config:
        kwargs = {
            "lr": self.lr,
            "betas": tuple(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        return GuardedOptimizers.Config(
            param_groups=[
                ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kwargs)
            ],
            implementation=self.implementation,
            skip_nonfinite_steps=self.skip_nonfinite_steps,
        )
