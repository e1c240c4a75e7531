"""The dry-run planner: exact parameter counts, memory that fits, and fast answers."""

from __future__ import annotations

import math
import re
import subprocess
import sys
import time

import pytest
from conftest import REPO

from protocol_models.cluster.advice import checkpoint_disk
from protocol_models.cluster.emulate import emulated_link
from protocol_models.cluster.network import Link, boundary_links
from protocol_models.cluster.plan import (
    ASSUMED_PEAK_TFLOPS,
    GIB,
    REGION,
    StagePlan,
    _minimax_split,
    async_config,
    fsdp_bytes,
    fsdp_seconds,
    plan_stages,
    predict_async_step,
    predict_step,
    propose_split,
    stage_communicators,
    stage_cost,
    stage_params,
)
from protocol_models.cluster.planner import async_refusal
from protocol_models.cluster.planner import main as plan_main
from protocol_models.config.run_config import load_config
from protocol_models.model.layout import stage_layer_ranges
from protocol_models.model.model import ModelArch
from protocol_models.tools.errors import UserError
from protocol_models.training.optimizers import OPTIMIZERS
from protocol_models.wire.link import tcp_wire_bytes, transfer_seconds


def links(config, mbps: float | None, ms: float) -> list[Link]:
    """Every boundary of ``config`` on one link (the planner without ``--regions``)."""
    return boundary_links(config, Link(mbps, ms))


CONFIGS = ["llama3_8b_protocol", "llama3_8b_dense", "llama3_2b_protocol", "llama3_2b_dense"]


@pytest.mark.parametrize("name", CONFIGS)
def test_parameter_counts_match_the_architecture(name):
    """The closed-form count of every stage equals the meta-device model's, split as a run is."""
    config = load_config(str(REPO / "configs" / f"{name}.toml"), [], check_environment=False)
    ranges = stage_layer_ranges(
        config.model.n_layers, config.layout_stages, config.protocol.layers_per_stage
    )
    plans = plan_stages(config)
    assert [p.layers for p in plans] == ranges
    assert [p.params for p in plans] == [
        stage_params(config, s, len(r)) for s, r in enumerate(ranges)
    ]
    if name == "llama3_8b_dense":
        assert sum(p.params for p in plans) == 8_030_261_248  # Meta's LLaMA-3 8B (untied head)


@pytest.mark.parametrize("name", CONFIGS)
def test_planner_cli_fits_and_is_fast(name):
    start = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.plan", "--toml", f"configs/{name}.toml",
         "--bandwidth-mbps", "80", "--latency-ms", "50"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert time.monotonic() - start < 60
    rows = [line for line in result.stdout.splitlines() if line[:3] in {f"| {i}" for i in range(9)}]
    config = load_config(str(REPO / "configs" / f"{name}.toml"), [], check_environment=False)
    stages = config.layout_stages
    assert len(rows) == stages and all("| yes |" in line for line in rows)
    assert "predicted step time" in result.stdout
    # k = 40 8-bit codes + a bf16 scale per token against 4096 bf16 values: 8192 / 42
    assert "195.0x" in result.stdout or "dense" in name


def test_planner_refuses_a_layout_that_does_not_fit():
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.plan", "--toml", "configs/llama3_8b_protocol.toml",
         "--parallelism.data_parallel_shard_degree", "1", "--activation_checkpoint", "none"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 1
    assert "more than hardware.usable_memory_gib = 22.5" in result.stderr


def test_remedies_are_ranked_by_the_memory_they_leave(capsys):
    """The 2B with full logits on its last stage does not fit an L4: each remedy is planned
    alone and printed with the largest stage's GiB after it, smallest first; the chunked loss
    is the one that fits."""
    toml = str(REPO / "configs/llama3_2b_protocol.toml")
    assert plan_main(["--toml", toml, "--model.loss_chunk_tokens", "0"]) == 1
    out = capsys.readouterr().out
    remedies = re.findall(r"^  \d+\. (.+?): ([\d.]+) GiB, (fits|still too large)", out,
                          re.MULTILINE)  # fmt: skip
    sizes = [float(gib) for _, gib, _ in remedies]
    assert len(remedies) >= 4 and sizes == sorted(sizes)
    assert all((gib <= 22.5) == (verdict == "fits") for (_, _, verdict), gib
               in zip(remedies, sizes, strict=True))  # fmt: skip
    assert remedies[0][0] == "the loss in chunks of 1024 tokens" and remedies[0][2] == "fits"
    chunked = load_config(toml, [], check_environment=False)  # the config's own 1024
    assert float(remedies[0][1]) == pytest.approx(
        max(p.total_bytes for p in plan_stages(chunked)) / GIB, abs=0.005)  # fmt: skip


