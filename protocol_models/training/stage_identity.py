"""What every pipeline stage must share to decode its neighbours' messages, as the start-up
check (``ProtocolTrainer.check_stages_agree``) compares it across the ranks."""

from __future__ import annotations

import hashlib

import torch

from protocol_models.model.layout import stage_layer_ranges


def subspace_digest(model: torch.nn.Module) -> str:
    """sha256 of this stage's current U and of F as generated ("" in dense mode). U is
    ``[d, k]`` (read back once per check); F's digest was taken while generating it."""
    if not getattr(model, "anchored", False):
        return ""
    digest = hashlib.sha256(model.basis.detach().cpu().contiguous().numpy().tobytes())
    digest.update(model.table_sha256)
    return digest.hexdigest()


def protocol_identity(config) -> str:
    """What every pipeline stage must share to decode its neighbours' messages, as the text a
    mismatch error shows: the subspace (mode, k, seed, width), the blocks per stage (which blocks
    each stage runs and which are constrained) and, in a lossy mode, the codec settings (they fix
    the payload shapes and the backward)."""
    protocol = config.protocol
    identity = f"mode={protocol.mode}, k={protocol.k}, seed={protocol.seed}, dim={config.model.dim}"
    ranges = stage_layer_ranges(
        config.model.n_layers, config.layout_stages, protocol.layers_per_stage
    )
    identity += f", layers per stage {[len(r) for r in ranges]}"
    if protocol.mode == "mapl":
        identity += f", anchor_rank={protocol.anchor_rank}, rvq_stages={protocol.rvq_stages}"
        if protocol.rvq_stages:
            identity += f", rvq_codebook={protocol.rvq_codebook}, rvq_decay={protocol.rvq_decay}"
    codec = config.codec.identity(protocol.mode)
    if codec:
        identity += f", codec {protocol.mode}({codec})"
    return identity


__all__ = ["protocol_identity", "subspace_digest"]
