"""The planner's cost model: what a layout costs in memory, compute and step time before paying
for GPUs (``python -m protocol_models.plan``, ``cluster.planner``, prints it).

``plan_stages`` builds the model on the meta device (no weights, no GPU) and splits it into the
configured pipeline stages exactly as a run would (``stage_layer_ranges``, ``[protocol]
layers_per_stage``); per stage it counts parameters, the memory terms below, and FLOPs;
``predict_step`` turns them and the network (``cluster.network``: one link per boundary, the
network inside a region) into a step time split into its terms; ``propose_split`` balances
``layers_per_stage``.

Memory, bytes per GPU of stage ``s`` at the start of the backward (every in-flight microbatch's
activations alive). ``P``: the stage's parameters; ``D``: ``data_parallel_shard_degree``; ``a``:
bytes of ``mixed_precision_param`` (2 for bf16); ``T``: tokens per microbatch; ``M``: microbatches
per step; ``n``: microbatches in flight (GPipe: ``M``; 1F1B: ``min(M, S - s)``); ``d``, ``kv``,
``h``, ``H``, ``V``, ``k``: width, key/value width, SwiGLU width, heads, vocabulary, subspace rank
(ResBM's bottleneck width in ``resbm`` mode).

* state ``(8 + o) P / D``: fp32 parameters and gradients and ``o`` bytes of optimizer state per
  parameter (the optimizer's ``OptimizerEntry.state_bytes``: 8 for AdamW's two fp32 moments, an
  upper bound for the others), FSDP-sharded (an upper bound by ``4 P / D``: TorchTitan frees
  the sharded gradients between steps);
* unsharded ``(a + 4) P``: TorchTitan applies FSDP at every degree (1 included) and under
  pipeline parallelism does not reshard after the forward
  (``get_fsdp_reshard_after_forward_policy``); the pipeline's backward keeps the parameters
  unsharded and accumulates unsharded fp32 gradients until the last microbatch
  (``backward_maybe_with_nosync``). So the stage's compute-dtype parameters and fp32 gradients
  exist in full, whatever ``D`` and ``fsdp_reshard_after_forward`` are;
* activations, per token of the ``n T`` in flight, per block: without checkpointing
  ``a (7 d + 2 kv + 4 h) + 4 H`` (block input, attention-norm output, q, k, v, attention output
  and its contiguous copy, residual, FFN-norm output, w1, w3 and SiLU outputs and their product;
  the fp32 log-sum-exp per head); ``selective``: ``a (2 d + o) + 4 H`` (block input, attention
  output, log-sum-exp, and ``o``, the output widths of the 1st, 3rd, ... matmul in execution
  order wq, wk, wv, wo, [U lift], w1, w3, w2, [U lift]: TorchTitan saves every second one);
  ``full``: ``a d`` (block input). Plus ``a w`` per token for the stage output kept for its
  backward (``w``: the boundary method's message width, ``boundary.BoundaryMethod.width``: k for
  subspace and resbm, else d) or, on the last stage, ``2 a d`` (final-norm input and output); plus,
  with checkpointing, one block's uncheckpointed set for one microbatch (the recompute). ResBM's
  encoder and decoder activations (``h + 2 d`` per token and boundary) are not counted;
* logits, last stage: ``(a + 4) V`` per in-flight token (the logits the stage keeps and the fp32
  log-softmax autograd saves) plus ``8 V T`` (one microbatch's fp32 gradients); with ``[model]
  loss_chunk_tokens = N``: ``(a + 12) V min(N, T)`` (one chunk's logits, fp32 copy, log-softmax
  and gradients) plus ``(4 + a) V d`` (the head gradient's fp32 accumulator and its cast);
* F and U (subspace and projected): ``V d`` in ``protocol.table_dtype`` and ``4 d k``;
* CUDA context: 1 GiB (``CUDA_CONTEXT``, a stated constant: the CUDA runtime, its kernels and
  cuBLAS's workspace on the GPU before the first tensor, NCCL's small device structures);
* NCCL buffers (a CUDA config), an estimate per communicator the stage's GPU holds
  (``stage_communicators``, ``Communicator.buffer_bytes``, from NCCL's defaults): one per
  boundary and direction the stage touches (``wire.boundary_groups``: a two-rank
  point-to-point communicator each), the norm exchange's (``wire.norm_exchange``), and a ring
  for each group that runs collectives: the pipeline's, FSDP's, the data-parallel replicas',
  the loss's, tensor parallelism's and the world's.

A stage fits when ``1.10 x`` the sum is at most ``usable_memory_gib`` (the 10%: allocator
fragmentation).

Compute, FLOPs per step on one GPU of the stage, ``B = local_batch_size x seq_len`` tokens:
``6 W B`` for ``W``, the weights of the stage's matmuls (its blocks' Linears, the boundary
method's added weights ``boundary_weights`` -- ResBM's encoder ``d h`` before and decoder ``h d``
after a boundary -- and the LM head; the embedding is a lookup), plus ``12 L d seq B`` for the
attention of its ``L`` blocks (QK^T and AV, forward and backward, without the causal half, as
TorchTitan counts MFU), plus the recompute: ``full`` repeats the blocks' forward
(``2 W_blocks B + 4 L d seq B``, boundary weights included), ``selective`` the matmuls it does not
save (``2 W_recomputed B``), and with ``loss_chunk_tokens`` the last stage's logits again in the
backward (``2 V d B``). Not counted: norms, RoPE and the k-wide U lifts (< 0.2%), the lossy
codecs, ResBM's encoder and decoder in the selective recompute. Seconds = FLOPs / (``--mfu`` x
``[hardware] peak_tflops``, or, where that is unset, ``ASSUMED_PEAK_TFLOPS``, an L4's, which the
report says it assumed); the forward is ``2 W T + 4 L d seq T`` per microbatch, the backward
the rest.

Step time: GPipe runs every microbatch forward through the S stages and S - 1 links, then
backward. A link is a server of its own: a microbatch message of ``m`` bytes occupies it for
``w = 8 R m' / bandwidth`` (``m'``: the bytes with their TCP/IP headers; the ``R`` data-parallel
replicas of a boundary share the link) and arrives one latency ``L`` after it left; messages
queued back to back overlap their latencies, as ``protocol_models.wire.link`` simulates (sizes:
``wire.sizes.message_bytes``). With pre-posted receives (``[transport] prepost_receives``, the
default) every receive is posted before its message is sent, so a pass over servers with
per-microbatch times ``t_i`` takes ``sum(stage t_i) + sum over links (w_b + L_b) + (M - 1)
max(t_i, w_b)`` (each boundary ``b`` its own link, ``cluster.network``): with no link and
equal stages ``(M + S - 1) t``, the GPipe bubble ``(S - 1) / (M + S - 1)``.
Without pre-posting, gloo's receiver-driven transport (a CPU config) has a stage post its next
receive only after computing the previous microbatch, and the sender writes only once that
receive's notice crossed the link, so a link and the stage it feeds serve a microbatch together
in ``L + w + L + the stage's compute`` (``wire.link.rendezvous_period``). NCCL (a CUDA config)
over its socket transport (by NCCL's source; not yet measured on GPUs) pushes a message onto its
TCP connection without waiting for the
receive (``ncclNetSocketIsend``), so a receive posted late costs nothing there and the
pre-posted model applies either way; its norm exchange, one batch of sends and receives at the
clipping (``wire.norm_exchange``), overlaps the next step's fill as the pre-posted one does.
Step = forward pass + backward pass (1F1B has the same bubble and is predicted alike) + the
collectives across the pipeline: none with ``[transport] exchange_grad_norm`` (the norm's exchange
overlaps the next step's fill, and a log step's metrics travel with it unless a loss is reduced
over data- or context-parallel replicas or MAPL's boundary sync runs, when they take one all-gather
of ``S - 1`` latency rounds every ``log_freq`` steps); without it, TorchTitan's gradient-norm
all-reduce, ``2 (S - 1)`` rounds, and the all-gather every log step (``wire.meter.ring_rounds``);
plus, for a method whose boundary stages exchange weights' gradients before the optimizer step
(MAPL: ``sync_bytes``), one transfer of the larger direction, every boundary at once. The
prediction is printed as its terms: ``compute`` (``M`` times the slowest stage's per-microbatch
forward, and backward), ``bubble`` (the other stages' share of the passes: the pipeline's fill and
drain), ``latency`` (the fill and drain's ``2 sum L_b``), ``bytes`` (serialization: each pass's
first message per link, and a link slower than every stage), ``collectives`` (at the largest
latency of any boundary: a ring's round waits for its slowest hop) and ``fsdp``: a stage whose
data-parallel ranks span nodes all-gathers its parameters and reduce-scatters its gradients
once per step over the network inside a region (``fsdp_bytes``), not overlapped (an upper
bound), the slowest stage's. The optimizer step is not counted.

Next to it, every column predicts the ``Async1F1B`` step of the same stages
(``predict_async_step``; the planner says where the config check refuses the layout, and plans
the memory of the layout under the schedule with ``async_config``): no fill and drain in steady
state, one microbatch per period ``max(T, (2 (L + x) + f + b) / d, x)`` per stage, where ``d``
is the hop depth (the configured one under ``Async1F1B``, else the smallest that hides the round
trip, at most what the microbatches allow) -- a depth too small for the link makes it slower
than GPipe --, plus, at every flush (validation, checkpoint, last step), the
synchronous fill and drain (a log step's metrics gather is not waited for). Under
``Async1F1B`` a stage also holds its depth + 1 microbatches' activations and two fp32 weight
versions with their gradients (``versions``; with ``[optimizer] weight_prediction``, one more
fp32 copy: the last update).

Proposed split: over the ``layers_per_stage`` whose every stage fits, the one with the smallest
busiest-stage compute time per step (a stage's blocks are constrained unless it is the last;
the first holds the embedding, the last the norm and LM head), then the smallest largest-stage
memory.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from protocol_models.cluster.network import (
    REGION_LATENCY_MS,
    REGION_MBPS,
    Link,
    stage_spans_nodes,
)
from protocol_models.model.boundary import BOUNDARIES, anchored
from protocol_models.model.layout import stage_layer_ranges
from protocol_models.model.model import build_model_config
from protocol_models.training.optimizers import OPTIMIZERS
from protocol_models.wire import codec_for
from protocol_models.wire.async_schedule import (
    ASYNC_SCHEDULE,
    hop_depth,
    max_hop_depth,
    stage_depths,
)
from protocol_models.wire.boundary_groups import DIRECTIONS
from protocol_models.wire.link import (
    READY_NOTICE_BYTES,
    rendezvous_period,
    segment_seconds,
    serialization_seconds,
    tcp_segments,
    transfer_seconds,
)
from protocol_models.wire.meter import ring_rounds
from protocol_models.wire.pipeline import split_stage
from protocol_models.wire.sizes import message_bytes as boundary_message_bytes
from protocol_models.wire.tcp_loss import expected_extra_s

GIB = 1024**3
MARGIN = 1.10
CUDA_CONTEXT = 1 * GIB
UNBALANCED = 0.05
"""Print a proposed split unasked when it cuts the busiest stage's compute time by this much."""
REGION = Link(REGION_MBPS, REGION_LATENCY_MS, crosses=False)
"""The network inside a region the planner assumes unless told (``network.REGION_MBPS``)."""
ASSUMED_PEAK_TFLOPS = 121.0
"""The peak of one GPU the compute estimate assumes when ``[hardware] peak_tflops`` is unset: an
NVIDIA L4's dense bf16 (its datasheet's 242 TFLOP/s with sparsity, halved)."""

