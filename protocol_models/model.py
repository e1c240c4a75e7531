"""The Protocol LLaMA: TorchTitan's llama3 with every upstream residual writer confined to span(U).

Parametrization (METHOD §4 variant A, ``W = U A``): on every stage but the last, the attention
output projection ``wo`` and the MLP down projection ``w2`` are stock TorchTitan ``Linear`` layers
with ``out_features = k`` -- their weights *are* the factors ``A`` ``[k, in]`` -- and the block
lifts their output into the stream with ``@ U.T``. The trainable token embedding is ``E``
``[V, k]`` and the stream starts as ``x0 = F[ids] + E[ids] @ U.T``. Norms are pre-norm (they only
touch branch inputs), there are no biases, no dropout, no tied head; so by induction
``x - F[ids]`` lies in span(U) at every boundary and ``c = (x - F[ids]) @ U`` is lossless.

The last stage's blocks, the final norm and the (untied) LM head stay full rank. In ``dense``
mode the same recipe builds the unconstrained twin: stock llama3 blocks and a ``d``-wide wire.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
from torch import nn
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
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.protocols.model_spec import ModelSpec

from protocol_models import subspace

Mode = Literal["subspace", "dense"]
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

    @property
    def hidden_dim(self) -> int:
        """The SwiGLU hidden width the blocks use."""
        return self.ffn_hidden_dim or compute_ffn_hidden_dim(
            self.dim, multiple_of=self.multiple_of, ffn_dim_multiplier=self.ffn_dim_multiplier
        )


@dataclass(kw_only=True, slots=True)
class ProtocolSettings:
    """The compressed-boundary method (TOML table ``[protocol]``)."""

    mode: Mode = "subspace"
    """``subspace``: boundaries carry k coordinates; ``dense``: the unconstrained d-wide twin."""
    k: int = 8
    """Subspace rank: coordinates per token per boundary."""
    seed: int = 1234
    """Seed of U and F; identical on every stage and node (never the training seed)."""
    stages: int | None = None
    """Pipeline layout the constraint is built for (default: parallelism.pipeline_parallel_degree).
    Set it on a 1-process run to build the exact model an S-stage run trains."""
    table_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of F on every stage (V x d: 2.1 GB fp32 at LLaMA-3 8B sizes, half in bf16).
    The codec always computes in fp32; bf16 storage rounds F once, identically on every stage."""


def stage_layer_ranges(n_layers: int, n_stages: int) -> list[range]:
    """Split ``n_layers`` blocks into ``n_stages`` contiguous, near-equal ranges (earlier stages
    take the remainder). Used by the model (to know which blocks are constrained) and by the
    pipeline split, so the two always agree."""
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


