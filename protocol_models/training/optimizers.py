"""Optimizers (TOML table ``[optimizer]``) and the non-finite guard around them.

Each keeps every boundary exact; the dense twin of each runs the same rule on the same matrices.

* ``adamw``: AdamW on every parameter (on the reparametrized factors ``A`` of the constrained
  writers, so every update stays in span(U) by construction);
* ``muon``: Muon -- Nesterov momentum orthogonalized by a Newton-Schulz iteration -- on the 2-D
  block weights (attention and MLP projections, including the factors ``A`` and ResBM's
  encoders and decoders), AdamW on the
  embedding, head and norms. Newton-Schulz is an odd matrix polynomial, so for
  orthonormal ``U``: ``NS(U Y) = U NS(Y)``: Muon on ``A`` is exactly Muon with projected
  gradients on ``W = U A`` and never leaves the subspace. The dense twin gets the same split;
* ``adamw_rowwise`` (full-width writers): the paper's modified AdamW. On each
  constrained weight the gradient is projected into span(U) and the second moment is one scalar
  per input column of ``W`` ``[d, in]`` (per token row of ``E`` ``[V, d]``): every column of the
  step is a span(U) vector divided by a scalar. Other parameters: AdamW. Dense twin: the same
  row-constant second moment on the same matrices, without the projection;
* ``adamw_project`` (full-width writers, variant B): stock AdamW, then
  ``W <- U U^T W`` and ``E <- E U U^T`` after every step. Dense twin: AdamW.

Whatever the ``[optimizer] name``, ``mapl`` mode trains its learned projections U
(``PROJECTIONS``) with ``StiefelMuon``, a Riemannian Muon step on the Stiefel manifold.

**Adding an optimizer** is one ``torch.optim.Optimizer`` class plus one ``OptimizerEntry`` in
``OPTIMIZERS`` (``register_optimizer``): its factory, the parametrization it trains, whether it
needs whole matrices, the state keys subspace updates re-express, its state bytes per parameter
(the planner's memory) and its fair dense twin. ``[optimizer] name``, the config check, the
planner, ``protocol_models.training.grassmann`` and the recipes read the entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar, Literal

import torch
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig
from torchtitan.tools.logging import logger

from protocol_models.model.mapl import retract, tangent
from protocol_models.model.model import local_matrix, project_
from protocol_models.tools.errors import NonFiniteError, require
from protocol_models.tools.ranges import AT_LEAST_0, POSITIVE, OneOf, Range, Ranges
from protocol_models.training.protocol import Parametrization

BLOCK_MATRICES = r"^layers\.\d+\.(attention|feed_forward|encoder|decoder)\."
"""Parameter names Muon trains: every projection inside a block, ResBM's boundary encoder and
decoder included (norms are ``*_norm``)."""

PROJECTIONS = r"\.mapl_(out|in)\.projection$"
"""MAPL's learned projections U ``[d, r]``, trained by ``StiefelMuon``."""


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
    """Muon for 2-D weights: ``p <- p (1 - lr wd) - lr max(1, rows/cols)^0.5 NS(nesterov(m))``,
    with ``lr`` times ``writer_lr_scale`` on the parameters in ``writers`` (``bind_writers``: the
    residual writers upstream of the last boundary).

    Parameters must be whole matrices on this rank (no FSDP sharding of Muon's parameters).
    """

    def __init__(self, params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.0,
                 ns_steps=5, writer_lr_scale=1.0, **_implementation_flags):  # fmt: skip
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        ns_steps=ns_steps, writer_lr_scale=writer_lr_scale)  # fmt: skip
        super().__init__(params, defaults)
        self.writers: set[torch.nn.Parameter] = set()

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mu, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                weight, grad = local_matrix(p), local_matrix(p.grad)
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(grad))
                buf.lerp_(grad, 1 - mu)
                update = grad.lerp(buf, mu) if group["nesterov"] else buf
                ortho = newton_schulz(update.reshape(update.shape[0], -1), group["ns_steps"])
                scale = max(1.0, weight.shape[0] / weight[0].numel()) ** 0.5
                if p in self.writers:
                    scale *= group["writer_lr_scale"]
                weight.mul_(1 - lr * wd)
                weight.add_(ortho.view_as(weight).to(weight.dtype), alpha=-lr * scale)
        return None


