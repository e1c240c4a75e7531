"""Keeping the two copies of every MAPL boundary identical.

The sender's copy of ``U_s``, ``P_s``, ``Q_s`` (``mapl.MaplCodec``) gets the gradient of the
encode, the receiver's that of the decode; the boundary's true gradient is their sum. Before
every optimizer step each side replaces its gradients with ``sender + receiver`` (two addends:
the sum is bitwise the same in either order), so both copies, starting equal, take the same
deterministic step forever. In one process (``protocol.stages`` > 1) both copies are local;
in a pipelined run the two neighbouring stages swap their flattened fp32 gradients in one
batched P2P exchange per step (``numel(U) + numel(P) + numel(Q)`` values each way), metered
as ``wire/sync_bytes`` apart from the activation wire.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from protocol_models.mapl import MaplCodec, orthonormality_error
from protocol_models.model import local_matrix
from protocol_models.wire.meter import WireMeter


def _flat_grads(codec: MaplCodec) -> torch.Tensor:
    """The codec's gradients (U, P, Q; zeros where none) as one fp32 vector."""
    return torch.cat(
        [
            local_matrix(p.grad).float().reshape(-1)
            if p.grad is not None
            else torch.zeros(p.numel(), device=p.device)
            for p in codec.parameters()
        ]
    )


def _assign_grads(codec: MaplCodec, flat: torch.Tensor) -> None:
    """Set the codec's gradients from ``flat`` (``_flat_grads``' layout)."""
    offset = 0
    for p in codec.parameters():
        chunk = flat[offset : offset + p.numel()].view(p.shape)
        offset += p.numel()
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        local_matrix(p.grad).copy_(chunk)


class BoundarySync:
    """The MAPL codecs of this rank's model parts, paired by boundary, and their gradient sum.

    ``group``: the pipeline process group (None: one process, both copies local); ``stage``:
    this rank's stage in it; ``meter``: counts the bytes this rank sends.
    """

    def __init__(self, model_parts, *, group=None, stage: int = 0, meter: WireMeter | None = None):
        self.group, self.stage, self.meter = group, stage, meter
        self.sides: dict[int, dict[str, MaplCodec]] = {}
        for part in model_parts:
            for layer in part.layers.values():
                for side in ("mapl_out", "mapl_in"):
                    codec = getattr(layer, side, None)
                    if codec is not None:
                        self.sides.setdefault(codec.boundary, {})[side] = codec

    def codecs(self) -> list[MaplCodec]:
        return [c for sides in self.sides.values() for c in sides.values()]

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Replace both copies' gradients of every boundary with ``sender + receiver``."""
        exchanges = []
        for boundary, sides in sorted(self.sides.items()):
            if len(sides) == 2:
                total = _flat_grads(sides["mapl_out"]) + _flat_grads(sides["mapl_in"])
                for codec in sides.values():
                    _assign_grads(codec, total)
                continue
            ((side, codec),) = sides.items()
            mine = _flat_grads(codec)
            peer = self.stage + (1 if side == "mapl_out" else -1)
            exchanges.append((boundary, codec, mine, torch.empty_like(mine), peer))
        if not exchanges:
            return
        ops = []
        for boundary, _, mine, theirs, peer in exchanges:
            rank = dist.get_global_rank(self.group, peer)
            ops += [dist.P2POp(dist.isend, mine, rank, self.group),
                    dist.P2POp(dist.irecv, theirs, rank, self.group)]  # fmt: skip
            if self.meter is not None:
                self.meter.sync[boundary] += mine.numel() * mine.element_size()
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        for _, codec, mine, theirs, _ in exchanges:
            _assign_grads(codec, mine + theirs)

    def metrics(self) -> dict[str, torch.Tensor]:
        """``mapl/orthonormality``: the largest ``||U^T U - I||_F`` of this rank's copies (a 0-d
        device tensor; read at log steps only)."""
        errors = [orthonormality_error(local_matrix(c.projection)) for c in self.codecs()]
        return {"mapl/orthonormality": torch.stack(errors).max()} if errors else {}


__all__ = ["BoundarySync"]