class ProtocolBlock(Llama3TransformerBlock):
    """A llama3 block whose two residual writes can be confined to span(U).

    When ``constrained``, ``attention.wo`` and ``feed_forward.w2`` output ``k`` coordinates and
    the block adds ``branch @ U.T`` ``[mb, seq, d]`` to the stream.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3TransformerBlock.Config):
        constrained: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.constrained = config.constrained

    def forward(
        self,
        x: torch.Tensor,
        attention_masks,
        positions: torch.Tensor | None = None,
        basis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn = self.attention(self.attention_norm(x), attention_masks, positions)
        if self.constrained:
            attn = attn @ basis.to(attn.dtype).T
        h = x + attn
        ffn = self.feed_forward(self.ffn_norm(h))
        if self.constrained:
            ffn = ffn @ basis.to(ffn.dtype).T
        return h + ffn


class ProtocolModel(Llama3Model):
    """Llama3 with the frozen ``U``/``F`` root buffers and the boundary codec in its forward.

    Root-level buffers survive TorchTitan's pipeline split on every stage. Both are
    non-persistent: they are regenerated from ``subspace_seed`` at init on every rank.
    A non-last stage returns ``c`` ``[mb, seq, k]`` (subspace) or ``x`` ``[mb, seq, d]`` (dense);
    a non-first stage takes that tensor as its positional input and the token ids as a kwarg.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3Model.Config):
        mode: Mode = "subspace"
        k: int = 8
        subspace_seed: int = 1234
        table_dtype: Literal["float32", "bfloat16"] = "float32"

    def __init__(self, config: Config):
        super().__init__(config)
        self.subspace = config.mode == "subspace"
        if self.subspace:
            self.register_buffer(
                "basis", torch.empty(config.dim, config.k, dtype=torch.float32), persistent=False
            )
            self.register_buffer(
                "token_table",
                torch.empty(config.vocab_size, config.dim, dtype=_DTYPES[config.table_dtype]),
                persistent=False,
            )
        self.boundary_leak: torch.Tensor | None = None
        """Max ``subspace.leak`` seen at this stage's outgoing boundary since the last reset."""

    def _init_self_buffers(self, *, buffer_device: torch.device | None = None) -> None:
        if not self.subspace:
            return
        device = buffer_device or self.basis.device
        basis, table = subspace.make_basis_and_table(
            self.config.subspace_seed, self.config.dim, self.config.k, self.config.vocab_size
        )
        self.basis = basis.to(device)
        self.token_table = table.to(device=device, dtype=_DTYPES[self.config.table_dtype])

    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor | None = None,
        attention_masks=None,
        token_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``inputs``: token ids ``[mb, seq]`` on the first stage, else the received boundary
        tensor. ``token_ids`` ``[mb, seq]``: the same ids on every stage (never sent)."""
        ids = inputs if self.tok_embeddings is not None else token_ids
        h = self._stream_in(inputs, ids)
        basis = self.basis if self.subspace else None
        for layer in self.layers.values():
            h = layer(h, attention_masks, positions, basis=basis)
        if self.norm is None:
            return self._stream_out(h, ids)
        return self.lm_head(self.norm(h))

    def _stream_in(self, inputs: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            h = self.tok_embeddings(inputs)
            if self.subspace:
                h = (self.token_table[inputs].float() + h.float() @ self.basis.T).to(h.dtype)
            return h
        if self.subspace:
            return subspace.decode(inputs, ids, self.basis, self.token_table)
        return inputs

    def _stream_out(self, h: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if not self.subspace:
            return h
        stage_leak = subspace.leak(h, ids, self.basis, self.token_table)
        self.boundary_leak = (
            stage_leak
            if self.boundary_leak is None
            else torch.maximum(self.boundary_leak, stage_leak)
        )
        return subspace.encode(h, ids, self.basis, self.token_table)

    def pop_boundary_leak(self) -> float | None:
        """Return and reset the max leak recorded since the last call (None: no boundary)."""
        value, self.boundary_leak = self.boundary_leak, None
        return None if value is None else float(value)


def _trunc_normal(std: float) -> dict:
    return {"weight": partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std)}


def _inner_attention(name: Attention):
    return {
        "sdpa": ScaledDotProductAttention.Config,
        "flex": FlexAttention.Config,
        "varlen": VarlenAttention.Config,
    }[name]()


def build_model_config(arch: ModelArch, protocol: ProtocolSettings, n_stages: int):
    """A ``ProtocolModel.Config`` for ``arch`` laid out over ``n_stages`` pipeline stages.

    In subspace mode every block outside the last stage's range is constrained, and the token
    embedding is ``V x k``; the last stage's blocks are stock. With ``n_stages == 1`` nothing is
    upstream of a boundary, so nothing is constrained (use ``protocol.stages`` to build an
    S-stage model in one process).
    """
    subspace_mode = protocol.mode == "subspace" and n_stages > 1
    last_stage = stage_layer_ranges(arch.n_layers, n_stages)[-1]
    hidden = arch.hidden_dim
    head_dim = arch.dim // arch.n_heads
    layers = []
    for layer_id in range(arch.n_layers):
        constrained = subspace_mode and layer_id not in last_stage
        writer_init = _trunc_normal(depth_scaled_std(arch.init_std, layer_id))
        attention = make_gqa_config(
            dim=arch.dim,
            n_heads=arch.n_heads,
            n_kv_heads=arch.n_kv_heads,
            wqkv_param_init=_trunc_normal(arch.init_std),
            wo_param_init=writer_init,
            inner_attention=_inner_attention(arch.attention),
            rope=ComplexRoPE.Config(
                dim=head_dim, max_seq_len=131072, theta=arch.rope_theta, scaling="none"
            ),
        )
        feed_forward = make_ffn_config(
            dim=arch.dim,
            hidden_dim=hidden,
            w1_param_init=_trunc_normal(arch.init_std),
            w2w3_param_init=writer_init,
        )
        if constrained:
            attention.wo.out_features = protocol.k
            feed_forward.w2.out_features = protocol.k
        norm_init = {"weight": nn.init.ones_}
        layers.append(
            ProtocolBlock.Config(
                constrained=constrained,
                attention_norm=RMSNorm.Config(normalized_shape=arch.dim, param_init=norm_init),
                ffn_norm=RMSNorm.Config(normalized_shape=arch.dim, param_init=norm_init),
                attention=attention,
                feed_forward=feed_forward,
            )
        )
    embed_dim = protocol.k if subspace_mode else arch.dim
    return ProtocolModel.Config(
        dim=arch.dim,
        vocab_size=arch.vocab_size,
        mode="subspace" if subspace_mode else "dense",
        k=protocol.k,
        subspace_seed=protocol.seed,
        table_dtype=protocol.table_dtype,
        tok_embeddings=Embedding.Config(
            num_embeddings=arch.vocab_size,
            embedding_dim=embed_dim,
            param_init={"weight": partial(nn.init.normal_, std=1.0)},
        ),
        norm=RMSNorm.Config(normalized_shape=arch.dim, param_init={"weight": nn.init.ones_}),
        lm_head=Linear.Config(
            in_features=arch.dim,
            out_features=arch.vocab_size,
            param_init=_trunc_normal(arch.dim**-0.5),
        ),
        layers=layers,
    )


def build_model_spec(
    arch: ModelArch, protocol: ProtocolSettings, n_stages: int, pipelining_fn
) -> ModelSpec:
    """The ``ModelSpec`` TorchTitan's Trainer builds from: our config, llama3's parallelize."""
    return ModelSpec(
        name="protocol_llama3",
        flavor=f"{protocol.mode}-k{protocol.k}" if protocol.mode == "subspace" else "dense",
        model=build_model_config(arch, protocol, n_stages),
        parallelize_fn=parallelize_llama,
        pipelining_fn=pipelining_fn,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )


__all__ = [
    "ModelArch",
    "ProtocolBlock",
    "ProtocolModel",
    "ProtocolSettings",
    "build_model_config",
    "build_model_spec",
    "stage_layer_ranges",
]
