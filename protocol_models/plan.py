"""Dry-run planner: check a layout before paying for GPUs.

    python -m protocol_models.plan --toml FILE [--bandwidth-mbps B] [--latency-ms L] [overrides]

Builds the model on the meta device (no weights, no GPU), splits it into the configured pipeline
stages exactly as a run would, and prints per stage: parameters, a memory estimate, whether it
fits ``[hardware] gpu_memory_gib``, the wire bytes per step at each boundary (dense vs the
configured mode) and the wire lower bound on step time at the given link. Exits 1 if a stage
does not fit, 2 on a bad config.

Memory model (per GPU of a stage; FSDP shards over ``data_parallel_shard_degree``):

* parameters fp32 (4 B), gradients fp32 (4 B), AdamW moments (8 B): 16 B/param, sharded;
* with bf16 mixed precision, one block's unsharded bf16 parameters (2 B/param) during compute;
* activations per in-flight microbatch (GPipe keeps all of them until the backward):
  without activation checkpointing ``a * (10 d + 4 h)`` bytes per token per block, ``a`` the
  activation dtype's size (stream, norms, q/k/v, attention output, SwiGLU intermediates); with
  full checkpointing only the block inputs ``a * d`` per token per block, plus one block's full
  set for the recompute;
  the last stage adds ``6 B`` per logit (bf16 logits and the fp32 log-softmax kept for the
  backward);
* the frozen token table F (``V x d`` in ``protocol.table_dtype``) and U (``d x k`` fp32);
* 10% headroom for the allocator and communication buffers.

Wire model: each microbatch crosses each boundary once forward and once backward, ``mb x seq x
width`` activations in the activation dtype. All data-parallel replicas of a boundary share the
one inter-region link's bandwidth; each replica's messages pay the latency one after another
(stop-and-wait, as in ``protocol_models.link``). The bound for the busiest receiving stage is
``8 * bytes_in / bandwidth + messages_per_replica * latency``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from protocol_models.config import load_config, split_argv
from protocol_models.errors import UserError
from protocol_models.model import build_model_config, stage_layer_ranges
from protocol_models.pipeline import split_stage

GIB = 1024**3
HEADROOM = 1.10


@dataclass
class StagePlan:
    stage: int
    layers: range
    params: int
    memory: dict[str, float]

    @property
    def total_bytes(self) -> float:
        return sum(self.memory.values()) * HEADROOM


def analytical_param_count(arch, k: int | None, constrained_layers: set[int]) -> int:
    """Closed-form parameter count of the Protocol LLaMA (``k=None``: dense)."""
    d, v = arch.dim, arch.vocab_size
    head_dim = d // arch.n_heads
    kv = (arch.n_kv_heads or arch.n_heads) * head_dim
    hidden = arch.hidden_dim
    total = v * (k if k and constrained_layers else d) + d + d * v  # embedding, final norm, head
    for layer in range(arch.n_layers):
        out = k if k and layer in constrained_layers else d
        attention = d * d + 2 * d * kv + d * out
        feed_forward = 2 * d * hidden + hidden * out
        total += attention + feed_forward + 2 * d
    return total


def plan_stages(config) -> list[StagePlan]:
    """Per-stage parameters and memory of ``config``'s layout, from a meta-device model."""
    arch, protocol, par = config.model, config.protocol, config.parallelism
    stages = config.layout_stages
    with torch.device("meta"):
        model = build_model_config(arch, protocol, stages).build()
    fsdp = max(par.data_parallel_shard_degree, 1)
    act_bytes, n_mb, tokens = _microbatching(config)
    bf16 = act_bytes == 2
    hidden = arch.hidden_dim
    per_block_full = act_bytes * (10 * arch.dim + 4 * hidden) * tokens
    checkpointed = config.activation_checkpoint is not None
    per_block_kept = act_bytes * arch.dim * tokens if checkpointed else per_block_full
    table_bytes = 2 if protocol.table_dtype == "bfloat16" else 4

    plans = []
    for s, layers in enumerate(stage_layer_ranges(arch.n_layers, stages)):
        chunk = split_stage(model, s, stages)
        params = sum(p.numel() for p in chunk.parameters())
        block_params = max(
            (sum(p.numel() for p in b.parameters()) for b in chunk.layers.values()), default=0
        )
        activations = n_mb * len(layers) * per_block_kept + (per_block_full if checkpointed else 0)
        if s == stages - 1:
            activations += n_mb * tokens * arch.vocab_size * 6
        memory = {
            "weights+grads+adam": 16 * params / fsdp,
            "unsharded block (bf16)": 2 * block_params if bf16 and fsdp > 1 else 0.0,
            "activations": activations,
            "F and U": (
                arch.vocab_size * arch.dim * table_bytes + arch.dim * protocol.k * 4
                if getattr(chunk, "subspace", False)
                else 0.0
            ),
        }
        plans.append(StagePlan(s, layers, params, memory))
    return plans


