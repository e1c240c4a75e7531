"""A trained model's residual stream at its run's pipeline boundaries, read from its export.

``LlamaForCausalLM(..., output_hidden_states=True)`` returns ``n_layers + 1`` streams:
``hidden_states[0]`` is the token's embedding row (in an exported subspace model, ``F[t] + E[t]
U^T``, its per-token table part), ``hidden_states[i]`` for ``i < n_layers`` the stream after ``i``
blocks (the last entry is after the final norm, and no boundary reads it: every stage holds at
least one block). A boundary after block ``b`` carries ``hidden_states[b]``; what the blocks wrote
there is ``hidden_states[b] - hidden_states[0]``, which in a subspace model lies in span(U) and in
a dense model anywhere. ``boundary_moment`` accumulates the second moment of those vectors over a
run's rows, ``residual_writers`` returns the matrices that wrote them;
``protocol_models.model.spectrum`` measures both.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from protocol_models.model.layout import stage_layer_ranges
from protocol_models.model.spectrum import second_moment
from protocol_models.tools.errors import UserError
from protocol_models.training.run_record import RunRecord


def boundary_blocks(record: RunRecord) -> list[int]:
    """The block count before each pipeline boundary of the run's layout (``[2, 4, 6]`` for 8
    blocks over 4 stages)."""
    ranges = stage_layer_ranges(
        record.model.n_layers, record.stages, record.protocol.layers_per_stage
    )
    return [r.stop for r in ranges[:-1]]


@torch.no_grad()
def boundary_moment(model, batches: Iterable, blocks: list[int],
                    per_document_positions: bool) -> tuple[torch.Tensor, int]:  # fmt: skip
    """The second moment ``[d, d]`` (float64, ``protocol_models.model.spectrum``) of
    ``hidden_states[b] - hidden_states[0]`` over every token of ``batches`` (``({"input",
    "positions"} [batch, seq], labels)``, as ``hf.evaluate.batches`` yields them) at every
    boundary ``b`` of ``blocks``, and how many vectors it sums. ``per_document_positions``: pass
    the rows' per-document positions (flex/varlen runs), as ``evaluate`` does."""
    moment, count = None, 0
    for inputs, _ in batches:
        out = model.model(
            input_ids=inputs["input"],
            position_ids=inputs["positions"] if per_document_positions else None,
            output_hidden_states=True,
        )
        start = out.hidden_states[0].float()
        for b in blocks:
            writes = (out.hidden_states[b].float() - start).flatten(0, 1)
            part = second_moment(writes)
            moment = part if moment is None else moment + part
            count += writes.shape[0]
    if moment is None:
        raise UserError("no full row of tokens to read: use a longer text or a shorter --seq-len")
    return moment, count


def residual_writers(model, blocks: list[int]) -> list[torch.Tensor]:
    """The residual writers upstream of the last boundary, in block order: each block's
    attention output ``o_proj`` and MLP output ``down_proj`` weights ``[d, in]``."""
    layers = model.model.layers[: blocks[-1]] if blocks else []
    return [w.weight.detach() for layer in layers for w in (layer.self_attn.o_proj,
                                                            layer.mlp.down_proj)]  # fmt: skip
