"""Chunked cross-entropy on the last pipeline stage: the loss without the full logits.

TorchTitan's last stage returns the logits ``[mb, seq, V]`` and its ``CrossEntropyLoss`` reduces
them, so under GPipe every microbatch's logits (the stage output, plus the fp32 copy and
log-softmax autograd saves for the backward) stay alive until that microbatch's backward. With
``[model] loss_chunk_tokens = N`` the model's last stage calls ``chunked_cross_entropy`` instead:
``N`` tokens' logits exist at a time, in the forward and again (recomputed) in the backward, and
the forward returns TorchTitan's summed loss. ``ModelLoss`` is then the trainer's loss function:
it only divides that sum by the global valid-token count, as ``CrossEntropyLoss`` does.

Each chunk's arithmetic is TorchTitan's: logits in the head's compute dtype, an fp32
cross-entropy with sum reduction that skips ``IGNORE_INDEX`` labels, and the logits gradient
cast back to the compute dtype. Only the summation order of the loss and of the head-weight
gradient (accumulated in fp32 over chunks) differs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torchtitan.components.loss import IGNORE_INDEX, BaseLoss
from torchtitan.config import CompileConfig


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """``sum(cross_entropy(hidden @ weight.T, labels))`` over the tokens whose label is not
    ``IGNORE_INDEX``, computed ``chunk_tokens`` tokens at a time.

    ``hidden``: the final-norm output ``[mb, seq, d]``; ``weight``: the LM head ``[V, d]``, in
    the same (compute) dtype; ``labels``: ``[mb, seq]``. Returns an fp32 scalar. The backward
    recomputes each chunk's logits; only ``hidden``, ``weight`` and ``labels`` are saved.
    """
    return _ChunkedCrossEntropy.apply(hidden.flatten(0, 1), weight, labels.flatten(), chunk_tokens)


def _summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TorchTitan's ``cross_entropy_loss`` of one chunk: ``logits`` ``[n, V]``, ``labels``
    ``[n]`` -> the fp32 sum over the labels that are not ``IGNORE_INDEX``."""
    return F.cross_entropy(logits.float(), labels, reduction="sum", ignore_index=IGNORE_INDEX)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """``hidden`` ``[T, d]``, ``weight`` ``[V, d]``, ``labels`` ``[T]`` -> the summed loss."""

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_tokens: int,
    ) -> torch.Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for h, y in zip(hidden.split(chunk_tokens), labels.split(chunk_tokens), strict=True):
            total += _summed_cross_entropy(F.linear(h, weight), y)
        ctx.save_for_backward(hidden, weight, labels)
        ctx.chunk_tokens = chunk_tokens
        return total

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        """Per chunk: recompute the logits, take the cross-entropy's logits gradient
        ``[n, V]`` (compute dtype), then ``d hidden = g @ W`` and ``d W += g^T @ hidden`` (fp32
        accumulator, cast to ``W``'s dtype once)."""
        hidden, weight, labels = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        for start in range(0, len(hidden), ctx.chunk_tokens):
            chunk = slice(start, start + ctx.chunk_tokens)
            h, y = hidden[chunk], labels[chunk]
            logits = F.linear(h, weight).requires_grad_()
            with torch.enable_grad():
                loss = _summed_cross_entropy(logits, y)
                (grad_logits,) = torch.autograd.grad(loss, logits, grad_loss)
            if grad_hidden is not None:
                grad_hidden[chunk] = grad_logits @ weight
            if grad_weight is not None:
                grad_weight += grad_logits.T @ h
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


class ModelLoss(BaseLoss):
    """The trainer's loss function when the model returns its own summed loss (a scalar, see
    ``chunked_cross_entropy``): divided by ``global_valid_tokens`` when given, as TorchTitan's
    ``CrossEntropyLoss`` divides its sum; returned as is otherwise (validation sums)."""

    @dataclass(kw_only=True, slots=True)
    class Config(BaseLoss.Config):
        pass

    def __init__(self, config: Config, *, compile_config: CompileConfig | None = None):
        self.fn = _model_sum


def _model_sum(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss sum the model already computed (``pred``) from ``labels``."""
    return pred