# A tiny layout whose every memory term and FLOP count is checked against the formulas by hand:
# d=64, kv=2x16=32, SwiGLU h=96, H=4 heads, V=512, k=4; bf16 (a=2); 3 stages of [2, 1, 1] blocks;
# 4 microbatches of 2 x 16 tokens (T=32); FSDP degree D=2.
TINY = [
    "--model.dim", "64", "--model.n_layers", "4", "--model.n_heads", "4", "--model.n_kv_heads", "2",
    "--model.vocab_size", "512", "--model.ffn_hidden_dim", "96", "--protocol.k", "4",
    "--protocol.table_dtype", "bfloat16", "--protocol.layers_per_stage", "[2, 1, 1]",
    "--optimizer.name", "adamw", "--parallelism.pipeline_parallel_degree", "3",
    "--parallelism.pipeline_parallel_microbatch_size", "2",
    "--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "8",
    "--training.seq_len", "16", "--training.mixed_precision_param", "bfloat16",
]  # fmt: skip
# constrained block: wq 64x64, wk and wv 64x32, wo 64x4 (k-wide), w1 and w3 64x96, w2 96x4
FACTORED_WEIGHTS = 4096 + 2048 + 2048 + 256 + 6144 + 6144 + 384
STOCK_WEIGHTS = 4096 + 2048 + 2048 + 4096 + 6144 + 6144 + 6144  # wo 64x64, w2 96x64
NORMS, EMBEDDING, HEAD = 2 * 64, 512 * 4, 64 + 512 * 64  # E is V x k; final norm + LM head
PARAMS = [
    EMBEDDING + 2 * (FACTORED_WEIGHTS + NORMS),
    FACTORED_WEIGHTS + NORMS,
    STOCK_WEIGHTS + NORMS + HEAD,
]
UNSAVED = 2 * (7 * 64 + 2 * 32 + 4 * 96) + 4 * 4  # per token per block without checkpointing
# selective keeps the block input, attention output, log-sum-exp and the 1st, 3rd, ... matmul
# outputs: factored wq 64, wv 32, lift 64, w3 96, lift 64; stock wq 64, wv 32, w1 96, w2 64
KEPT = {
    "none": (UNSAVED, UNSAVED),
    "selective": (
        2 * (2 * 64 + 64 + 32 + 64 + 96 + 64) + 16,
        2 * (2 * 64 + 64 + 32 + 96 + 64) + 16,
    ),
    "full": (2 * 64, 2 * 64),
}
# the 2nd, 4th, ... matmuls selective recomputes: factored wk, wo, w1, w2; stock wk, wo, w3
RECOMPUTED = {"factored": 2048 + 256 + 6144 + 384, "stock": 2048 + 4096 + 6144}


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_memory_and_flops_match_the_closed_forms(ac):
    config = load_config(None, [*TINY, "--activation_checkpoint", ac], check_environment=False)
    plans = plan_stages(config)
    assert [p.params for p in plans] == PARAMS
    tokens, in_flight = 32, 4
    blocks, factored = [2, 1, 1], [True, True, False]
    outputs = [2 * 4, 2 * 4, 2 * 2 * 64]  # c (k=4) kept for the backward; last: norm in and out
    for s, plan in enumerate(plans):
        kept = KEPT[ac][0 if factored[s] else 1]
        recompute = tokens * UNSAVED if ac != "none" else 0
        logits = 6 * 512 * in_flight * tokens + 8 * 512 * tokens if s == 2 else 0
        assert plan.memory == {
            "state 16P/D": 16 * PARAMS[s] / 2,
            "unsharded": 6 * PARAMS[s],
            "activations": in_flight * tokens * (blocks[s] * kept + outputs[s]) + recompute,
            "logits": logits,
            "F and U": 512 * 64 * 2 + 4 * 64 * 4,
            "context": GIB,
        }
        weights = blocks[s] * (FACTORED_WEIGHTS if factored[s] else STOCK_WEIGHTS)
        attention = blocks[s] * 4 * 64 * 16 * tokens  # 4 d seq per token per block, forward
        fwd = 2 * (weights + (512 * 64 if s == 2 else 0)) * tokens + attention
        extra = {
            "none": 0,
            "full": 2 * weights * tokens + attention,
            "selective": blocks[s]
            * 2
            * RECOMPUTED["factored" if factored[s] else "stock"]
            * tokens,
        }[ac]
        assert (plan.fwd_flops, plan.bwd_flops) == (fwd, 2 * fwd + extra)
        assert plan.total_bytes == pytest.approx(
            1.10 * (sum(plan.memory.values()) + plan.nccl_bytes))  # fmt: skip