NCCL_VERSION = "2.30"
"""The NCCL whose source defaults the buffer estimate reads (torch 2.14's wheel ships 2.30.7)."""
NCCL_CONNECTION_BYTES = 8 * 512 * 8 * 16 + 120 * 640 * 8 * 8 + 4 * 1024**2
"""Buffers of one connection (one channel, one peer, one direction) of a ring or of the
intra-node P2P transport, 9,633,792 bytes, NCCL's defaults (``src/init.cc``,
``computeBuffSizes``; constants in ``src/include/device.h``): LL ``NCCL_LL_LINES_PER_THREAD (8) x
NCCL_LL_MAX_NTHREADS (512) x NCCL_STEPS (8) x sizeof(ncclLLFifoLine) (16)`` = 512 KiB, LL128
``NCCL_LL128_ELEMS_PER_THREAD (120) x NCCL_LL128_MAX_NTHREADS (640) x NCCL_STEPS x 8`` = 4.6875
MiB and SIMPLE ``NCCL_BUFFSIZE`` = 4 MiB. ``src/transport/net.cc`` (``sendProxyConnect``,
``recvProxyConnect``) gives a ring's connections dedicated buffers of all three protocols on
both sides; ``src/transport/p2p.cc`` gives an intra-node connection the three on one side."""
NCCL_CHANNELS = 2
"""Channels of a communicator, an assumption: the topology search's one ring over a single NIC,
which ``src/graph/connect.cc`` doubles (``comm->nChannels = min(MAXCHANNELS, nChannels * 2)``);
point-to-point uses as many (``src/graph/paths.cc``: ``p2pnChannels`` is ``nChannels`` rounded
up to a power of two, and a PCIe peer gets 2 channels). NVLink nodes and several NICs get more."""
NCCL_P2P_POOL_BYTES = NCCL_CHANNELS * 16 * 128 * 1024
"""One direction's point-to-point buffers of a communicator whose peers are across the network,
4 MiB: ``src/transport/net.cc`` shares one pool per direction among all peers
(``NCCL_NET_SHARED_BUFFERS`` on by default; ``sharedNetBuffersInit``: ``p2pnChannels x
NCCL_SHARED_STEPS (16) x p2pChunkSize``, the chunk ``NCCL_P2P_NET_CHUNKSIZE`` = 128 KiB when the
communicator spans nodes, ``src/init.cc``); LL buffers only with ``NCCL_ALLOC_P2P_NET_LL_BUFFERS``
(off)."""


