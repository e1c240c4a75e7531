"""Keeping the two copies of every MAPL boundary identical.

The sender's copy of ``U_s``, ``P_s``, ``Q_s`` (``mapl.MaplCodec``) gets the gradient of the
encode, the receiver's that of the decode; the boundary's true gradient is their sum. Before
every optimizer step each side replaces its gradients with ``sender + receiver`` (two addends:
the sum is bitwise the same in either order), so both copies, starting equal, take the same
deterministic step forever. In one process (``protocol.stages`` > 1) both copies are local;
in a pipelined run the two neighbouring stages swap their flattened fp32 gradients in one
batched P2P exchange per step (``numel(U) + numel(P) + numel(Q)`` values each way), metered
as ``wire/sync_bytes`` apart from the activation wire.

With residual vector quantization the sender also refreshes its codebooks from the step's
statistics (EMA k-means) and sends them ``[L, K, r]`` fp32 in the same exchange; the receiver's
codebooks become a copy (the receiver never sees ``c``, so it cannot update them itself).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from protocol_models.model.mapl import MaplCodec, orthonormality_error
from protocol_models.model.model import local_matrix
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
    this rank's stage in it and ``boundaries`` the layout's boundary count (``use_group``);
    ``meter``: counts the bytes this rank sends.
    """

    def __init__(self, model_parts, *, meter: WireMeter | None = None):
        self.group, self.stage, self.meter = None, 0, meter
        self.sides: dict[int, dict[str, MaplCodec]] = {}
        for part in model_parts:
            for layer in part.layers.values():
                for side in ("mapl_out", "mapl_in"):
                    codec = getattr(layer, side, None)
                    if codec is not None:
                        self.sides.setdefault(codec.boundary, {})[side] = codec
        self.boundaries = max(self.sides, default=-1) + 1

    def use_group(self, group, stage: int, n_stages: int) -> None:
        """Pipelined: this rank runs ``stage`` of ``n_stages`` in the pipeline ``group``."""
        self.group, self.stage, self.boundaries = group, stage, n_stages - 1

    def codecs(self) -> list[MaplCodec]:
        return [c for sides in self.sides.values() for c in sides.values()]

    @torch.no_grad()
    def sum_gradients(self) -> None:
        """Replace both copies' gradients of every boundary with ``sender + receiver`` and (RVQ)
        make the sender's refreshed codebooks the receiver's."""
        exchanges, books = [], []
        for boundary, sides in sorted(self.sides.items()):
            if "mapl_out" in sides and sides["mapl_out"].quantized:
                sides["mapl_out"].refresh_codebooks()
            if len(sides) == 2:
                total = _flat_grads(sides["mapl_out"]) + _flat_grads(sides["mapl_in"])
                for codec in sides.values():
                    _assign_grads(codec, total)
                if sides["mapl_in"].quantized:
                    sides["mapl_in"].codebooks.copy_(sides["mapl_out"].codebooks)
                continue
            ((side, codec),) = sides.items()
            mine = _flat_grads(codec)
            peer = self.stage + (1 if side == "mapl_out" else -1)
            exchanges.append((boundary, codec, mine, torch.empty_like(mine), peer))
            if codec.quantized:
                books.append((boundary, codec, side == "mapl_out", peer))
        if not exchanges:
            return
        ops = []
        for boundary, _, mine, theirs, peer in exchanges:
            rank = dist.get_global_rank(self.group, peer)
            ops += [dist.P2POp(dist.isend, mine, rank, self.group),
                    dist.P2POp(dist.irecv, theirs, rank, self.group)]  # fmt: skip
            self._count(boundary, mine)
        for boundary, codec, sending, peer in books:
            rank = dist.get_global_rank(self.group, peer)
            ops.append(dist.P2POp(dist.isend if sending else dist.irecv, codec.codebooks, rank,
                                  self.group))  # fmt: skip
            if sending:
                self._count(boundary, codec.codebooks)
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        for _, codec, mine, theirs, _ in exchanges:
            _assign_grads(codec, mine + theirs)

    def _count(self, boundary: int, sent: torch.Tensor) -> None:
        if self.meter is not None:
            self.meter.sync[boundary] += sent.numel() * sent.element_size()

    def metrics(self) -> dict[str, float]:
        """At log steps, on every rank (one MAX all-reduce over the pipeline group):
        ``mapl/orthonormality``, the largest ``||U^T U - I||_F`` of all copies; with RVQ
        ``mapl/code_perplexity/b{b}``, the mean over boundary b's codebooks of ``exp(entropy)``
        of the last step's code usage (from the sender's copy, which gathers the statistics)."""
        codecs = self.codecs()
        values = torch.full((1 + self.boundaries,), -1.0, device=codecs[0].projection.device)
        values[0] = torch.stack(
            [orthonormality_error(local_matrix(c.projection)) for c in codecs]
        ).max()
        for boundary, sides in self.sides.items():
            sender = sides.get("mapl_out")
            if sender is not None and sender.quantized:
                values[1 + boundary] = sender.code_perplexity()
        if self.group is not None:
            dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.group)
        orthonormality, *perplexities = values.tolist()
        metrics = {"mapl/orthonormality": orthonormality}
        for boundary, value in enumerate(perplexities):
            if value >= 0:
                metrics[f"mapl/code_perplexity/b{boundary}"] = value
        return metrics


__all__ = ["BoundarySync"]