def test_1f1b_and_the_chunked_loss_shrink_the_last_stage():
    config = load_config(
        None, [*TINY, "--parallelism.pipeline_parallel_schedule", "1F1B"], check_environment=False
    )
    plans = plan_stages(config)
    tokens = 32
    for plan, in_flight in zip(plans, [3, 2, 1], strict=True):  # min(M, S - s)
        assert plan.memory["activations"] == in_flight * tokens * (
            len(plan.layers) * KEPT["none"][plan.stage == 2] + [8, 8, 256][plan.stage]
        )
    assert plans[2].memory["logits"] == 6 * 512 * 1 * tokens + 8 * 512 * tokens
    if not hasattr(ModelArch, "loss_chunk_tokens"):
        return
    chunked = load_config(None, [*TINY, "--model.loss_chunk_tokens", "8"], check_environment=False)
    # one 8-token chunk: bf16 logits, fp32 copy, log-softmax, gradients (2 + 12 B per logit);
    # the head gradient's fp32 accumulator and its bf16 cast (4 + 2 B per weight)
    assert plan_stages(chunked)[2].memory["logits"] == 14 * 512 * 8 + 6 * 512 * 64


def test_step_time_is_the_gpipe_pipeline_with_links_as_stages():
    """3 stages, 4 microbatches, 2 data-parallel replicas sharing each link, every step logged
    (``metrics.log_freq = 1``):
    the pass formula with pre-posted receives (links as servers of their own) and without
    (a link and the stage it feeds serve a microbatch together), split into its terms, plus
    the collectives' latency rounds."""
    logged = [*TINY, "--metrics.log_freq", "1"]
    config = load_config(None, logged, check_environment=False)
    flops = 1e12
    plans = [StagePlan(s, range(s, s + 1), 0, {}, flops, 2 * flops) for s in range(3)]
    t = flops / (0.5 * 121e12)
    stages, microbatches = 3, 4
    alone = predict_step(config, plans, links(config, None, 0.0), mfu=0.5)
    assert alone["step_s"] == pytest.approx((microbatches + stages - 1) * 3 * t)  # GPipe bubble
    assert alone["compute_s"] == pytest.approx(microbatches * 3 * t)
    assert alone["bubble_s"] == pytest.approx((stages - 1) * 3 * t)
    linked = predict_step(config, plans, links(config, 80.0, 50.0), mfu=0.5)
    payload = 2 * (32 * 4 * 2)  # 2 replicas share the link; 32 tokens x k=4 x bf16
    w = 8 * (payload + 52) / 80e6  # one TCP segment's headers
    # the norm is exchanged, but the replicas' losses need a reduction: the log step's metrics
    # take one all-gather (2 rounds at 3 stages) every step (log_freq 1)
    gather = 2 * 0.05
    fwd = 3 * t + 2 * (w + 0.05) + 3 * max(t, w)
    bwd = 3 * 2 * t + 2 * (w + 0.05) + 3 * max(2 * t, w)
    assert linked["step_s"] == pytest.approx(fwd + bwd + gather)
    assert linked["latency_s"] == pytest.approx(4 * 0.05)
    assert linked["bytes_s"] == pytest.approx(4 * w)
    assert linked["collectives_s"] == pytest.approx(gather)
    assert linked["tokens_per_s"] == pytest.approx(2 * 8 * 16 / (fwd + bwd + gather))
    just_in_time = load_config(None, [*logged, "--transport.prepost_receives", "false",
                                      "--transport.exchange_grad_norm", "false",
                                      "--hardware.device", "cpu"],  # gloo: receiver-driven
                               check_environment=False)  # fmt: skip
    jit = predict_step(just_in_time, plans, links(just_in_time, 80.0, 50.0), mfu=0.5)
    link = w + 0.05
    fwd = 3 * t + 2 * link + 3 * max(t, 0.05 + link + t)
    bwd = 3 * 2 * t + 2 * link + 3 * max(2 * t, 0.05 + link + 2 * t)
    all_reduce = 4 * 0.05
    assert jit["step_s"] == pytest.approx(fwd + bwd + all_reduce + gather)
    # NCCL (a CUDA config): sender-driven over its sockets, a late receive costs nothing
    on_nccl = load_config(None, [*logged, "--transport.prepost_receives", "false",
                                 "--transport.exchange_grad_norm", "false"],
                        check_environment=False)  # fmt: skip
    nccl = predict_step(on_nccl, plans, links(on_nccl, 80.0, 50.0), mfu=0.5)
    assert nccl["step_s"] == pytest.approx(linked["step_s"] + all_reduce)