@dataclass(frozen=True)
class Communicator:
    """One NCCL communicator a GPU holds (``stage_communicators``): ``name``; ``ring``: it runs
    collectives (a ring's connections to its previous and next rank), else point-to-point only,
    in ``directions`` (1: sends or receives, 2: both) with ``peers`` peers, ``local`` when they
    share this GPU's node (NCCL's P2P transport), else over the network."""

    name: str
    ring: bool = False
    directions: int = 1
    peers: int = 1
    local: bool = False

    @property
    def buffer_bytes(self) -> int:
        """Its buffers, an estimate from NCCL's defaults (``NCCL_CONNECTION_BYTES``,
        ``NCCL_CHANNELS``, ``NCCL_P2P_POOL_BYTES``), counted as GPU memory: an upper bound where
        NCCL keeps them in pinned host memory instead (network buffers without GPUDirect RDMA,
        as over sockets; ``src/transport/net.cc``) and for an intra-node point-to-point
        connection, counted on both its GPUs though ``src/transport/p2p.cc`` puts its buffers
        on one. NCCL's few device structures per communicator are left to ``CUDA_CONTEXT``."""
        if self.ring:
            return NCCL_CHANNELS * 2 * NCCL_CONNECTION_BYTES
        if self.local:
            return NCCL_CHANNELS * self.directions * self.peers * NCCL_CONNECTION_BYTES
        return self.directions * NCCL_P2P_POOL_BYTES

    def describe(self) -> str:
        """E.g. ``"boundary point-to-point (network)"``, ``"world ring"``."""
        if self.ring:
            return f"{self.name} ring"
        return f"{self.name} point-to-point ({'intra-node' if self.local else 'network'})"


@dataclass(frozen=True)
class Matmul:
    """One matmul of a block, ``[tokens, fan_in] x [fan_in, fan_out]``; ``weight``: False for
    the U lifts (a frozen buffer, not a parameter)."""

    fan_in: int
    fan_out: int
    weight: bool = True


@dataclass
class StagePlan:
    """One pipeline stage: its blocks, parameters, memory terms (bytes per GPU, before the
    margin), FLOPs per microbatch on one GPU (backward including the recompute) and the NCCL
    communicators its GPU holds."""

    stage: int
    layers: range
    params: int
    memory: dict[str, float]
    fwd_flops: float
    bwd_flops: float
    communicators: tuple[Communicator, ...] = ()

    @property
    def nccl_bytes(self) -> int:
        """The communicators' buffers (``Communicator.buffer_bytes``)."""
        return sum(c.buffer_bytes for c in self.communicators)

    @property
    def total_bytes(self) -> float:
        """What must fit ``usable_memory_gib``: the terms and NCCL's buffers with the 10%
        margin."""
        return (sum(self.memory.values()) + self.nccl_bytes) * MARGIN


