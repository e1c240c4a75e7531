"""``ModelSpec.post_optimizer_build_fn``: what the optimizer container learns once the model and
the optimizers exist (which weights are constrained and where U is, the upstream writers,
MAPL's boundary sync, the subspace updates)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from protocol_models.training.grassmann import SubspaceTracker
from protocol_models.training.mapl_sync import BoundarySync
from protocol_models.training.optimizers import bind_subspace, bind_writers


def after_optimizers_built(optimizers, model_parts, parallel_dims, *, protocol, meter,
                           timeout: timedelta) -> None:  # fmt: skip
    """``ModelSpec.post_optimizer_build_fn``: tell the subspace optimizers which weights are
    constrained and where U is, (``mapl`` mode) give the optimizer container the
    ``BoundarySync`` of the MAPL copies, metered on ``meter``, and (``protocol.update_every`` >
    0, subspace mode) the ``SubspaceTracker`` it runs after every applied step."""
    bind_subspace(optimizers, model_parts)
    bind_writers(optimizers, model_parts)
    sync = BoundarySync(model_parts, meter=meter)
    if sync.sides and parallel_dims.pp_enabled:
        pp_mesh = parallel_dims.get_mesh("pp")
        # a group of its own: on gloo, where sends and receives between two ranks of one group
        # match in order, the next step's early-posted activation receive would take its message
        ranks = dist.get_process_group_ranks(pp_mesh.get_group())
        group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
        sync.use_group(group, pp_mesh.get_local_rank(), pp_mesh.size())
    optimizers.boundary_sync = sync if sync.sides else None
    if protocol.update_every > 0 and model_parts[0].subspace:
        optimizers.subspace = SubspaceTracker(
            model_parts,
            optimizers,
            update_every=protocol.update_every,
            angle_deg=protocol.update_angle_deg,
        )


__all__ = ["after_optimizers_built"]