class StiefelMuon(torch.optim.Optimizer):
    """Muon on the Stiefel manifold for orthonormal ``U`` ``[d, r]``: with the Riemannian
    gradient ``xi = G - U sym(U^T G)``, momentum ``m <- proj_U(mu m + xi)`` (transported by
    projection), the step ``U <- retract(U - lr proj_U(NS(m)))``: the steepest descent direction
    under the spectral norm (Newton-Schulz's polar factor), projected back to the tangent space,
    then the QR retraction. Deterministic: two copies with equal ``U``, state and gradients stay
    equal. Whole matrices only."""

    def __init__(self, params, lr=0.01, momentum=0.95, ns_steps=5, **_implementation_flags):
        super().__init__(params, dict(lr=lr, momentum=momentum, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None or group["lr"] == 0:
                    continue
                weight = local_matrix(p)
                u, grad = weight.float(), local_matrix(p.grad).float()
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(u))
                buf.copy_(tangent(u, buf.mul_(group["momentum"]).add_(tangent(u, grad))))
                direction = tangent(u, newton_schulz(buf, group["ns_steps"]))
                weight.copy_(retract(u - group["lr"] * direction).to(weight.dtype))
        return None


class SubspaceAdamW(torch.optim.AdamW):
    """AdamW whose constrained weights follow ``rule`` (``"rowwise"`` or ``"project"``).

    ``bind`` tells it which parameters are constrained (``(weight, kind)`` pairs from
    ``ProtocolModel.constrained_weights``) and where the current ``U`` lives (a callable, since
    subspace updates replace it; it returns None for the dense twin: no projection). Unbound, it
    is plain AdamW. A zero-lr step (TorchTitan's optimizer-state materialization) leaves every
    parameter bit-identical.
    """

    def __init__(self, params, rule: str = "rowwise", **adamw_kwargs):
        super().__init__(params, **adamw_kwargs)
        self.rule = rule
        self.constrained: dict[torch.nn.Parameter, str] = {}
        self.basis_fn = lambda: None

    def bind(self, constrained: dict[torch.nn.Parameter, str], basis_fn) -> None:
        owned = {p for group in self.param_groups for p in group["params"]}
        self.constrained = {p: kind for p, kind in constrained.items() if p in owned}
        self.basis_fn = basis_fn

    @torch.no_grad()
    def step(self, closure=None):
        if self.rule == "project":
            super().step(closure)
            self._project_constrained()
            return None
        hidden = {p: p.grad for p in self.constrained if p.grad is not None}
        for p in hidden:
            p.grad = None
        try:
            super().step(closure)
        finally:
            for p, grad in hidden.items():
                p.grad = grad
        for group in self.param_groups:
            for p in group["params"]:
                if p in hidden:
                    self._rowwise_update(p, group)
        return None

    def _project_constrained(self) -> None:
        basis = self.basis_fn()
        if basis is None:
            return
        for group in self.param_groups:
            if group["lr"] == 0:
                continue
            for p in group["params"]:
                if p in self.constrained:
                    project_(local_matrix(p), basis, self.constrained[p])

    def _rowwise_update(self, p: torch.nn.Parameter, group: dict) -> None:
        """One row-wise step on ``p`` (writer ``[d, in]``: v per column ``i``; embedding
        ``[V, d]``: v per row)."""
        kind, basis = self.constrained[p], self.basis_fn()
        weight, grad = local_matrix(p), local_matrix(p.grad).float()
        if basis is not None:
            u = basis.detach().float()
            grad = u @ (u.T @ grad) if kind == "writer" else (grad @ u) @ u.T
        feature_axis = 0 if kind == "writer" else 1  # the axis that lives in span(U)
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(weight, dtype=torch.float32)
            state["exp_avg_sq_shared"] = torch.zeros(
                weight.shape[1 - feature_axis], dtype=torch.float32, device=weight.device
            )
        beta1, beta2 = group["betas"]
        lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
        state["step"] += 1
        step = float(state["step"])
        state["exp_avg"].lerp_(grad, 1 - beta1)
        v = state["exp_avg_sq_shared"]
        v.mul_(beta2).add_(grad.square().mean(dim=feature_axis), alpha=1 - beta2)
        denom = (v / (1 - beta2**step)).sqrt_().add_(eps)
        denom = denom.unsqueeze(feature_axis)
        weight.mul_(1 - lr * wd)
        weight.addcdiv_(state["exp_avg"].to(weight.dtype), denom, value=-lr / (1 - beta1**step))


def bind_writers(optimizers: OptimizersContainer, model_parts) -> None:
    """Tell every ``Muon`` which of its parameters are residual writers upstream of the last
    boundary (``writer_lr_scale``): ``constrained_weights``' writers, listed in every mode."""
    writers = {w for part in model_parts for w, kind in part.constrained_weights()
               if kind == "writer"}  # fmt: skip
    for optimizer in optimizers:
        if isinstance(optimizer, Muon):
            owned = {p for group in optimizer.param_groups for p in group["params"]}
            optimizer.writers = writers & owned


def bind_subspace(optimizers: OptimizersContainer, model_parts) -> None:
    """Tell every ``SubspaceAdamW`` which of its parameters are constrained and where U is."""
    for part in model_parts:
        constrained = dict(part.constrained_weights())

        def basis_fn(part=part):
            return part.basis if part.subspace else None

        for optimizer in optimizers:
            if isinstance(optimizer, SubspaceAdamW):
                optimizer.bind(constrained, basis_fn)


@dataclass(frozen=True, kw_only=True)
class OptimizerEntry:
    """One ``[optimizer] name``: what every part of the plugin needs to know about it."""

    factory: Callable[..., torch.optim.Optimizer]
    """``factory(param_groups, **kwargs)``: the optimizer of every parameter (of every parameter
    outside the block matrices when ``matrix_factory`` is set), with AdamW's ``[optimizer]``
    keys (lr, betas, eps, weight_decay)."""
    group: str
    """The name TorchTitan's container groups and logs its parameters under."""
    matrix_factory: Callable[..., torch.optim.Optimizer] | None = None
    """The optimizer of the block matrices (``BLOCK_MATRICES``), with the ``muon_*`` keys."""
    matrix_group: str = ""
    parametrization: Parametrization = "factor"
    """``factor``: the constrained writers are the k-wide factors A (W = U A); ``full``:
    full-width, kept in span(U) by the optimizer (``SubspaceAdamW.bind``)."""
    whole_matrices: bool = False
    """Needs each parameter whole on its rank (no FSDP sharding)."""
    first_moments: tuple[str, ...] = ()
    """State keys shaped like the parameter and linear in its basis (rotated or projected with
    it by a subspace update)."""
    second_moments: tuple[str, ...] = ()
    """State keys of elementwise squares (rotated by squared entries, factor parametrization)."""
    state_bytes: int = 8
    """Optimizer-state bytes per parameter, an upper bound (the planner's memory)."""
    dense_twin: str | None = None
    """The ``[optimizer] name`` of the fair dense twin (None: this one)."""

    def factories(self) -> dict[str, Callable[..., torch.optim.Optimizer]]:
        groups = {self.group: self.factory}
        if self.matrix_factory is not None:
            groups[self.matrix_group] = self.matrix_factory
        return groups


OPTIMIZERS: dict[str, OptimizerEntry] = {}
"""The optimizers by ``[optimizer] name``, in the order the studies list them."""


def register_optimizer(name: str, entry: OptimizerEntry) -> None:
    """Make ``entry`` selectable as ``[optimizer] name``."""
    OPTIMIZERS[name] = entry


_ADAM_MOMENTS = {"first_moments": ("exp_avg",), "second_moments": ("exp_avg_sq",)}
register_optimizer("adamw", OptimizerEntry(factory=torch.optim.AdamW, group="AdamW",
                                           **_ADAM_MOMENTS))  # fmt: skip
register_optimizer(
    "adamw_rowwise",
    OptimizerEntry(
        factory=partial(SubspaceAdamW, rule="rowwise"), group="RowwiseAdamW",
        parametrization="full", whole_matrices=True, first_moments=("exp_avg",),
    ),
)  # fmt: skip
register_optimizer(
    "muon",
    OptimizerEntry(
        factory=torch.optim.AdamW, group="AdamW", matrix_factory=Muon, matrix_group="Muon",
        whole_matrices=True, first_moments=("exp_avg", "momentum_buffer"),
        second_moments=("exp_avg_sq",),
    ),
)  # fmt: skip
register_optimizer(
    "adamw_project",
    OptimizerEntry(
        factory=partial(SubspaceAdamW, rule="project"), group="ProjectedAdamW",
        parametrization="full", whole_matrices=True, dense_twin="adamw", **_ADAM_MOMENTS,
    ),
)  # fmt: skip


def moment_keys(kind: str) -> set[str]:
    """Every registered optimizer's ``first`` or ``second`` moment state keys."""
    return {key for e in OPTIMIZERS.values() for key in getattr(e, f"{kind}_moments")}


class GuardedOptimizers(OptimizersContainer):
    """TorchTitan's optimizer container that refuses non-finite steps.

    Before each step every rank reads the global gradient norm (finite iff every gradient of
    every rank is), so the whole job skips or stops together. A non-finite step is never
    applied: it is skipped (gradients dropped) up to ``skip_nonfinite_steps`` times in a run,
    then ``NonFiniteError`` stops the run before the step's checkpoint, so the last good
    checkpoint stays the newest one. The LR schedule still advances on a skipped step.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        skip_nonfinite_steps: int = 0
        delay_compensation: float = 0.0
        """``[optimizer] delay_compensation`` (``_compensate``)."""
        weight_prediction: float = 0.0
        """``[optimizer] weight_prediction`` (``training.delayed``), read by the trainer."""
        name: str = "adamw"
        """The ``[optimizer] name`` (an ``OPTIMIZERS`` key) the param groups come from."""

    current_step: int = 0
    """Set by the trainer before each step; named in the error."""
    subspace = None
    """The ``grassmann.SubspaceTracker`` when subspace updates are on (given by the model
    spec's ``post_optimizer_build_fn``): told about every applied (or skipped) step, right after
    the parameter update; the metrics processor logs its figures."""
    reduced_grad_norm: torch.Tensor | None = None
    """The step's global gradient norm (a device scalar), handed over by the trainer as the
    clipping computed it, before ``step``."""
    boundary_sync = None
    """The ``mapl_sync.BoundarySync`` in ``mapl`` mode: it sums the two copies' gradients of
    every boundary before each step (before the finiteness check), so both copies step alike."""
    delayed = None
    """The ``delayed.DelayedUpdates`` of an ``Async1F1B`` run: ``step`` applies its due updates,
    each one guarded step with its own gradient norm (none when none is due)."""

    def __init__(self, config: Config, *, model_parts):
        super().__init__(config, model_parts=model_parts)
        self.skip_budget = config.skip_nonfinite_steps
        self.delay_compensation = config.delay_compensation
        self.skipped_steps: list[int] = []

    @staticmethod
    def _resolve_optimizer_factory(name: str):
        if name == StiefelMuon.__name__:
            return StiefelMuon
        for entry in OPTIMIZERS.values():
            if name in entry.factories():
                return entry.factories()[name]
        return OptimizersContainer._resolve_optimizer_factory(name)

    def step(self, closure=None):
        if self.delayed is None:
            return self._guarded_step(closure)
        for update in self.delayed.due:
            self.delayed.load(update)
            if self.delay_compensation:
                self._compensate(update.weights)
            self.reduced_grad_norm = update.norm
            self._guarded_step(closure)
        self.delayed.applied()
        return None

    @torch.no_grad()
    def _compensate(self, weights: list[torch.Tensor]) -> None:
        """Delay compensation (DC-ASGD, Zheng et al. 2017, in its adaptive form) of the loaded
        gradients, computed at ``weights`` (in ``delayed.params`` order) and applied to the
        current ones: ``g += lambda * g * g * (W_now - W_then) / (sqrt(v) + eps)``, a first-order
        step of the gradient from where it was computed to where it is applied (the diagonal
        Hessian approximated by ``g * g``), with ``v`` the parameter's bias-corrected AdamW second
        moment as the mean square. Parameters without one (Muon's matrices, before their first
        step) keep their gradient. After clipping: the norm and the non-finite guard see the
        gradient as computed."""
        then = {id(p): w for p, w in zip(self.delayed.params, weights, strict=True)}
        for optimizer in self.optimizers:
            for group in optimizer.param_groups:
                for p in group["params"]:
                    state = optimizer.state.get(p, {})
                    if "exp_avg_sq" not in state or p.grad is None:
                        continue
                    corrected = 1 - torch.pow(group["betas"][1], state["step"])  # no host sync
                    rms = (state["exp_avg_sq"] / corrected).sqrt() + group["eps"]
                    g = p.grad
                    shift = g * g * (p.detach() - then[id(p)].detach()) / rms
                    g.add_(shift, alpha=self.delay_compensation)

    def _guarded_step(self, closure=None):
        """One optimizer step over the parameters' gradients, refused when they are not finite
        (class docstring)."""
        if self.boundary_sync is not None:
            self.boundary_sync.sum_gradients()
        if self._gradients_finite():
            super().step(closure)
            if self.subspace is not None:
                self.subspace.after_step(self.current_step)
            return None
        if self.subspace is not None:
            self.subspace.discard()
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
        """Whether every gradient of every rank is finite, read from the global gradient norm
        the step's clipping already reduced over every rank (``step.StepClipping``: the
        pipeline all-reduce over the per-stage norms, each a full norm over its data-parallel
        shards): a norm is finite iff every gradient it covers is. No collective of its own,
        one host read per step."""
        return bool(torch.isfinite(self.reduced_grad_norm))


@dataclass(kw_only=True, slots=True)
class OptimizerSettings:
    """TOML table ``[optimizer]``: one optimizer over all parameters."""

    name: str = "muon"
    """An ``OPTIMIZERS`` key (``adamw``, ``adamw_rowwise``, ``muon``, ``adamw_project``, ...).
    Default ``muon``: the best of the subspace ablation (results/subspace_ablation)."""
    lr: float = 8e-4
    """AdamW's learning rate (with ``muon``: for the embedding, head and norms)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    implementation: Literal["auto", "for-loop", "foreach", "fused"] = "auto"
    """AdamW kernels; ``auto``: ``fused`` on an accelerator, ``foreach`` on CPU."""
    skip_nonfinite_steps: int = 0
    """Non-finite steps to skip before the run stops (0: stop at the first)."""
    delay_compensation: float = 0.0
    """Under the asynchronous schedule (``Async1F1B``, each gradient applied one step late):
    ``lambda`` of the DC-ASGD correction of the AdamW-updated parameters' gradients
    (``GuardedOptimizers._compensate``); 0: none."""
    weight_prediction: float = 0.0
    """Under ``Async1F1B``: ``a`` of the weight prediction (``training.delayed``): a batch whose
    forward runs while the previous batch's update is pending runs on the weights extrapolated by
    ``a`` times the last update; 0: none, 1: the pending update predicted to repeat the last."""
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    writer_lr_scale: float = 1.0
    """The matrix optimizer's step on the residual writers upstream of the last boundary
    (``wo`` and ``w2`` of every block outside the last stage: the ones the subspace mode
    constrains), as a multiple of ``muon_lr``; the same matrices in every mode, so a dense twin
    takes the same scale."""

    RANGES: ClassVar[Ranges] = {
        "name": OneOf(OPTIMIZERS),
        "lr": POSITIVE,
        "betas": Range(low=0, high=1, high_open=True),
        "eps": POSITIVE,
        "weight_decay": AT_LEAST_0,
        "skip_nonfinite_steps": AT_LEAST_0,
        "delay_compensation": AT_LEAST_0,
        "weight_prediction": AT_LEAST_0,
        "muon_lr": POSITIVE,
        "muon_momentum": Range(low=0, high=1, high_open=True),
        "muon_weight_decay": AT_LEAST_0,
        "writer_lr_scale": POSITIVE,
    }

    def __post_init__(self) -> None:
        require(
            len(self.betas) == 2,
            f"optimizer.betas = {self.betas}: expected two values [beta1, beta2]",
        )
        require(
            self.writer_lr_scale == 1.0 or self.entry.matrix_factory is not None,
            f"optimizer.writer_lr_scale = {self.writer_lr_scale}: only a matrix optimizer reads it "
            f"(optimizer.name = {self.name!r} has none; use 'muon')",
        )

    @property
    def entry(self) -> OptimizerEntry:
        return OPTIMIZERS[self.name]

    @property
    def parametrization(self) -> str:
        """The writer parametrization this optimizer trains (``protocol_models.model.model``)."""
        return self.entry.parametrization

    def _resolved_implementation(self) -> str:
        if self.implementation != "auto":
            return self.implementation
        from protocol_models.tools.cpu_shim import bound_device

        return "foreach" if bound_device() == "cpu" else "fused"

    def to_container_config(self, projection_lr: float | None = None) -> GuardedOptimizers.Config:
        """TorchTitan's container config; ``projection_lr``: MAPL's projections (``PROJECTIONS``)
        are a ``StiefelMuon`` group with that step and ``muon_momentum``."""
        kwargs = {
            "lr": self.lr,
            "betas": tuple(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
        }
        entry = self.entry
        groups = [ParamGroupConfig(pattern=".*", optimizer_name=entry.group,
                                   optimizer_kwargs=kwargs)]  # fmt: skip
        if entry.matrix_factory is not None:
            muon = {"lr": self.muon_lr, "momentum": self.muon_momentum,
                    "weight_decay": self.muon_weight_decay,
                    "writer_lr_scale": self.writer_lr_scale}  # fmt: skip
            groups.insert(
                0,
                ParamGroupConfig(
                    pattern=BLOCK_MATRICES, optimizer_name=entry.matrix_group,
                    optimizer_kwargs=muon,
                ),
            )  # fmt: skip
        if projection_lr is not None:
            stiefel = {"lr": projection_lr, "momentum": self.muon_momentum}
            groups.insert(0, ParamGroupConfig(pattern=PROJECTIONS, optimizer_name="StiefelMuon",
                                              optimizer_kwargs=stiefel))  # fmt: skip
        return GuardedOptimizers.Config(
            param_groups=groups,
            implementation=self._resolved_implementation(),
            skip_nonfinite_steps=self.skip_nonfinite_steps,
            delay_compensation=self.delay_compensation,
            weight_prediction=self.weight_prediction,
            name=self.name,
        )
