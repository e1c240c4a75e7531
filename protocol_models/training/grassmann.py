"""Synchronized subspace updates: U moves on the Grassmann manifold Gr(k, d).

Objective (**G1**, loss descent): U is treated as a parameter shared by every
constrained writer and the embedding. Its Euclidean gradient ``G = dL/dU`` ``[d, k]`` is what
autograd accumulates in ``basis.grad`` through the lifts ``a @ U^T`` and ``E_k @ U^T`` (factor
parametrization; the codec uses a detached U, whose contributions cancel while the invariant
holds), or ``sum_W dL/dW (W^T U) + sum_E (dL/dE)^T (E U)`` for full-width weights, which carry
the same information. G1 over G2 (gradient-subspace tracking) because it is the gradient of the
training objective itself, comes out of the ordinary backward with no activation hooks, and
needs one ``[d, k]`` accumulator per rank; G2 needs the *unprojected* ``[d, in]`` gradient of
every factorized writer, i.e. the memory variant A saves.

Step: every ``update_every`` optimizer steps (GPipe has flushed: every microbatch of the step is
done on every stage), the window sums are all-reduced (summed) over all ranks, and rank 0 takes
a geodesic step against the Riemannian gradient ``xi = (I - U U^T) G``::

    -xi = P S Q^T (thin SVD),  U' = U Q cos(t S) Q^T + P sin(t S) Q^T,  t = angle / max(S)

so the largest principal angle between U and U' is exactly ``update_angle_deg`` (a normalized
step: the scale of G depends on the loss and the window, the angle does not). U' is computed in
float64, cast to fp32 and broadcast from rank 0: every stage switches to bit-identical values.

Re-expression (``R = U'^T U`` ``[k, k]``): every weight is re-projected onto the new
subspace, ``W <- U' U'^T W``. Factor parametrization: ``A <- R A``, ``E_k <- E_k R^T``, Adam and
Muon first moments rotate alike, Adam's second moment ``v <- (R*R) v`` (elementwise squares: the
usual heuristic, exact when R is a signed permutation). Full width: ``W <- U'U'^T W``,
``E <- E U'U'^T``, first moments projected alike, second moments unchanged (the row-wise one is
basis-free; stock AdamW's is left as is). The function changes only by this re-projection.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torchtitan.tools.logging import logger

from protocol_models.model.model import ProtocolModel, local_matrix, project_
from protocol_models.model.subspace import orthonormalize
from protocol_models.training.optimizers import moment_keys


def geodesic_step(basis: torch.Tensor, grad: torch.Tensor, angle_deg: float) -> torch.Tensor:
    """U' on the geodesic from ``basis`` ``[d, k]`` against the Riemannian gradient of ``grad``,
    with largest principal angle ``angle_deg``. Returns ``basis`` unchanged when ``grad`` has no
    component outside span(U) (below 1e-6 of its norm: fp32 rounding). Float64 inside, fp32 out.

    Most of ``dL/dU`` usually lies inside span(U), so the tangent part is a small difference:
    the basis is re-orthonormalized first and the projection applied twice, and U' gets a final
    QR, so that U'^T U' = I to fp32 rounding however many updates a run makes.
    """
    u, g = orthonormalize(basis.double()), grad.double()
    tangent = g - u @ (u.T @ g)
    tangent = tangent - u @ (u.T @ tangent)
    p, s, qt = torch.linalg.svd(-tangent, full_matrices=False)
    if s[0] <= 1e-6 * g.norm():
        return basis.clone()
    ts = s * (math.radians(angle_deg) / s[0])
    rotated = (u @ qt.T) * torch.cos(ts) @ qt + p * torch.sin(ts) @ qt
    return orthonormalize(rotated).float().contiguous()


def largest_angle_deg(old: torch.Tensor, new: torch.Tensor) -> float:
    """Largest principal angle between span(old) and span(new), in degrees."""
    cosines = torch.linalg.svdvals(old.double().T @ new.double())
    return math.degrees(math.acos(float(cosines.min().clamp(-1.0, 1.0))))


def orthonormality(basis: torch.Tensor) -> float:
    """``max |U^T U - I|``."""
    u = basis.double()
    return float(
        (u.T @ u - torch.eye(u.shape[1], dtype=torch.float64, device=u.device)).abs().max()
    )


def euclidean_grad(model: ProtocolModel) -> torch.Tensor:
    """This stage's ``dL/dU`` ``[d, k]`` for the gradients currently held (zeros if none)."""
    u = model.basis.detach()
    if model.factored:
        return model.basis.grad.detach().clone() if model.basis.grad is not None else u * 0
    total = torch.zeros_like(u)
    for weight, kind in model.constrained_weights():
        if weight.grad is None:
            continue
        w, g = local_matrix(weight).detach().float(), local_matrix(weight.grad).float()
        total += g @ (w.T @ u) if kind == "writer" else g.T @ (w @ u)
    return total


