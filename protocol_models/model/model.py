"""The Protocol LLaMA: TorchTitan's llama3 with every upstream residual writer confined to span(U).

Two parametrizations of the residual writers upstream of the last boundary (the attention output
projection ``wo``, the MLP down projection ``w2`` and the token embedding):

* ``factor`` (variant A, ``W = U A``, used with ``adamw`` and ``muon``): ``wo``/``w2``
  are stock TorchTitan ``Linear`` layers with ``out_features = k`` -- their weights *are* the
  factors ``A`` ``[k, in]`` -- and the block lifts their output into the stream with ``@ U.T``.
  The trainable embedding is ``E`` ``[V, k]`` and the stream starts as
  ``x0 = F[ids] + E[ids] @ U.T``. The subspace holds by construction.
* ``full`` (variants B/C, used with ``adamw_rowwise`` and ``adamw_project``): full-width
  ``W`` ``[d, in]`` and ``E`` ``[V, d]``, initialized inside span(U); the optimizer keeps every
  update there (``protocol_models.training.optimizers``). ``x0 = F[ids] + E[ids]``.

Norms are pre-norm (they only touch branch inputs), there are no biases, no dropout, no tied
head; so by induction ``x - F[ids]`` lies in span(U) at every boundary and
``c = (x - F[ids]) @ U`` is lossless. ``U`` is a persistent buffer: it starts as the seeded basis
(or the one in ``[protocol] basis_file``) and may later be rotated by subspace updates
(``protocol_models.training.grassmann``), so checkpoints carry it; ``F`` never changes and is
regenerated from the seed.

The last stage's blocks, the final norm and the (untied) LM head stay full rank. In ``dense``
mode the same recipe builds the unconstrained twin: stock llama3 blocks and a ``d``-wide wire.
A lossy ``[protocol] mode`` trains that dense model too; its codec lives on the wire
(``protocol_models.wire``), never in this module.

``resbm`` mode (Residual Bottleneck Models, Aboudib et al., arXiv 2604.11947) builds the dense
model with a learned autoencoder across every boundary, ``h = k`` wide: the last block before a
boundary ends with an encoder in its MLP branch and returns ``b = enc(silu(ffn)) + x[..., :h]``
``[mb, seq, h]`` (the stage output, what crosses); the first block after it feeds
``relu(dec(b))`` ``[mb, seq, d]`` to its attention and restarts the stream from ``b``
zero-padded to ``d`` (``blocks.ResbmBlock``).

``projected`` mode (constrain only what crosses) builds the dense model, anchored on the same
``F`` and ``U``: the stream starts as ``x0 = F[ids] + E[ids]`` (``E`` ``[V, d]``, the dense
twin's embedding), every block writes full width, and only at a boundary is the stream projected:
the last block before it returns ``c = (x - F[ids]) @ U`` ``[mb, seq, k]`` and the first block
after it rebuilds ``x_hat = F[ids] + c @ U.T`` ``[mb, seq, d]``, i.e. ``F + U U^T (x - F)``.
The subspace mode's model is the special case whose writers all write into span(U). The same
bytes cross as in ``subspace`` mode, forward and backward; what the projection discards inside
a stage is capacity the constrained model never had.

``mapl`` mode (MAPL, Janson et al., arXiv 2606.05484) builds the dense model with a
``mapl.MaplCodec`` on each side of every boundary: the last block before it returns
``c = (x - P[t] Q) U`` ``[mb, seq, r]`` (``r = k``), the first block after it rebuilds
``x_hat = c U^T + P[t] Q`` ``[mb, seq, d]`` before its attention.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchtitan.models.common import (
    ComplexRoPE,
    Embedding,
    Linear,
    RMSNorm,
    compute_ffn_hidden_dim,
)
from torchtitan.models.common.attention import (
    FlexAttention,
    ScaledDotProductAttention,
    VarlenAttention,
)
from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.llama3.model import Llama3Model
from torchtitan.protocols.model_spec import ModelSpec

from protocol_models.model import subspace
from protocol_models.model.blocks import ProtocolBlock, trunc_normal
from protocol_models.model.boundary import BOUNDARIES, anchored, label
from protocol_models.model.layout import stage_layer_ranges
from protocol_models.model.loss import chunked_cross_entropy
from protocol_models.tools.errors import UserError, require
from protocol_models.tools.ranges import AT_LEAST_1, POSITIVE, Range, Ranges

if TYPE_CHECKING:
    from protocol_models.training.protocol import ProtocolSettings

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
Attention = Literal["sdpa", "flex", "varlen"]


@dataclass(kw_only=True, slots=True)
class ModelArch:
    """The LLaMA architecture (TOML table ``[model]``)."""

    dim: int = 256
    n_layers: int = 8
    n_heads: int = 4
    n_kv_heads: int | None = None
    vocab_size: int = 8192
    ffn_hidden_dim: int | None = None
    """SwiGLU hidden width; default LLaMA's ``8/3 * dim`` rounded up to ``multiple_of``."""
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    rope_theta: float = 500000.0
    attention: Attention = "sdpa"
    """``sdpa`` (causal, CPU friendly), or ``flex``/``varlen`` (per-document masks, GPU)."""
    init_std: float = 0.02
    loss_chunk_tokens: int = 0
    """The last stage computes the loss this many tokens at a time and never holds the full
    logits ``[mb, seq, V]``; the backward recomputes each chunk's (``protocol_models.model.loss``).
    0: TorchTitan's stock head and ``CrossEntropyLoss`` on the full logits."""
    freeze_embedding: bool = False
    """The token embedding keeps its initial (random) values: no gradient, no optimizer state.
    A diagnostic: a dense twin whose downstream stages see tokens through a frozen random table,
    as a Protocol Model's do."""

    RANGES: ClassVar[Ranges] = {
        "dim": AT_LEAST_1,
        "n_layers": AT_LEAST_1,
        "n_heads": AT_LEAST_1,
        "n_kv_heads": AT_LEAST_1,
        "vocab_size": AT_LEAST_1,
        "ffn_hidden_dim": AT_LEAST_1,
        "multiple_of": AT_LEAST_1,
        "ffn_dim_multiplier": POSITIVE,
        "rope_theta": POSITIVE,
        "init_std": POSITIVE,
        "loss_chunk_tokens": Range(low=0, note="0 = full logits"),
    }

    def __post_init__(self) -> None:
        require(
            self.dim % self.n_heads == 0,
            f"model.n_heads = {self.n_heads}: must divide model.dim = {self.dim}",
        )
        kv = self.n_kv_heads
        require(
            kv is None or self.n_heads % kv == 0,
            f"model.n_kv_heads = {kv}: must divide model.n_heads = {self.n_heads}",
        )

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden width the blocks use."""
        return self.ffn_hidden_dim or compute_ffn_hidden_dim(
            self.dim, multiple_of=self.multiple_of, ffn_dim_multiplier=self.ffn_dim_multiplier
        )


class ProtocolModel(Llama3Model):
    """Llama3 with the frozen ``U``/``F`` root buffers and the subspace codec in its forward.

    Root-level buffers survive TorchTitan's pipeline split on every stage. ``F`` is
    non-persistent (regenerated from ``subspace_seed`` on every rank); ``U`` starts as the seeded
    basis (or ``basis_file``'s) and is persistent, because subspace updates rotate it. With
    subspace updates on, ``U`` requires grad so that autograd accumulates ``dL/dU`` through the
    lifts and the embedding (the codec uses a detached ``U``: its contributions cancel while the
    invariant holds).
    A non-last stage returns ``c`` ``[mb, seq, k]`` (subspace), ``x`` ``[mb, seq, d]`` (dense)
    ``b`` ``[mb, seq, h]`` (resbm), ``c`` ``[mb, seq, r]`` (mapl) or ``c`` ``[mb, seq, k]``
    (projected; the last three: its last block's output, ``model.blocks``);
    a non-first stage takes that tensor as its positional input and the token ids as a kwarg.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        mode: Literal["subspace", "projected", "dense", "resbm", "mapl"] = "subspace"
        k: int = 8
        subspace_seed: int = 1234
        basis_file: str = ""
        """U from this file instead of the seed (``ProtocolSettings.basis_file``)."""
        table_dtype: Literal["float32", "bfloat16"] = "float32"
        parametrization: Literal["factor", "full"] = "factor"
        track_basis_grad: bool = False
        layers_per_stage: list[int] | None = None
        """Blocks per pipeline stage (``ProtocolSettings.layers_per_stage``; None: near-equal):
        the split ``split_stage`` cuts, via ``stage_layer_ranges``."""
        loss_chunk_tokens: int = 0
        """> 0: the last stage takes ``labels`` and returns the summed cross-entropy, computed
        this many tokens at a time (``ModelArch.loss_chunk_tokens``)."""
        freeze_embedding: bool = False
        """``ModelArch.freeze_embedding``."""

    def __init__(self, config: Config):
        super().__init__(config)
        self.subspace = config.mode == "subspace"
        """Whether the upstream writers are confined to span(U) (the stream is exact at every
        boundary)."""
        self.anchored = anchored(config.mode)
        """Whether the model holds ``U`` and ``F`` (subspace and projected modes)."""
        self.factored = self.subspace and config.parametrization == "factor"
        if config.freeze_embedding and self.tok_embeddings is not None:
            self.tok_embeddings.weight.requires_grad_(False)
        if self.anchored:
            self.register_buffer("basis", torch.empty(config.dim, config.k, dtype=torch.float32))
            self.register_buffer(
                "token_table",
                torch.empty(config.vocab_size, config.dim, dtype=_DTYPES[config.table_dtype]),
                persistent=False,
            )
        self.table_sha256 = b""
        """sha256 of ``F`` as generated (``subspace.generate``); b"" without ``F``."""
        self.initial_basis_sha256 = b""
        """sha256 of ``U`` as initialized (seeded or from ``basis_file``), before any checkpoint
        is loaded or subspace update applied; b"" without ``F``."""
        self.boundary_leak: torch.Tensor | None = None
        """Max ``subspace.leak`` seen at this stage's outgoing boundary since the last reset."""
        self.measure_leak = True
        """Whether the forward measures the leak (three fp32 ``[mb, seq, d]`` temporaries per
        microbatch); ``start_leak_window`` turns it on for log steps only."""
        self.in_microbatch = False
        """True while the pipeline stage computes one of a step's microbatches
        (``WirePipelineStage.forward_one_chunk``), the only forwards whose leak is measured: the
        pipeline's metadata inference before step 1 runs the stages on uninitialised placeholder
        inputs, whose leak means nothing (and reads NaN where the memory holds NaN)."""

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        if not self.anchored:
            return
        device = buffer_device or self.basis.device
        basis, table, self.table_sha256 = subspace.generate(
            self.config.subspace_seed,
            self.config.dim,
            self.config.k,
            self.config.vocab_size,
            device=device,
            table_dtype=_DTYPES[self.config.table_dtype],
        )
        if self.config.basis_file:  # F as seeded, U from the file
            read = subspace.read_basis(self.config.basis_file, self.config.dim, self.config.k)
            basis = read.to(device)
        self.initial_basis_sha256 = hashlib.sha256(basis.cpu().numpy().tobytes()).digest()
        self.basis = basis.requires_grad_(self.config.track_basis_grad)
        self.token_table = table

    def init_states(self, *, buffer_device: torch.device | None = None) -> None:
        """TorchTitan's init, then (``full`` parametrization) every constrained weight is
        projected into span(U): ``W <- U U^T W``, ``E <- E U U^T``."""
        super().init_states(buffer_device=buffer_device)
        if self.subspace and not self.factored:
            with torch.no_grad():
                for param, kind in self.constrained_weights():
                    project_(param, self.basis, kind)

    def constrained_weights(self) -> list[tuple[nn.Parameter, str]]:
        """This stage's residual writers upstream of the last boundary and the token embedding:
        ``(weight, kind)`` with kind ``"writer"`` (``[out, in]``, out-axis in span(U) or
        k coordinates) or ``"embedding"`` (``[V, d]`` rows in span(U), or ``[V, k]``).
        Listed in dense mode too, where the twin's optimizer treats the same matrices alike."""
        weights = [
            (w, "writer")
            for layer in self.layers.values()
            if layer.upstream
            for w in layer.writers()
        ]
        if self.tok_embeddings is not None and any(layer.upstream for layer in self.config.layers):
            weights.append((self.tok_embeddings.weight, "embedding"))
        return weights

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks=None,
        token_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs``: token ids ``[mb, seq]`` on the first stage, else the received boundary
        tensor. ``token_ids`` ``[mb, seq]``: the same ids on every stage (never sent).

        The last stage returns the logits ``[mb, seq, V]``, or with ``loss_chunk_tokens`` the
        fp32 cross-entropy summed over the tokens of ``labels`` ``[mb, seq]`` that are not
        ``IGNORE_INDEX`` (``protocol_models.model.loss.chunked_cross_entropy``)."""
        ids = inputs if self.tok_embeddings is not None else token_ids
        h = self._stream_in(inputs, ids)
        basis = self.basis if self.anchored else None
        table = self.token_table if self.anchored else None
        for layer in self.layers.values():
            h = layer(h, attention_masks, positions, basis=basis, token_ids=ids, table=table)
        if self.norm is None:
            return self._stream_out(h, ids)
        if self.config.loss_chunk_tokens:
            return self._chunked_loss(h, labels)
        return self.lm_head(self.norm(h))

    def _chunked_loss(self, h: torch.Tensor, labels: torch.Tensor | None) -> torch.Tensor:
        """The summed loss of the last stage's stream ``h`` ``[mb, seq, d]`` against ``labels``.

        The head weight is read, not called: the final norm and the head are one FSDP unit
        (TorchTitan's ``apply_fsdp_to_decoder``, applied at every data-parallel degree), so the
        norm's forward has unsharded both, and ``lm_head.weight`` is the unsharded parameter in
        the compute dtype. FSDP completes the unit's forward for the head that did not run, and
        the gradient the loss returns for that parameter is what FSDP reduces after the
        backward, as for the stock head's."""
        if labels is None:
            raise ValueError("model.loss_chunk_tokens > 0: the last stage needs `labels`")
        normed = self.norm(h)
        return chunked_cross_entropy(
            normed, self.lm_head.weight, labels, self.config.loss_chunk_tokens
        )

    def _stream_in(self, inputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The residual stream ``[mb, seq, d]`` entering this stage, in the compute dtype.

        First stage: the embedding's output dtype is the compute dtype (bf16 under FSDP mixed
        precision, whose policy casts parameters but not the fp32 buffers ``U``/``F``); the
        start ``F[ids] + E[ids] (@ U^T)`` is summed in fp32 and cast to it once. Other stages:
        the received tensor's dtype, which is what the previous stage computed in."""
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(inputs)
            if not self.anchored:
                return h
            lifted = h.float() @ self.basis.T if self.factored else h.float()
            return (self.token_table[inputs].float() + lifted).to(h.dtype)
        if self.subspace:
            return subspace.decode(inputs, ids, self.basis.detach(), self.token_table)
        return inputs

    def _stream_out(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.subspace:
            return h
        basis = self.basis.detach()
        if self.measure_leak and self.in_microbatch:
            stage_leak = subspace.leak(h, ids, basis, self.token_table)
            self.boundary_leak = (
                stage_leak
                if self.boundary_leak is None
                else torch.maximum(self.boundary_leak, stage_leak)
            )
        return subspace.encode(h, ids, basis, self.token_table)

    def start_leak_window(self, measure: bool) -> None:
        """Forget the leak seen so far (e.g. during validation) and measure it from now on iff
        ``measure``. The trainer calls it before every step; ``pop_boundary_leak`` (the metrics
        processor, at log steps) is the one reader."""
        self.boundary_leak, self.measure_leak = None, measure

    def pop_boundary_leak(self) -> torch.Tensor | None:
        """Return and reset the max leak (a 0-d device tensor) recorded since the last call
        (None: no boundary, or not measured)."""
        value, self.boundary_leak = self.boundary_leak, None
        return value


def local_matrix(t: torch.Tensor) -> torch.Tensor:
    """The whole matrix behind a parameter or optimizer state on this rank: a DTensor on a
    one-device mesh unwraps; a sharded one is refused (the subspace optimizers and updates act
    on whole matrices)."""
    if not isinstance(t, DTensor):
        return t
    if t.device_mesh.size() > 1:
        raise UserError(
            "this optimizer (see optimizers.OPTIMIZERS: whole_matrices) and subspace updates "
            "need whole matrices on each rank: use parallelism.data_parallel_shard_degree = 1 "
            "(replicate, not FSDP-shard)"
        )
    return t.to_local()


@torch.no_grad()
def project_(weight: torch.Tensor, basis: torch.Tensor, kind: str) -> None:
    """In place: a full-width ``writer`` ``[d, in]`` becomes ``U U^T W``, an ``embedding``
    ``[V, d]`` becomes ``E U U^T`` (fp32 math, cast back)."""
    weight = local_matrix(weight)
    u = basis.detach().float()
    w = weight.float()
    projected = u @ (u.T @ w) if kind == "writer" else (w @ u) @ u.T
    weight.copy_(projected.to(weight.dtype))


def _inner_attention(name: Attention):
    return {
        "sdpa": ScaledDotProductAttention.Config,
        "flex": FlexAttention.Config,
        "varlen": VarlenAttention.Config,
    }[name]()


def build_model_config(arch: ModelArch, protocol: ProtocolSettings, n_stages: int):
    """A ``ProtocolModel.Config`` for ``arch`` laid out over ``n_stages`` pipeline stages
    (``stage_layer_ranges`` with ``protocol.layers_per_stage``).

    In subspace mode every block outside the last stage's range is constrained, and the token
    embedding is ``V x k``; the last stage's blocks are stock. With ``n_stages == 1`` nothing is
    upstream of a boundary, so nothing is constrained (use ``protocol.stages`` to build an
    S-stage model in one process). Another boundary method (``resbm``, ``mapl``,
    ``projected``) builds the dense model whose blocks on each side of every boundary are the
    method's (``BoundaryMethod.block.attach``: e.g. ResBM's encoder on the last block of every
    stage but the last, its decoder on the first block of every stage but the first). Every
    other mode (a lossy codec's) builds the dense model.
    """
    method = BOUNDARIES.get(protocol.mode) if n_stages > 1 else None
    mode = protocol.mode if method is not None else "dense"
    subspace_mode = mode == "subspace"
    factored = subspace_mode and protocol.parametrization == "factor"
    ranges = stage_layer_ranges(arch.n_layers, n_stages, protocol.layers_per_stage)
    last_stage = ranges[-1]
    hidden = arch.hidden_dim
    head_dim = arch.dim // arch.n_heads
    layers = []
    for layer_id in range(arch.n_layers):
        upstream = n_stages > 1 and layer_id not in last_stage
        writer_init = trunc_normal(depth_scaled_std(arch.init_std, layer_id))
        attention = make_gqa_config(
            dim=arch.dim,
            n_heads=arch.n_heads,
            n_kv_heads=arch.n_kv_heads,
            wqkv_param_init=trunc_normal(arch.init_std),
            wo_param_init=writer_init,
            inner_attention=_inner_attention(arch.attention),
            rope=ComplexRoPE.Config(
                dim=head_dim, max_seq_len=131072, theta=arch.rope_theta, scaling="none"
            ),
        )
        feed_forward = make_ffn_config(
            dim=arch.dim,
            hidden_dim=hidden,
            w1_param_init=trunc_normal(arch.init_std),
            w2w3_param_init=writer_init,
        )
        if factored and upstream:
            attention.wo.out_features = protocol.k
            feed_forward.w2.out_features = protocol.k
        norm_init = {"weight": nn.init.ones_}
        layers.append(
            ProtocolBlock.Config(
                upstream=upstream,
                factored=factored and upstream,
                attention_norm=RMSNorm.Config(normalized_shape=arch.dim, param_init=norm_init),
                ffn_norm=RMSNorm.Config(normalized_shape=arch.dim, param_init=norm_init),
                attention=attention,
                feed_forward=feed_forward,
            )
        )
    if method is not None:
        method.block.attach(layers, ranges, arch, protocol)
    embed_dim = protocol.k if factored else arch.dim
    return ProtocolModel.Config(
        dim=arch.dim,
        vocab_size=arch.vocab_size,
        loss_chunk_tokens=arch.loss_chunk_tokens,
        freeze_embedding=arch.freeze_embedding,
        mode=mode,
        layers_per_stage=protocol.layers_per_stage,
        k=protocol.k,
        subspace_seed=protocol.seed,
        basis_file=protocol.basis_file,
        table_dtype=protocol.table_dtype,
        parametrization=protocol.parametrization,
        track_basis_grad=subspace_mode and protocol.update_every > 0,
        tok_embeddings=Embedding.Config(
            num_embeddings=arch.vocab_size,
            embedding_dim=embed_dim,
            param_init={"weight": partial(nn.init.normal_, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=arch.dim, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(
            in_features=arch.dim,
            out_features=arch.vocab_size,
            param_init=trunc_normal(arch.dim**-0.5),
        ),
        layers=layers,
    )


def build_model_spec(
    arch: ModelArch,
    protocol: ProtocolSettings,
    n_stages: int,
    *,
    pipelining_fn,
    parallelize_fn=parallelize_llama,
    post_optimizer_build_fn=None,
) -> ModelSpec:
    """The ``ModelSpec`` TorchTitan's Trainer builds from: our model config and the trainer's
    functions (default parallelize: llama3's)."""
    return ModelSpec(
        name="protocol_llama3",
        flavor=label(protocol.mode, protocol.k).replace(" ", "-"),
        model=build_model_config(arch, protocol, n_stages),
        parallelize_fn=parallelize_fn,
        pipelining_fn=pipelining_fn,
        post_optimizer_build_fn=post_optimizer_build_fn,
        state_dict_adapter=None,
    )


__all__ = [
    "ModelArch",
    "ProtocolBlock",
    "ProtocolModel",
    "build_model_config",
    "build_model_spec",
    "project_",
]
