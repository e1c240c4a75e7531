"""Folding the subspace constraint away: a trained Protocol LLaMA as an ordinary dense LLaMA.

The constraint only shapes training. At inference the first stage's stream start
``F[ids] + E[ids] @ U.T`` (factor) or ``F[ids] + E[ids]`` (full) is one ``V x d`` embedding
table ``F + E U^T`` / ``F + E``, every factored writer ``A`` ``[k, in]`` lifted by ``@ U.T`` is the
ordinary ``W = U A`` ``[d, in]``, and every other weight (the last stage's blocks, the final norm,
the untied head, all of the dense twin and of the lossy-codec runs) is already stock. ``U`` is the
checkpoint's (subspace updates may have rotated it); ``F`` is regenerated from the seed, rounded to
``table_dtype`` exactly as the run stored it.

Tensors keep TorchTitan's names and come out in fp32, one group at a time (the embedding, then
each block, then norm and head), so a caller never holds the whole model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from protocol_models.model import subspace
from protocol_models.model.model import _DTYPES, ProtocolModel
from protocol_models.tools.errors import UserError

TensorSource = Callable[[list[str]], dict[str, torch.Tensor]]
"""``names -> {name: tensor}``: a checkpoint (``CheckpointTensors.load``) or a state dict."""

EMBEDDING = "tok_embeddings.weight"
HEAD = ("norm.weight", "lm_head.weight")


def expected_shapes(model_config: ProtocolModel.Config) -> dict[str, tuple[int, ...]]:
    """``name -> shape`` of every tensor a checkpoint of this model holds (parameters and the
    persistent buffer ``basis``), from the model built on the meta device."""
    with torch.device("meta"):
        model = model_config.build()
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def check_layout(
    model_config: ProtocolModel.Config, stored: dict[str, tuple[int, ...]], where: str
) -> None:
    """A UserError unless ``stored`` (``name -> shape``) holds every tensor of the model with
    its shape: e.g. a checkpoint of another plugin version or another run's record."""
    for name, shape in expected_shapes(model_config).items():
        if name not in stored:
            raise UserError(
                f"{where} has no tensor {name!r}: it is not a checkpoint of the model its run "
                "record describes (another run, or another version of protocol_models)"
            )
        if tuple(stored[name]) != shape:
            raise UserError(
                f"{where}: {name!r} has shape {list(stored[name])}, the run record's model has "
                f"{list(shape)} (another run, or another version of protocol_models)"
            )


def dense_groups(
    model_config: ProtocolModel.Config, load: TensorSource, table_sha256: bytes | None = None
) -> Iterator[dict[str, torch.Tensor]]:
    """The dense LLaMA's tensors, TorchTitan-named, fp32, in groups: ``{EMBEDDING}``, each
    block's ``layers.<i>.*`` in order, then ``{norm.weight, lm_head.weight}``.

    ``table_sha256``: the digest of F the run stored in its checkpoint (``train_state``); the
    regenerated F must match it (a record with another seed or table dtype is a UserError)."""
    names = list(expected_shapes(model_config))
    subspace_mode = model_config.mode == "subspace"
    basis = load(["basis"])["basis"].float() if subspace_mode else None
    embedding = load([EMBEDDING])[EMBEDDING]
    yield {EMBEDDING: _embedding(model_config, embedding, basis, table_sha256)}
    for layer_id, block in enumerate(model_config.layers):
        prefix = f"layers.{layer_id}."
        group = {n: t.float() for n, t in load([n for n in names if n.startswith(prefix)]).items()}
        if block.factored:
            for writer in ("attention.wo.weight", "feed_forward.w2.weight"):
                group[prefix + writer] = basis @ group[prefix + writer]  # W = U A: [d, in]
        yield group
    yield {n: t.float() for n, t in load(list(HEAD)).items()}


def _embedding(
    model_config: ProtocolModel.Config,
    weight: torch.Tensor,
    basis: torch.Tensor | None,
    table_sha256: bytes | None,
) -> torch.Tensor:
    """``[V, d]``: ``F + E U^T`` (factor, E ``[V, k]``), ``F + E`` (full), ``E`` (dense)."""
    if basis is None:
        return weight.float()
    c = model_config
    _, table, digest = subspace.generate(
        c.subspace_seed, c.dim, c.k, c.vocab_size, table_dtype=_DTYPES[c.table_dtype]
    )
    if table_sha256 is not None and digest != table_sha256:
        raise UserError(
            f"the token table F that protocol.seed = {c.subspace_seed} (table_dtype "
            f"{c.table_dtype}) generates is not the one this checkpoint was trained with (sha256 "
            f"{digest.hex()[:12]} vs {table_sha256.hex()[:12]}): the run record is another run's"
        )
    dense = table.float()  # fp32 F is not copied: the sum below is in place
    dense += weight.float() @ basis.T if c.parametrization == "factor" else weight.float()
    return dense
