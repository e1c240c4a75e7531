"""The forward kwargs every pipeline stage receives with a microbatch (training and validation):
token ids never cross the wire, because every rank of a pipeline group reads the same
microbatches."""

from __future__ import annotations

from typing import Any

import torch
from torchtitan.models.common.attention import ScaledDotProductAttention


def add_protocol_kwargs(
    inputs: torch.Tensor, labels: torch.Tensor, extra_kwargs: dict[str, Any], model_config
) -> dict[str, Any]:
    """Forward kwargs every stage receives: the token ids ``[mb, seq]``, with
    ``loss_chunk_tokens`` the labels ``[mb, seq]`` (the last stage computes the loss), and
    positions unless the attention is plain causal SDPA."""
    extra_kwargs["token_ids"] = inputs
    if model_config.loss_chunk_tokens:
        extra_kwargs["labels"] = labels
    inner = model_config.first_attention.inner_attention
    if isinstance(inner, ScaledDotProductAttention.Config):
        extra_kwargs.pop("positions", None)
    return extra_kwargs


__all__ = ["add_protocol_kwargs"]