def block_matmuls(config, factored: bool) -> list[Matmul]:
    """A block's matmuls in execution order; ``factored``: wo and w2 output k coordinates and
    each branch is lifted by ``@ U.T``."""
    arch, k = config.model, config.protocol.k
    d, hidden = arch.dim, arch.hidden_dim
    kv = (arch.n_kv_heads or arch.n_heads) * (d // arch.n_heads)
    out = k if factored else d
    lift = [Matmul(k, d, weight=False)] if factored else []
    attention = [Matmul(d, d), Matmul(d, kv), Matmul(d, kv), Matmul(d, out)]
    feed_forward = [Matmul(d, hidden), Matmul(d, hidden), Matmul(hidden, out)]
    return attention + lift + feed_forward + lift


def _factored_model(config) -> bool:
    """Whether the model's upstream blocks and embedding are k-wide factors (as
    ``build_model_config`` decides)."""
    protocol = config.protocol
    return (
        protocol.mode == "subspace"
        and config.layout_stages > 1
        and protocol.parametrization == "factor"
    )


def boundary_weights(config, stage: int) -> int:
    """Weights the boundary method adds to ``stage``: its ``sender_weights`` unless the stage is
    the last, its ``receiver_weights`` unless it is the first (ResBM: encoder, decoder)."""
    method = BOUNDARIES.get(config.protocol.mode)
    if method is None:
        return 0
    d, protocol = config.model.dim, config.protocol
    shapes = method.sender_weights(d, protocol) if stage < config.layout_stages - 1 else []
    shapes += method.receiver_weights(d, protocol) if stage > 0 else []
    return sum(fan_in * fan_out for fan_in, fan_out in shapes)


def boundary_lookups(config, stage: int) -> int:
    """Table parameters the boundary method adds to ``stage``: one per boundary side the stage
    holds (MAPL's anchor tables ``P``), and the receiving side's own (``projected`` mode's stage
    tables)."""
    method = BOUNDARIES.get(config.protocol.mode)
    if method is None:
        return 0
    sides = (stage < config.layout_stages - 1) + (stage > 0)
    v, d = config.model.vocab_size, config.model.dim
    receiver = method.receiver_lookups(v, d, config.protocol) if stage > 0 else 0
    return sides * method.lookups(v, config.protocol) + receiver


def boundary_width(config) -> int:
    """Features per token of a boundary message (a lossy codec compresses the d-wide stream)."""
    method = BOUNDARIES.get(config.protocol.mode)
    d = config.model.dim
    return method.width(d, config.protocol.k) if method is not None else d


def stage_params(config, stage: int, n_blocks: int) -> int:
    """Closed-form parameters of ``stage`` holding ``n_blocks`` blocks."""
    arch = config.model
    d, v = arch.dim, arch.vocab_size
    last = stage == config.layout_stages - 1
    factored = _factored_model(config)
    matmuls = block_matmuls(config, factored and not last)
    block = sum(m.fan_in * m.fan_out for m in matmuls if m.weight)
    params = n_blocks * (block + 2 * d) + boundary_weights(config, stage)  # + 2 RMSNorm weights
    params += boundary_lookups(config, stage)
    if stage == 0:
        params += v * (config.protocol.k if factored else d)
    if last:
        params += d + d * v  # final norm, LM head
    return params


def versions_bytes(config) -> int:
    """Bytes per parameter an ``Async1F1B`` stage holds beside its parameters and optimizer
    state: two fp32 weight versions with their gradients, and with weight prediction the last
    update (fp32)."""
    return 16 + (4 if config.optimizer.weight_prediction else 0)


def stage_cost(
    config, stage: int, n_blocks: int, params: int
) -> tuple[dict[str, float], float, float]:
    """``(memory terms in bytes, forward FLOPs, backward FLOPs)`` per GPU of ``stage`` holding
    ``n_blocks`` blocks and ``params`` parameters; FLOPs per microbatch of ``mb x seq`` tokens,
    the backward's including the recompute (the module docstring has the formulas)."""
    arch, protocol, par = config.model, config.protocol, config.parallelism
    n_stages, last = config.layout_stages, stage == config.layout_stages - 1
    a, n_mb, tokens = microbatching(config)
    d, v, heads, seq = arch.dim, arch.vocab_size, arch.n_heads, config.training.seq_len
    kv = (arch.n_kv_heads or arch.n_heads) * (d // heads)
    holds_table = anchored(protocol.mode) and n_stages > 1
    matmuls = block_matmuls(config, _factored_model(config) and not last)
    weights = sum(m.fan_in * m.fan_out for m in matmuls if m.weight)
    in_flight = n_mb
    if par.pipeline_parallel_schedule == "1F1B":
        in_flight = min(n_mb, n_stages - stage)
    asynchronous = par.pipeline_parallel_schedule == ASYNC_SCHEDULE
    if asynchronous:
        depth = stage_depths(n_stages, config.transport.async_hop_depth)[stage]
        in_flight = min(n_mb, depth + 1)

    unsaved = a * (7 * d + 2 * kv + 4 * arch.hidden_dim) + 4 * heads
    ac = config.activation_checkpoint
    recompute_flops = 0.0
    if isinstance(ac, FullAC.Config):
        kept = a * d
        blocks_fwd = n_blocks * (2 * weights + 4 * d * seq) + 2 * boundary_weights(config, stage)
        recompute_flops = blocks_fwd * tokens
    elif isinstance(ac, SelectiveAC.Config):
        kept = a * (2 * d + sum(m.fan_out for m in matmuls[::2])) + 4 * heads
        recomputed = sum(m.fan_in * m.fan_out for m in matmuls[1::2] if m.weight)
        recompute_flops = n_blocks * 2 * recomputed * tokens
    else:
        kept = unsaved
    per_token = n_blocks * kept + (2 * a * d if last else a * boundary_width(config))
    recompute = tokens * unsaved if ac is not None and n_blocks else 0
    activations = in_flight * tokens * per_token + recompute

    logits = 0.0
    if last:
        chunk = getattr(arch, "loss_chunk_tokens", 0)
        if chunk:
            logits = (a + 12) * v * min(chunk, tokens) + (4 + a) * v * d
        else:
            logits = (a + 4) * v * in_flight * tokens + 8 * v * tokens
    table_bytes = 2 if protocol.table_dtype == "bfloat16" else 4
    state = 8 + OPTIMIZERS[config.optimizer.name].state_bytes
    memory = {
        f"state {state}P/D": state * params / max(par.data_parallel_shard_degree, 1),
        "unsharded": (a + 4) * params,
        "activations": activations,
        "logits": logits,
        "F and U": v * d * table_bytes + 4 * d * protocol.k if holds_table else 0.0,
        **({"versions": versions_bytes(config) * params} if asynchronous else {}),
        "context": CUDA_CONTEXT,
    }
    matmul_weights = n_blocks * weights + boundary_weights(config, stage) + (v * d if last else 0)
    attention = n_blocks * 4 * d * seq * tokens
    fwd = 2 * matmul_weights * tokens + attention
    if last and getattr(arch, "loss_chunk_tokens", 0):
        recompute_flops += 2 * v * d * tokens  # the chunked loss recomputes the logits
    return memory, fwd, 2 * fwd + recompute_flops


def stage_communicators(config, stage: int) -> tuple[Communicator, ...]:
    """The NCCL communicators one GPU of ``stage`` holds (none on a CPU config: gloo): the
    pipeline's (``_pipeline_communicators``) and a ring for each group of more than one rank
    that runs collectives (FSDP over the shard and context-parallel ranks, the data-parallel
    replicas' all-reduce, the loss's reduction over the data- and context-parallel ranks,
    tensor parallelism, and the world: start-up's and the checkpoints' gathers)."""
    if config.hardware.device != "cuda" or config.world_size < 2:
        return ()
    par = config.parallelism
    pipelined = par.pipeline_parallel_degree > 1
    groups = {
        "FSDP": max(par.data_parallel_shard_degree, 1) * par.context_parallel_degree,
        "data-parallel replicate": par.data_parallel_replicate_degree,
        "loss": config.replicas * par.context_parallel_degree,
        "tensor-parallel": par.tensor_parallel_degree,
        "world": config.world_size,
    }
    rings = [Communicator(name, ring=True) for name, ranks in groups.items() if ranks > 1]
    return (*(_pipeline_communicators(config, stage) if pipelined else []), *rings)


def _pipeline_communicators(config, stage: int) -> list[Communicator]:
    """A pipelined stage's communicators: a two-rank one per boundary and direction it touches
    (``wire.boundary_groups``), the norm exchange's (``_norm_communicators``) and the pipeline
    group's ring (the validation loss's broadcast, the metrics' all-gather)."""
    stages = config.layout_stages
    boundaries = [b for b in (stage - 1, stage) if 0 <= b < stages - 1]
    communicators = [Communicator("boundary", local=_on_one_node(config, [b, b + 1]))
                     for b in boundaries for _ in DIRECTIONS]  # fmt: skip
    return [*communicators, *_norm_communicators(config, stage),
            Communicator("pipeline", ring=True)]  # fmt: skip


def _norm_communicators(config, stage: int) -> list[Communicator]:
    """The norm exchange's communicators on ``stage`` (``wire.norm_exchange``; none without
    ``[transport] exchange_grad_norm``): under ``Async1F1B`` a two-rank one per other stage and
    direction (single ops on two groups), else one of the pipeline's ranks its batches send to
    and receive from every other stage on."""
    if not config.transport.exchange_grad_norm:
        return []
    stages = config.layout_stages
    if config.parallelism.pipeline_parallel_schedule == ASYNC_SCHEDULE:
        return [Communicator("norm exchange", local=_on_one_node(config, [stage, peer]))
                for peer in range(stages) if peer != stage for _ in DIRECTIONS]  # fmt: skip
    return [Communicator("norm exchange", directions=2, peers=stages - 1,
                         local=_on_one_node(config, range(stages)))]  # fmt: skip


def _on_one_node(config, stages) -> bool:
    """Whether each pipeline's ranks of ``stages`` share one node (pipeline-outermost ranks:
    stage ``s``'s ``j``-th rank is ``s R + j``, ``R`` ranks per stage)."""
    per_stage = config.world_size // config.parallelism.pipeline_parallel_degree
    gpus = config.hardware.gpus_per_node
    return all(len({(s * per_stage + j) // gpus for s in stages}) == 1 for j in range(per_stage))


def plan_stages(config) -> list[StagePlan]:
    """Per-stage parameters (from a meta-device model split as a run splits it), memory and
    FLOPs of ``config``'s layout."""
    stages = config.layout_stages
    with torch.device("meta"):
        model = build_model_config(config.model, config.protocol, stages).build()
    ranges = stage_layer_ranges(config.model.n_layers, stages, config.protocol.layers_per_stage)
    plans = []
    for s, layers in enumerate(ranges):
        params = sum(p.numel() for p in split_stage(model, s, stages).parameters())
        memory, fwd, bwd = stage_cost(config, s, len(layers), params)
        plans.append(StagePlan(s, layers, params, memory, fwd, bwd,
                               stage_communicators(config, s)))  # fmt: skip
    return plans


def propose_split(config, mfu: float) -> tuple[list[int], float, float] | None:
    """The balanced ``layers_per_stage`` (module docstring) as ``(split, busiest stage's compute
    seconds per step, largest stage's bytes with the margin)``, or None if no split fits."""
    n_layers, n_stages = config.model.n_layers, config.layout_stages
    limit = config.hardware.usable_memory_gib * GIB
    _, n_mb, _ = microbatching(config)
    costs: dict[tuple[int, int], tuple[float, float]] = {}
    for s in range(n_stages):
        nccl = sum(c.buffer_bytes for c in stage_communicators(config, s))
        for n in range(1, n_layers - n_stages + 2):
            memory, fwd, bwd = stage_cost(config, s, n, stage_params(config, s, n))
            seconds = compute_seconds(config, n_mb * (fwd + bwd), mfu)
            costs[s, n] = (seconds, (sum(memory.values()) + nccl) * MARGIN)

    def seconds(s: int, n: int) -> float:
        time, total = costs[s, n]
        return time if total <= limit else math.inf

    fastest = _minimax_split(n_layers, n_stages, seconds)
    if fastest is None:
        return None

    def memory(s: int, n: int) -> float:
        time, total = costs[s, n]
        return total if total <= limit and time <= fastest[0] * (1 + 1e-9) else math.inf

    largest, split = _minimax_split(n_layers, n_stages, memory)
    return split, fastest[0], largest


def _minimax_split(
    n_layers: int, n_stages: int, cost: Callable[[int, int], float]
) -> tuple[float, list[int]] | None:
    """The split of ``n_layers`` blocks (each stage >= 1) minimizing ``max_s cost(s, n_s)``
    (``inf``: not allowed), by dynamic programming over (stages, blocks placed)."""
    best = [[math.inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    choice = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for placed in range(s, n_layers - (n_stages - s) + 1):
            for n in range(1, placed - s + 2):
                value = max(best[s - 1][placed - n], cost(s - 1, n))
                if value < best[s][placed]:
                    best[s][placed], choice[s][placed] = value, n
    if math.isinf(best[n_stages][n_layers]):
        return None
    split, placed = [], n_layers
    for s in range(n_stages, 0, -1):
        split.append(choice[s][placed])
        placed -= choice[s][placed]
    return best[n_stages][n_layers], split[::-1]


def twin(config):
    """``config`` with the other model on the same layout: dense for a subspace or lossy mode,
    subspace (at ``protocol.k``) for dense."""
    other = copy.copy(config)
    mode = "subspace" if config.protocol.mode == "dense" else "dense"
    other.protocol = dataclasses.replace(config.protocol, mode=mode, stage_tables=False)
    return other


ASYNC_WEIGHT_PREDICTION = 1.0
"""``[optimizer] weight_prediction`` that ``async_config`` sets where the config sets none: with
it the asynchronous runs matched their synchronous twins' validation loss more closely than
without (AdamW +2.90% without, -0.01% with, on the CPU reference workload: results/README.md,
asynchronous pipeline)."""


def async_config(config, hop: int):
    """``config`` under ``Async1F1B`` at hop depth ``hop``, with the config's weight prediction
    or else ``ASYNC_WEIGHT_PREDICTION``; not checked (as ``twin``): for its memory."""
    other = copy.copy(config)
    other.parallelism = dataclasses.replace(config.parallelism,
                                            pipeline_parallel_schedule=ASYNC_SCHEDULE)  # fmt: skip
    other.transport = dataclasses.replace(config.transport, async_hop_depth=hop)
    prediction = config.optimizer.weight_prediction or ASYNC_WEIGHT_PREDICTION
    other.optimizer = dataclasses.replace(config.optimizer, weight_prediction=prediction)
    return other


def message_bytes(config) -> tuple[int, int]:
    """Bytes of one microbatch's forward and backward message at a boundary
    (``wire.sizes.message_bytes`` at the ``[mb, seq, d]`` boundary in the compute dtype)."""
    arch, protocol = config.model, config.protocol
    act_bytes, _, _ = microbatching(config)
    codec = codec_for(config)
    shape = (config.parallelism.pipeline_parallel_microbatch_size, config.training.seq_len,
             arch.dim)  # fmt: skip
    dtype = torch.bfloat16 if act_bytes == 2 else torch.float32
    return tuple(
        boundary_message_bytes(protocol.mode, shape, dtype, direction, k=protocol.k, codec=codec)
        for direction in ("fwd", "bwd")
    )


def sync_bytes(config) -> tuple[int, int]:
    """Bytes a boundary's two stages exchange once per step apart from the activations (each
    direction, one data-parallel replica; ``boundary.BoundaryMethod.sync_values``, fp32)."""
    method = BOUNDARIES.get(config.protocol.mode)
    if method is None:
        return 0, 0
    values = method.sync_values(config.model.dim, config.model.vocab_size, config.protocol)
    return tuple(4 * v for v in values)


def wire_plan(config) -> dict:
    """Bytes per step at each boundary (both directions, all data-parallel replicas), the
    configured mode's activations and dense's, and the mode's per-step exchange apart from the
    activations (``sync_bytes``; in no ratio)."""
    act_bytes, n_mb, tokens = microbatching(config)
    replicas = config.replicas
    fwd, bwd = message_bytes(config)
    dense = 2 * n_mb * replicas * tokens * config.model.dim * act_bytes
    per_boundary = n_mb * replicas * (fwd + bwd)
    return {
        "message_bytes": fwd,
        "per_boundary_bytes": per_boundary,
        "dense_per_boundary_bytes": dense,
        "ratio": dense / per_boundary,
        "sync_per_boundary_bytes": replicas * sum(sync_bytes(config)),
    }


def predict_step(
    config, plans: list[StagePlan], links: list[Link], mfu: float, region: Link = REGION
) -> dict:
    """The predicted step of ``plans`` (module docstring: per-stage compute per microbatch, the
    links as pipeline servers, a forward then a backward pass, the collectives, FSDP inside a
    region), ``links[b]`` the network of boundary ``b`` (``network.boundary_links``), as
    seconds: ``busiest_compute_s`` (the busiest stage's compute per step), ``link_s`` (one
    forward message on the slowest link), the terms ``compute_s``, ``bubble_s``, ``latency_s``,
    ``bytes_s``, ``collectives_s``, ``fsdp_s`` (``fsdp_seconds`` over ``region``, the network
    inside a region) and their sum ``step_s``; and ``tokens_per_s`` over all data-parallel
    replicas."""
    _, n_mb, _ = microbatching(config)
    replicas, transport = config.replicas, config.transport
    terms = dict.fromkeys(
        ("compute_s", "bubble_s", "latency_s", "bytes_s", "collectives_s", "fsdp_s"), 0.0
    )

    def wire_seconds(nbytes: int, link: Link) -> float:
        return message_seconds(nbytes, link, replicas)

    def one_pass(stage_seconds: list[float], nbytes: int, path: list[Link]) -> None:
        """Add one pass over ``stage_seconds`` through the links ``path`` (both in the order
        it visits them) to ``terms``."""
        wires, slowest = [wire_seconds(nbytes, link) for link in path], max(stage_seconds)
        terms["compute_s"] += n_mb * slowest
        terms["bubble_s"] += sum(stage_seconds) - slowest
        terms["latency_s"] += sum(link.latency_s for link in path)
        terms["bytes_s"] += sum(wires)
        if transport.prepost_receives or config.hardware.device == "cuda":  # NCCL: sender-driven
            terms["bytes_s"] += (n_mb - 1) * max([0.0, *(w - slowest for w in wires)])
            return
        periods = [rendezvous_period(w + link.latency_s, link.latency_s + notice_seconds(link), t)
                   for w, link, t in zip(wires, path, stage_seconds[1:], strict=True)]  # fmt: skip
        # the rest of the rendezvous stall counts as latency
        terms["latency_s"] += (n_mb - 1) * max([0.0, *(p - slowest for p in periods)])

    fwd_msg, bwd_msg = message_bytes(config)
    fwd = [compute_seconds(config, p.fwd_flops, mfu) for p in plans]
    bwd = [compute_seconds(config, p.bwd_flops, mfu) for p in plans]
    one_pass(fwd, fwd_msg, links)
    one_pass(bwd[::-1], bwd_msg, links[::-1])
    worst = max(links, key=lambda link: link.latency_s, default=Link(None, 0.0))
    terms["collectives_s"] = collective_rounds_per_step(config) * (
        worst.latency_s + loss_seconds(1, worst, replicas=1)
    )
    if any(sync_bytes(config)):  # every boundary's exchange at once, before the optimizer step
        terms["collectives_s"] += (
            max(
                transfer_seconds(replicas * max(sync_bytes(config)), link.bps, link.latency_s)
                for link in links
            )
            if links
            else 0.0
        )
    terms["fsdp_s"] = max(fsdp_seconds(config, p, region) for p in plans)
    step = sum(terms.values())
    tokens = replicas * config.training.local_batch_size * config.training.seq_len
    return {
        "busiest_compute_s": n_mb * max(f + b for f, b in zip(fwd, bwd, strict=True)),
        "link_s": max(
            (wire_seconds(fwd_msg, link) + link.latency_s for link in links), default=0.0
        ),  # fmt: skip
        **terms,
        "step_s": step,
        "tokens_per_s": tokens / step,
    }


def loss_seconds(nbytes: int, link: Link, replicas: int) -> float:
    """Mean seconds ``link.loss`` adds to one replica's ``nbytes`` message (``wire.tcp_loss``):
    each of the ``replicas`` data-parallel replicas has a connection of its own at its share of
    the link's rate."""
    return expected_extra_s(tcp_segments(nbytes), link.loss, link.latency_s,
                            segment_seconds(link.bps / replicas))  # fmt: skip


def notice_seconds(link: Link) -> float:
    """Mean seconds ``link.loss`` adds to a receive's ready notice (gloo's rendezvous)."""
    return loss_seconds(READY_NOTICE_BYTES, link, replicas=1)


def message_seconds(nbytes: int, link: Link, replicas: int) -> float:
    """Seconds one microbatch's ``nbytes`` message holds ``link`` that ``replicas`` replicas
    share: their bytes with TCP/IP headers at its rate, plus what its packet loss adds."""
    return serialization_seconds(replicas * nbytes, link.bps) + loss_seconds(nbytes, link, replicas)


def fsdp_bytes(config, params: int) -> tuple[float, float]:
    """Bytes one GPU of a stage with ``params`` parameters sends per step in its data-parallel
    collectives, ``(all-gather, gradient reduction)``: FSDP's all-gather of the compute-dtype
    parameters and reduce-scatter of the fp32 gradients (each ``(D - 1) / D`` of the stage's,
    once per step: under pipeline parallelism TorchTitan does not reshard between
    microbatches), and across ``R`` replicas (HSDP) the all-reduce of the fp32 gradient shard,
    ``2 (R - 1) / R`` of it."""
    par = config.parallelism
    shards, copies = max(par.data_parallel_shard_degree, 1), par.data_parallel_replicate_degree
    a, _, _ = microbatching(config)
    gather = a * params * (shards - 1) / shards
    reduce = 4 * params * (shards - 1) / shards + 8 * params / shards * (copies - 1) / copies
    return gather, reduce


def fsdp_seconds(config, plan: StagePlan, region: Link) -> float:
    """The stage's data-parallel collectives (``fsdp_bytes``) over ``region`` with their ring
    rounds' latency, not overlapped with compute (an upper bound: FSDP prefetches the next
    block's parameters while one computes); 0 where the stage's ranks share one node (NVLink or
    PCIe, not modelled)."""
    if config.replicas < 2 or not stage_spans_nodes(config, plan.stage):
        return 0.0
    rounds = 2 * (config.replicas - 1)
    return serialization_seconds(sum(fsdp_bytes(config, plan.params)), region.bps) + (
        rounds * region.latency_s
    )


def predict_async_step(
    config, plans: list[StagePlan], synchronous: dict, links: list[Link], mfu: float
) -> dict:
    """The ``Async1F1B`` step of ``plans`` (``wire.async_schedule``), next to the synchronous
    prediction ``synchronous`` of the same layout: no fill and drain in steady state, each stage a
    microbatch per period ``max(T, (2 (L + x) + f + b) / d, x)`` (``T`` the busiest stage's
    forward + backward, ``x`` a message's time on the slowest link, ``message_seconds``, ``L``
    the largest latency, ``d`` the hop depth: the configured one under ``Async1F1B``, else the
    smallest that hides the round trip, at most the largest the microbatches allow), so ``M``
    periods a step,
    and at every flush (validation, checkpoint, last step) the synchronous step's fill and drain.
    No collective is waited for between flushes (the norms travel per batch, a log step's
    metrics gather is not waited on). Seconds:
    ``hop_needed``, ``hop``, ``steady_s``, ``flushes_s`` (amortized per step), ``step_s``;
    ``tokens_per_s``."""
    _, n_mb, _ = microbatching(config)
    stages, replicas = config.layout_stages, config.replicas
    latency = max((link.latency_s for link in links), default=0.0)
    fwd_msg, bwd_msg = message_bytes(config)
    wire = max((message_seconds(n, link, replicas) for n in (fwd_msg, bwd_msg) for link in links),
               default=0.0)  # fmt: skip
    fwd = max(compute_seconds(config, p.fwd_flops, mfu) for p in plans)
    bwd = max(compute_seconds(config, p.bwd_flops, mfu) for p in plans)
    slot = max(compute_seconds(config, p.fwd_flops + p.bwd_flops, mfu) for p in plans)
    needed = hop_depth(latency, wire, fwd, bwd, slot)
    if config.parallelism.pipeline_parallel_schedule == ASYNC_SCHEDULE:
        hop = config.transport.async_hop_depth
    else:
        hop = max(1, min(needed, max_hop_depth(stages, n_mb)))
    period = max(slot, (2 * (latency + wire) + fwd + bwd) / hop, wire)
    steady = n_mb * period
    training, validator, ckpt = config.training, config.validator, config.checkpoint
    flush_steps = {training.steps}
    if validator.enable:
        flush_steps |= {1, *range(validator.freq, training.steps + 1, validator.freq)}
    if ckpt.enable:
        flush_steps |= set(range(ckpt.interval, training.steps + 1, ckpt.interval))
    drain = max(0.0, synchronous["step_s"] - synchronous["collectives_s"] - steady)
    flushes = drain * len(flush_steps) / training.steps
    step = steady + flushes
    tokens = replicas * training.local_batch_size * training.seq_len
    return {"hop_needed": needed, "hop": hop, "steady_s": steady, "flushes_s": flushes,
            "step_s": step, "tokens_per_s": tokens / step}  # fmt: skip


def collective_rounds_per_step(config) -> float:
    """Latency rounds of the collectives across the pipeline on a step's critical path, on
    average (module docstring): the gradient norm's all-reduce unless it is exchanged, and a
    log step's all-gather (every ``log_freq`` steps) unless its rows travel with the exchange
    (``ProtocolTrainer._rows_travel_with_norm``)."""
    stages = config.layout_stages
    if stages < 2:
        return 0.0
    exchanged = config.transport.exchange_grad_norm
    rounds = 0.0 if exchanged else ring_rounds("all_reduce", stages)
    reduced_loss = config.replicas > 1 or config.parallelism.context_parallel_degree > 1
    mapl = config.protocol.mode == "mapl"  # its boundary sync meters bytes after the exchange
    if not exchanged or reduced_loss or mapl:
        rounds += ring_rounds("all_gather", stages) / config.metrics.log_freq
    return rounds


def peak_tflops(hardware) -> float:
    """The TFLOP/s of one GPU the compute estimate divides by: ``[hardware] peak_tflops``, or
    ``ASSUMED_PEAK_TFLOPS`` where it is unset."""
    return ASSUMED_PEAK_TFLOPS if hardware.peak_tflops is None else hardware.peak_tflops


def compute_seconds(config, flops: float, mfu: float) -> float:
    return flops / (mfu * peak_tflops(config.hardware) * 1e12)


def microbatching(config) -> tuple[int, int, int]:
    """(bytes per activation element, microbatches per step, tokens per microbatch)."""
    training, par = config.training, config.parallelism
    act_bytes = 2 if training.mixed_precision_param == "bfloat16" else 4
    mb = par.pipeline_parallel_microbatch_size
    return act_bytes, training.local_batch_size // mb, mb * training.seq_len