def test_compute_divides_by_the_set_peak_or_says_it_assumed_an_l4(capsys):
    """Without ``[hardware] peak_tflops`` the compute estimate assumes an L4's 121 TFLOP/s and
    the report says so; a set value replaces it and the report assumes nothing."""
    plans = [StagePlan(s, range(s, s + 1), 0, {}, 1e12, 2e12) for s in range(3)]
    for extra, peak in (([], ASSUMED_PEAK_TFLOPS), (["--hardware.peak_tflops", "989"], 989.0)):
        config = load_config(None, [*TINY, *extra], check_environment=False)
        compute = predict_step(config, plans, links(config, None, 0.0), mfu=0.5)["compute_s"]
        assert compute == pytest.approx(4 * 3e12 / (0.5 * peak * 1e12))
        assert plan_main(["--toml", str(REPO / "tests" / "tiny.toml"), *TINY, *extra]) == 0
        said = "assumed: 121 TFLOP/s peak per GPU" in capsys.readouterr().out
        assert said == (not extra)


def test_async_step_has_no_fill_and_drain_but_at_flushes():
    """Async1F1B on 3 stages of 4 microbatches (hop depth 1, all the microbatches allow): each
    stage keeps its depth + 1 microbatches and two weight versions (with gradients); the step is
    M periods of ``max(T, (2 (L + x) + f + b) / d, x)``, plus, at the one flush of 100 steps (the
    last), the synchronous fill and drain (the log steps' gathers are not waited for)."""
    over = [*TINY, "--parallelism.data_parallel_shard_degree", "1", "--training.steps", "100",
            "--parallelism.pipeline_parallel_schedule", "Async1F1B", "--metrics.log_freq", "10",
            "--hardware.device", "cpu"]  # fmt: skip
    config = load_config(None, over, check_environment=False)
    for plan, in_flight in zip(plan_stages(config), [3, 2, 1], strict=True):  # w_s + 1
        assert plan.memory["versions"] == 16 * plan.params
        assert plan.memory["activations"] == in_flight * 32 * (
            len(plan.layers) * KEPT["none"][plan.stage == 2] + [8, 8, 256][plan.stage]
        )
    predicting = load_config(None, [*over, "--optimizer.weight_prediction", "1"],
                             check_environment=False)  # fmt: skip
    for plan in plan_stages(predicting):  # and the last update
        assert plan.memory["versions"] == 20 * plan.params
    predicting = load_config(None, [*over, "--optimizer.weight_prediction", "1"],
                             check_environment=False)  # fmt: skip
    for plan in plan_stages(predicting):  # and the last update
        assert plan.memory["versions"] == 20 * plan.params
    flops = 1e12
    plans = [StagePlan(s, range(s, s + 1), 0, {}, flops, 2 * flops) for s in range(3)]
    t, w, latency = flops / (0.5 * 121e12), 8 * (32 * 4 * 2 + 52) / 80e6, 0.05
    for mbps, ms in ((None, 0.0), (80.0, 50.0)):
        sync = predict_step(config, plans, links(config, mbps, ms), mfu=0.5)
        result = predict_async_step(config, plans, sync, links(config, mbps, ms), mfu=0.5)
        loop = 2 * (latency + w) + 3 * t if mbps else 3 * t
        assert result["hop"] == 1 and result["hop_needed"] == math.ceil(loop / (3 * t))
        steady = 4 * max(3 * t, loop, w if mbps else 0.0)
        drain = max(0.0, sync["step_s"] - sync["collectives_s"] - steady)
        assert result["steady_s"] == pytest.approx(steady)
        assert result["step_s"] == pytest.approx(steady + drain / 100)