def wire_plan(config, bandwidth_mbps: float | None, latency_ms: float) -> dict:
    """Bytes per step at each boundary (all data-parallel replicas) and the wire lower bound."""
    arch, protocol, par = config.model, config.protocol, config.parallelism
    act_bytes, n_mb, tokens = _microbatching(config)
    dp = par.data_parallel_replicate_degree * max(par.data_parallel_shard_degree, 1)
    width = protocol.k if protocol.mode == "subspace" else arch.dim
    message = tokens * width * act_bytes
    dense_message = tokens * arch.dim * act_bytes
    per_boundary = 2 * n_mb * dp * message
    dense_per_boundary = 2 * n_mb * dp * dense_message
    bound = None
    if bandwidth_mbps:
        # the busiest receiving stage (a middle one) gets n_mb forward and n_mb backward messages
        # per data-parallel replica; the replicas share the region's link bandwidth, while each
        # replica's messages pay the latency one after another (stop-and-wait)
        inbound = 2 if config.layout_stages > 2 else 1
        shared_bytes = inbound * n_mb * dp * message
        bound = 8 * shared_bytes / (bandwidth_mbps * 1e6) + inbound * n_mb * latency_ms / 1e3
    return {
        "message_bytes": message,
        "per_boundary_bytes": per_boundary,
        "dense_per_boundary_bytes": dense_per_boundary,
        "ratio": dense_per_boundary / per_boundary,
        "lower_bound_s": bound,
    }


def _microbatching(config) -> tuple[int, int, int]:
    """(bytes per activation element, microbatches per step, tokens per microbatch)."""
    training, par = config.training, config.parallelism
    act_bytes = 2 if training.mixed_precision_param == "bfloat16" else 4
    mb = par.pipeline_parallel_microbatch_size
    return act_bytes, training.local_batch_size // mb, mb * training.seq_len


def render(config, plans: list[StagePlan], wire: dict, bandwidth_mbps, latency_ms) -> str:
    hw, par = config.hardware, config.parallelism
    dp = par.data_parallel_replicate_degree * max(par.data_parallel_shard_degree, 1)
    world = config.layout_stages * dp * par.tensor_parallel_degree
    lines = [
        f"model: d={config.model.dim}, {config.model.n_layers} layers, "
        f"vocab {config.model.vocab_size}, mode={config.protocol.mode}"
        + (f", k={config.protocol.k}" if config.protocol.mode == "subspace" else ""),
        f"total parameters: {sum(p.params for p in plans):,}",
        f"layout: {config.layout_stages} pipeline stages x {dp} data-parallel = {world} GPUs "
        f"({hw.gpus_per_node} per node, {hw.gpu_memory_gib:g} GiB each); "
        f"{config.training.local_batch_size // par.pipeline_parallel_microbatch_size} microbatches "
        f"of {par.pipeline_parallel_microbatch_size} x {config.training.seq_len} tokens, "
        f"{par.pipeline_parallel_schedule}",
        "",
        "| stage | layers | ranks (nodes) | params | weights+grads+adam | unsharded block "
        "| activations | F and U | total (+10%) | fits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in plans:
        first_rank = p.stage * dp * par.tensor_parallel_degree
        last_rank = first_rank + dp * par.tensor_parallel_degree - 1
        nodes = f"{first_rank // hw.gpus_per_node}-{last_rank // hw.gpus_per_node}"
        fits = p.total_bytes <= hw.gpu_memory_gib * GIB
        mem = [f"{v / GIB:.2f}" for v in p.memory.values()]
        lines.append(
            f"| {p.stage} | {p.layers.start}-{p.layers.stop - 1} "
            f"| {first_rank}-{last_rank} ({nodes}) | {p.params:,} | {' | '.join(mem)} "
            f"| {p.total_bytes / GIB:.2f} GiB | {'yes' if fits else 'NO'} |"
        )
    lines += [
        "",
        f"wire per boundary per step (fwd + bwd, all {dp} data-parallel replicas): "
        f"{wire['per_boundary_bytes'] / 1e6:,.1f} MB ({config.protocol.mode}) vs "
        f"{wire['dense_per_boundary_bytes'] / 1e6:,.1f} MB dense -> {wire['ratio']:.1f}x; "
        f"one message {wire['message_bytes'] / 1e3:,.1f} kB",
    ]
    if wire["lower_bound_s"] is not None:
        lines.append(
            f"wire lower bound on step time at {bandwidth_mbps:g} Mbit/s + {latency_ms:g} ms: "
            f"{wire['lower_bound_s']:.2f} s (busiest receiving stage)"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m protocol_models.plan", add_help=True)
    parser.add_argument("--bandwidth-mbps", type=float, default=None)
    parser.add_argument("--latency-ms", type=float, default=0.0)
    known, rest = parser.parse_known_args(argv)
    toml_path, overrides = split_argv(rest)
    try:
        config = load_config(toml_path, overrides, check_environment=False)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plans = plan_stages(config)
    wire = wire_plan(config, known.bandwidth_mbps, known.latency_ms)
    print(render(config, plans, wire, known.bandwidth_mbps, known.latency_ms))
    limit = config.hardware.gpu_memory_gib * GIB
    too_big = [p for p in plans if p.total_bytes > limit]
    if too_big:
        worst = max(too_big, key=lambda p: p.total_bytes)
        print(
            f"error: stage {worst.stage} needs {worst.total_bytes / GIB:.1f} GiB per GPU, "
            f"more than hardware.gpu_memory_gib = {config.hardware.gpu_memory_gib:g} "
            "(more pipeline stages, more data_parallel_shard_degree, activation_checkpoint "
            '= "full" '
            "or smaller microbatches reduce it)",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
