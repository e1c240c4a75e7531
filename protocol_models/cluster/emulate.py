"""Emulate a target cluster's slow link on a small machine: the ``[wan]`` link under which a
small workload spends the same share of its step on the wire as a production model on its GPUs.

    python -m protocol_models.emulate --target configs/llama3_2b_protocol.toml \\
        --bandwidth-mbps 80 --latency-ms 50 --reference configs/reference_cpu.toml \\
        --reference-step-s 1.17 [--mfu 0.4]

A benchmark on this repository's CPU reference workload with the real link settings (80 Mbit/s,
50 ms) measures a regime no user is in: the CPU computes so slowly that a d=256 boundary message
costs little next to a step. What decides a user's choice is the *ratio* of wire time to compute
on their hardware. The planner predicts both for a production config (``protocol_models.plan``:
FLOPs at an MFU of the GPU's ``[hardware] peak_tflops``, the link model's ``transfer_seconds``),
so the ratio can be carried over:

* target (the production config's **dense twin** on its GPUs, planner-predicted): ``S_t``, the
  step with the link off; ``L_t``, one boundary message on the target link (``replicas``
  data-parallel messages share it); ``W_t = 2 M_t L_t``, a boundary's wire time per step
  (``M_t`` microbatches, forward and backward);
* reference (measured on this machine): ``S_r``, the dense twin's link-off step time of the
  pipelined run the benchmark will time (``reference_step_s``); ``M_r`` microbatches.

The emulated link gives each dense reference message the time ``L_r = (W_t / S_t) S_r / (2 M_r)``
(so ``W_r / S_r = W_t / S_t``), split into latency and bandwidth time in the target message's
proportions. Compressed arms then pay their own bytes on that link. ``time_scale = S_r / S_t``
converts reference seconds into target seconds (an L4-equivalent time).

Assumptions (stated with every result): the planner's compute model (MFU, GPipe, no overlap of
compute with communication beyond the pipeline's), link-off compute equal for the dense and the
compressed models (the U lifts cost < 0.2%), and a ratio -- not the schedule's shape -- being what
matters: the reference has fewer stages and microbatches than the target.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from dataclasses import dataclass

from protocol_models.cluster.network import Link, boundary_links
from protocol_models.cluster.plan import message_bytes, plan_stages, predict_step
from protocol_models.config.run_config import load_config
from protocol_models.tools.errors import UserError
from protocol_models.wire.link import transfer_seconds


@dataclass(frozen=True)
class EmulatedLink:
    """The ``[wan]`` settings for the reference workload, and what they stand for."""

    bandwidth_mbps: float
    latency_ms: float
    time_scale: float
    """Reference seconds per target second (``S_r / S_t``)."""
    wire_share: float
    """``W_t / S_t``: a boundary's dense wire time per step over the link-off step time."""
    target_step_s: float
    """``S_t``: the target's planner-predicted link-off step."""
    target_message_s: float
    """``L_t``: one dense message on the target link."""


def dense_twin(config):
    """``config`` with ``protocol.mode = "dense"`` (the same layout, the uncompressed wire)."""
    twin = dataclasses.replace(config)
    twin.protocol = dataclasses.replace(config.protocol, mode="dense", stage_tables=False)
    twin.codec = dataclasses.replace(config.codec, bits=None)
    return twin


def microbatches(config) -> int:
    """Microbatches per step of one pipeline."""
    par = config.parallelism
    return config.training.local_batch_size // par.pipeline_parallel_microbatch_size


def emulated_link(
    target,
    bandwidth_mbps: float,
    latency_ms: float,
    reference,
    reference_step_s: float,
    mfu: float = 0.4,
) -> EmulatedLink:
    """The link that gives ``reference`` (link-off dense step ``reference_step_s`` measured)
    the wire-time share of ``target``'s dense twin at ``bandwidth_mbps`` + ``latency_ms``."""
    if reference_step_s <= 0 or bandwidth_mbps <= 0 or latency_ms < 0:
        raise UserError(
            "emulation needs reference_step_s > 0, bandwidth_mbps > 0 and latency_ms >= 0"
        )
    dense_t, dense_r = dense_twin(target), dense_twin(reference)
    no_link = boundary_links(dense_t, Link(None, 0.0))
    step_t = predict_step(dense_t, plan_stages(dense_t), no_link, mfu)["step_s"]
    bytes_t = target.replicas * message_bytes(dense_t)[0]
    latency_s, bps = latency_ms / 1e3, bandwidth_mbps * 1e6
    message_t = transfer_seconds(bytes_t, bps, latency_s)
    wire_share = 2 * microbatches(target) * message_t / step_t
    message_r = wire_share * reference_step_s / (2 * microbatches(reference))
    # keep the target message's latency : bandwidth proportions; the link model is linear in
    # the latency and in 1 / bandwidth, so each part scales on its own
    latency_part = transfer_seconds(bytes_t, math.inf, latency_s) / message_t * message_r
    bytes_r = reference.replicas * message_bytes(dense_r)[0]
    bandwidth_part = message_r - latency_part
    latency_r = latency_s * latency_part / transfer_seconds(bytes_r, math.inf, latency_s)
    per_bit = (transfer_seconds(bytes_r, bps, 0.0)) / bandwidth_part  # new bps / old bps
    return EmulatedLink(
        bandwidth_mbps=bandwidth_mbps * per_bit,
        latency_ms=latency_r * 1e3,
        time_scale=reference_step_s / step_t,
        wire_share=wire_share,
        target_step_s=step_t,
        target_message_s=message_t,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protocol_models.emulate",
                                     description=__doc__.split("\n\n")[0])  # fmt: skip
    parser.add_argument("--target", required=True, help="the production TOML (its [hardware])")
    parser.add_argument("--bandwidth-mbps", type=float, required=True, help="the target link")
    parser.add_argument("--latency-ms", type=float, required=True, help="one way, per message")
    parser.add_argument("--reference", required=True, help="the TOML the benchmark runs")
    parser.add_argument("--reference-step-s", type=float, required=True,
                        help="its measured link-off step time (dense, pipelined)")  # fmt: skip
    parser.add_argument("--mfu", type=float, default=0.4)
    args = parser.parse_args(argv)
    try:
        target = load_config(args.target, [], check_environment=False)
        reference = load_config(args.reference, [], check_environment=False)
        link = emulated_link(target, args.bandwidth_mbps, args.latency_ms, reference,
                             args.reference_step_s, args.mfu)  # fmt: skip
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"# {args.target} at {args.bandwidth_mbps:g} Mbit/s + {args.latency_ms:g} ms, MFU "
        f"{args.mfu:g}: a dense boundary spends {link.wire_share:.2f}x the link-off step "
        f"({link.target_step_s:.2f} s) on the wire; reference seconds per target second: "
        f"{link.time_scale:.3f}\n[wan]\nbandwidth_mbps = {link.bandwidth_mbps:.4g}\n"
        f"latency_ms = {link.latency_ms:.4g}"
    )
    return 0