AT_80_50 = ["--bandwidth-mbps", "80", "--latency-ms", "50"]


@pytest.mark.parametrize("name", ["llama3_2b_protocol", "llama3_8b_protocol"])
def test_async_is_predicted_for_the_cuda_configs(name, capsys):
    """At 80 Mbit/s + 50 ms the planner prints the ``Async1F1B`` step of both CUDA configs
    (nowhere ``n/a``), the cost model's own figure, what it assumes, the config check's refusal
    where the layout is refused (the 8B's FSDP) and the schedule it recommends: ``Async1F1B``,
    with its settings and its memory under them, where the layout runs it."""
    toml = str(REPO / "configs" / f"{name}.toml")
    assert plan_main(["--toml", toml, *AT_80_50]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and "Async1F1B" in line]
    assert len(rows) == 4 and not any("n/a" in row for row in rows), rows
    config = load_config(toml, [], check_environment=False)
    plans, link = plan_stages(config), links(config, 80.0, 50.0)
    sync = predict_step(config, plans, link, 0.4)
    predicted = predict_async_step(config, plans, sync, link, 0.4)
    assert re.search(rf"\| = Async1F1B step \| [\d.]+ s \| {predicted['step_s']:.2f} s \|", out)
    assert "Async1F1B rows assume: one-step-delayed updates" in out
    refusal = async_refusal(config)
    assert (refusal is not None) == ("\nAsync1F1B does not run this layout" in out)
    if name == "llama3_8b_protocol":
        assert "parallelism.data_parallel_shard_degree = 16" in refusal and refusal in out
    if refusal is not None:
        assert "\nrecommended schedule: GPipe: Async1F1B does not run this layout" in out
        return
    largest = max(p.total_bytes for p in plan_stages(async_config(config, predicted["hop"])))
    assert (f"\nrecommended schedule: Async1F1B, predicted {predicted['step_s']:.2f} s per step "
            f"against GPipe's {sync['step_s']:.2f} s") in out  # fmt: skip
    assert (f"--parallelism.pipeline_parallel_schedule Async1F1B --transport.async_hop_depth "
            f"{predicted['hop']} --optimizer.weight_prediction 1; under it the largest stage "
            f"needs {largest / GIB:.2f} GiB with the margin") in out  # fmt: skip


def test_nccl_buffers_follow_nccls_defaults_per_communicator():
    """Per NCCL communicator a GPU holds, its buffers by NCCL 2.30's defaults at 2 channels: a
    ring's connections to its two neighbours each carry LL (512 KiB), LL128 (4,915,200 B) and
    SIMPLE (4 MiB) buffers; point-to-point across the network shares one 2 x 16 x 128 KiB pool
    per direction; on one node every peer, channel and direction gets the three. The 2B (one GPU
    per node): its boundaries' communicators (two or four), the norm exchange's, the pipeline's
    and the world's rings; the 8B adds FSDP's and the loss's; under Async1F1B the norm exchange
    takes a two-rank communicator per other stage and direction; TINY's 6 ranks share a node; a
    CPU config (gloo) holds none."""
    connection = 512 * 1024 + 4_915_200 + 4 * 1024**2
    ring, pool = 2 * 2 * connection, 2 * 16 * 128 * 1024

    def held(config, stage):
        return [(c.describe(), c.buffer_bytes) for c in stage_communicators(config, stage)]

    two_b = load_config(str(REPO / "configs/llama3_2b_protocol.toml"), [], check_environment=False)
    network = "point-to-point (network)"
    rings = [("pipeline ring", ring), ("world ring", ring)]
    assert held(two_b, 0) == [(f"boundary {network}", pool)] * 2 + [
        (f"norm exchange {network}", 2 * pool), *rings]  # fmt: skip
    assert held(two_b, 3)[:4] == [(f"boundary {network}", pool)] * 4
    asynchronous = async_config(two_b, 2)
    assert held(asynchronous, 3)[4:] == [(f"norm exchange {network}", pool)] * 14 + rings
    eight_b = load_config(str(REPO / "configs/llama3_8b_protocol.toml"), [],
                          check_environment=False)  # fmt: skip
    names = [f"norm exchange {network}", "pipeline ring", "FSDP ring", "loss ring", "world ring"]
    assert [name for name, _ in held(eight_b, 1)][4:] == names
    tiny = load_config(None, TINY, check_environment=False)  # 3 stages x 2 FSDP ranks, one node
    local = "point-to-point (intra-node)"
    assert held(tiny, 1) == [(f"boundary {local}", 2 * connection)] * 4 + [
        (f"norm exchange {local}", 2 * 2 * 2 * connection), ("pipeline ring", ring),
        ("FSDP ring", ring), ("loss ring", ring), ("world ring", ring)]  # fmt: skip
    cpu = load_config(None, [*TINY, "--hardware.device", "cpu"], check_environment=False)
    assert stage_communicators(cpu, 1) == ()