@torch.no_grad()
def reexpress(model: ProtocolModel, optimizers, new_basis: torch.Tensor) -> None:
    """Switch ``model`` (one stage) and its optimizer states from its current U to
    ``new_basis``, re-projecting every constrained weight (see the module docstring)."""
    old = model.basis.detach()
    rotation = (new_basis.double().T @ old.double()).float()  # R = U'^T U
    states = {}
    for optimizer in optimizers:
        states.update(optimizer.state)
    first, second = moment_keys("first"), moment_keys("second")
    for weight, kind in model.constrained_weights():
        state = states.get(weight, {})
        if model.factored:
            _rotate(local_matrix(weight), rotation, kind)
            for name in first & state.keys():
                _rotate(local_matrix(state[name]), rotation, kind)
            for name in second & state.keys():
                _rotate(local_matrix(state[name]), rotation.square(), kind)
        else:
            project_(local_matrix(weight), new_basis, kind)
            for name in first & state.keys():
                project_(local_matrix(state[name]), new_basis, kind)
    model.basis.copy_(new_basis)


def _rotate(t: torch.Tensor, rotation: torch.Tensor, kind: str) -> None:
    """``writer`` ``[k, in]``: ``t <- R t``; ``embedding`` ``[V, k]``: ``t <- t R^T``."""
    rotated = rotation @ t.float() if kind == "writer" else t.float() @ rotation.T
    t.copy_(rotated.to(t.dtype))


class SubspaceTracker:
    """Accumulates ``dL/dU`` over a window and runs the synchronized update every
    ``update_every`` steps. Its window sum is part of the checkpoint (per rank), so a resumed
    run makes bit-identical updates."""

    def __init__(self, model_parts, optimizers, *, update_every: int, angle_deg: float):
        self.model_parts = model_parts
        self.optimizers = optimizers
        self.update_every, self.angle_deg = update_every, angle_deg
        basis = model_parts[0].basis
        self.window = torch.zeros_like(basis.detach())
        self.updates = 0
        self.last_angle_deg = 0.0

    def after_step(self, step: int) -> None:
        """Add this step's gradient to the window; at a window end, update U everywhere."""
        for part in self.model_parts:
            self.window += euclidean_grad(part)
            part.basis.grad = None
        if step % self.update_every == 0:
            self._update(step)

    def discard(self) -> None:
        """A skipped (non-finite) step contributes nothing."""
        for part in self.model_parts:
            part.basis.grad = None

    def _update(self, step: int) -> None:
        window = self.window.clone()
        if dist.is_initialized():
            dist.all_reduce(window)
        old = self.model_parts[0].basis.detach().clone()
        new = geodesic_step(old, window, self.angle_deg)
        if dist.is_initialized():
            dist.broadcast(new, src=0)
        for part in self.model_parts:
            reexpress(part, self.optimizers, new)
        self.window.zero_()
        self.updates += 1
        self.last_angle_deg = largest_angle_deg(old, new)
        logger.info(
            f"subspace update {self.updates} at step {step}: largest principal angle "
            f"{self.last_angle_deg:.3f} deg, |U'^T U' - I|max {orthonormality(new):.2e}"
        )

    def metrics(self) -> dict[str, float]:
        return {
            "subspace/update_angle_deg": self.last_angle_deg,
            "subspace/updates": float(self.updates),
            "subspace/orthonormality": orthonormality(self.model_parts[0].basis.detach()),
        }

    def state_dict(self, rank: int) -> dict:
        return {f"subspace_window_rank{rank}": self.window, "subspace_updates": self.updates,
                "subspace_last_angle_deg": self.last_angle_deg}  # fmt: skip

    def load_state_dict(self, state: dict, rank: int) -> None:
        self.window.copy_(state[f"subspace_window_rank{rank}"])
        self.updates = int(state["subspace_updates"])
        self.last_angle_deg = float(state["subspace_last_angle_deg"])