def test_memory_table_itemises_nccl_communicators(capsys):
    """The 2B's memory table has an NCCL column (GiB, in each stage's total) and, under it, each
    set of communicators with the stages that hold it and every communicator's buffers."""
    toml = str(REPO / "configs/llama3_2b_protocol.toml")
    assert plan_main(["--toml", toml, *AT_80_50]) == 0
    out = capsys.readouterr().out
    assert "| F and U | context | NCCL | total x1.10 |" in out
    assert "NCCL buffers per GPU, estimated from NCCL 2.30's defaults" in out
    items = ("8.0 MiB norm exchange point-to-point (network), 36.8 MiB pipeline ring, "
             "36.8 MiB world ring")  # fmt: skip
    boundary = "4.0 MiB boundary point-to-point (network)"
    assert f"  stages 0, 7: 2 x {boundary}, {items} = 89.5 MiB" in out
    assert f"  stages 1-6: 4 x {boundary}, {items} = 97.5 MiB" in out
    plan = plan_stages(load_config(toml, [], check_environment=False))[7]
    row = next(line for line in out.splitlines() if line.startswith("| 7 |"))
    assert f"| 1.00 | {plan.nccl_bytes / GIB:.2f} | {plan.total_bytes / GIB:.2f} | yes |" in row


def test_proposed_split_is_the_fastest_that_fits():
    """The dynamic program against brute force over every split, with a memory limit that rules
    some out."""
    config = load_config(
        None,
        [*TINY, "--model.n_layers", "7", "--protocol.layers_per_stage", "[3, 2, 2]"],
        check_environment=False,
    )
    n_layers, n_mb = 7, 4
    peak = 121e12 * 0.4

    def cost(s, n):
        memory, fwd, bwd = stage_cost(config, s, n, stage_params(config, s, n))
        nccl = sum(c.buffer_bytes for c in stage_communicators(config, s))
        return n_mb * (fwd + bwd) / peak, 1.10 * (sum(memory.values()) + nccl)

    splits = [
        [a, b, n_layers - a - b]
        for a in range(1, n_layers)
        for b in range(1, n_layers - a)
        if n_layers - a - b >= 1
    ]
    largest = sorted({max(cost(s, n)[1] for s, n in enumerate(split)) for split in splits})
    config.hardware.usable_memory_gib = largest[len(largest) // 2] / GIB
    fitting = [
        split
        for split in splits
        if max(cost(s, n)[1] for s, n in enumerate(split)) <= largest[len(largest) // 2]
    ]
    best = min(
        (
            max(cost(s, n)[0] for s, n in enumerate(split)),
            max(cost(s, n)[1] for s, n in enumerate(split)),
        )
        for split in fitting
    )
    split, seconds, memory = propose_split(config, 0.4)
    assert split in fitting
    assert (seconds, memory) == pytest.approx(best)
    config.hardware.usable_memory_gib = 1.0  # below the CUDA context: nothing fits
    assert propose_split(config, 0.4) is None
    assert _minimax_split(3, 3, lambda s, n: float(n)) == (1.0, [1, 1, 1])


def test_emulated_link_carries_the_targets_wire_share_over():
    """On the emulated link a dense reference boundary spends the 2B model's share of a step on
    the wire (per step, forward + backward), split into latency and bandwidth time as the
    target's dense message is (16 microbatches of [2, 1024, 4096] bf16)."""
    target = load_config(str(REPO / "configs/llama3_2b_protocol.toml"), [],
                         check_environment=False)  # fmt: skip
    reference = load_config(str(REPO / "configs/reference_cpu.toml"), [])
    for mbps in (80.0, 1000.0):
        link = emulated_link(target, mbps, 50.0, reference, reference_step_s=1.5)
        ref_bytes = 2 * 256 * 256 * 4  # [mb, seq, d] fp32 dense message
        message = transfer_seconds(ref_bytes, link.bandwidth_mbps * 1e6, link.latency_ms / 1e3)
        assert 2 * 4 * message / 1.5 == pytest.approx(link.wire_share, rel=1e-9)
        target_bytes = 2 * 1024 * 4096 * 2  # bf16 [2, 1024, 4096]
        target_message = transfer_seconds(target_bytes, mbps * 1e6, 0.05)
        assert link.target_message_s == pytest.approx(target_message)
        assert link.wire_share == pytest.approx(2 * 16 * target_message / link.target_step_s)
        assert link.latency_ms / 1e3 / message == pytest.approx(0.05 / target_message)


def test_the_planner_needs_a_config(capsys):
    """Without ``--toml`` the planner refuses in one line instead of planning a built-in model."""
    assert plan_main(["--bandwidth-mbps", "80"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: the planner needs --toml FILE")


def test_ratio_chooses_the_widest_8_bit_wire(capsys):
    """``--ratio 100`` on the 8B (d = 4096 in bf16: 8,192 bytes per token and direction dense):
    k 8-bit codes and a 2-byte scale, k + 2 <= 81.92, so k = 79; exact bf16 coordinates,
    2 k <= 81.92, k = 40; the plan is k = 79's. A dense config, a k given beside it, a ratio no
    k reaches and a ratio of at most 1 are refused in one line each."""
    toml = str(REPO / "configs/llama3_8b_protocol.toml")
    assert plan_main(["--toml", toml, "--ratio", "100"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("--ratio 100: k = 79 in 8 bits, 81 bytes per token and direction "
                          "(101.1x); exact coordinates would carry k = 40 at this ratio")  # fmt: skip
    assert "dense -> 101.1x" in out
    refusals = [
        (["--toml", str(REPO / "configs/llama3_8b_dense.toml"), "--ratio", "100"],
         "error: --ratio 100: chooses k for the modes whose wire is k quantizable coordinates "
         "(subspace, projected)"),
        (["--toml", toml, "--ratio", "100", "--protocol.k", "64"],
         "error: --ratio 100 chooses k and the bits itself: drop --protocol.k"),
        (["--toml", toml, "--ratio", "5000"],
         "error: --ratio 5000: even k = 1 in 8 bits compresses only 2730.7x here"),
        (["--toml", toml, "--ratio", "1"], "error: --ratio 1: the compression against dense"),
    ]  # fmt: skip
    for argv, start in refusals:
        assert plan_main(argv) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(start), line


def test_two_region_plan_prices_the_crossing_boundary_and_the_run(capsys):
    """The 2B on 8 L4s in 2 regions of 4 nodes: only boundary 3 crosses the 80 Mbit/s + 50 ms
    link, so the fill and drain's latency is 2 x (50 ms + 6 x 0.5 ms); the report prints the
    run's hours and GPU-hours from the predicted step, flags the last stage (the LM head), and
    proposes a layout with more tokens per GPU-hour, which planned on its own is."""
    toml = str(REPO / "configs/llama3_2b_protocol.toml")
    config = load_config(toml, [], check_environment=False)
    slow = Link(80.0, 50.0)
    links = boundary_links(config, slow, [4, 4], REGION)
    assert [link.crosses for link in links] == [False, False, False, True, False, False, False]
    predicted = predict_step(config, plan_stages(config), links, 0.4)
    assert predicted["latency_s"] == pytest.approx(2 * (0.05 + 6 * 0.0005))
    assert plan_main(["--toml", toml, "--regions", "4,4", "--bandwidth-mbps", "80",
                      "--latency-ms", "50"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "network: boundary 3 between regions at 80 Mbit/s + 50 ms" in out
    hours = predicted["step_s"] * config.training.steps / 3600
    assert "| the run's 100,000 steps: hours | " in out
    assert re.search(rf"hours \| [\d,.]+ h \| {hours:,.1f} h \|", out)
    assert re.search(rf"GPU-hours \| [\d,]+ \| {8 * hours:,.0f} \|", out)
    assert "not counted: the optimizer step, validation, checkpoint saves" in out
    bubble = re.search(r"\+ bubble .*?\| [\d.]+ s \(([\d.]+)% of the step\)", out)
    assert bubble and float(bubble[1]) > 0, out  # the dense twin's small share is not "0%"
    assert "lopsided: stage 7 computes" in out and "LM head" in out
    better = re.search(r"better layout: (\d+) stages of (\[[\d, ]+\]) blocks .*\((configured "
                       r"[\d,]+): ([\d.]+)x", out)  # fmt: skip
    assert better and float(better[4]) > 1
    stages, split = int(better[1]), better[2]
    assert stages < 8
    proposed = load_config(toml, ["--parallelism.pipeline_parallel_degree", str(stages),
                                  "--protocol.layers_per_stage", split],
                           check_environment=False)  # fmt: skip
    its_links = [slow] + [REGION] * (stages - 2)  # the regions' one crossing, wherever it is
    its = predict_step(proposed, plan_stages(proposed), its_links, 0.4)
    mine = predicted["tokens_per_s"] / 8
    assert its["tokens_per_s"] / stages == pytest.approx(float(better[4]) * mine, rel=0.01)
    assert plan_main(["--toml", toml, "--regions", "3,4"]) == 2
    assert "--regions '3,4'" not in capsys.readouterr().err  # one line naming the nodes instead


def test_fsdp_inside_a_region_and_the_checkpoint_disk():
    """The 8B's stages are FSDP over 16 GPUs on two 8-GPU nodes: each GPU all-gathers 15/16
    of its stage's bf16 parameters and reduce-scatters 15/16 of its fp32 gradients per step
    over the network inside the region, with 2 x 15 ring rounds of its latency; on one
    16-GPU node nothing crosses the network. A checkpoint holds each GPU's 1/16 of its stage's
    fp32 parameters and optimizer state; a node keeps keep_latest_k + 1 of them."""
    toml = str(REPO / "configs/llama3_8b_protocol.toml")
    config = load_config(toml, [], check_environment=False)
    plans = plan_stages(config)
    params = plans[1].params
    assert fsdp_bytes(config, params) == pytest.approx((2 * params * 15 / 16, 4 * params * 15 / 16))
    seconds = fsdp_seconds(config, plans[1], REGION)
    assert seconds == pytest.approx(8 * tcp_wire_bytes(6 * params * 15 / 16) / 100e9 + 30 * 5e-4)
    one_node = load_config(toml, ["--hardware.gpus_per_node", "16"], check_environment=False)
    assert fsdp_seconds(one_node, plans[1], REGION) == 0.0
    state = 4 + OPTIMIZERS[config.optimizer.name].state_bytes
    largest = max(p.params for p in plans)
    one, disk = checkpoint_disk(config, plans)
    assert one == pytest.approx(8 * state * largest / 16)
    assert disk == pytest.approx((config.checkpoint.keep_latest_k + 1) * one)


def test_a_boundary_crosses_regions_when_any_of_its_rank_pairs_does():
    """Stage ``s``'s rank ``i`` sends to stage ``s + 1``'s rank ``i``: with 2 stages of 2
    data-parallel ranks on 4 one-GPU nodes in regions of 2 and 2 nodes the boundary crosses, and
    with both stages in one region it does not; regions of 1 and 3 nodes would split stage 0's
    data-parallel group, which the launch refuses, and so does the planner."""
    config = load_config(None, [*TINY, "--protocol.layers_per_stage", "[2, 2]",
                                "--parallelism.pipeline_parallel_degree", "2",
                                "--hardware.gpus_per_node", "1"],
                         check_environment=False)  # fmt: skip
    slow = Link(80.0, 50.0)
    assert config.world_size == 4
    for regions, crosses in (([2, 2], True), ([4], False)):
        (link,) = boundary_links(config, slow, regions, REGION)
        assert link.crosses == crosses, regions
    with pytest.raises(UserError, match=r"stage 0 \(nodes 0-1\) would span regions 0, 1"):
        boundary_links(config, slow, [1, 3], REGION)


def test_regions_that_split_a_stage_are_refused_as_the_launch_refuses_them(capsys):
    """The 8B puts each stage on 2 nodes: ``--regions 3,5`` would split stage 1's FSDP group
    across regions, which the launch's placement check refuses, so the planner refuses it in one
    line instead of predicting a step for it; ``2,2,2,2`` plans."""
    toml = str(REPO / "configs/llama3_8b_protocol.toml")
    link = ["--bandwidth-mbps", "80", "--latency-ms", "50"]
    assert plan_main(["--toml", toml, "--regions", "3,5", *link]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: --regions 3,5: the data-parallel group of pipeline stage 1 "
                           "(nodes 2-3) would span regions 0, 1, which the launch refuses")
    assert plan_main(["--toml", toml, "--regions", "2,2,2,2", *link]) == 0
