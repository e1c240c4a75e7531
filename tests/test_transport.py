"""The transport: pre-posted receives change timing only, one message per microbatch and
direction, one collective across the pipeline per non-log step, and the TCP check's one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import NCCL_RULES, REPO, TINY, VALIDATE_AT_END, torchrun

from protocol_models.wire.message import MessageLayout
from protocol_models.wire.meter import WireMeter, mark
from protocol_models.wire.transport import LOSSY_LINK, bdp_bytes, tcp_advice, tcp_fixes

# tests/tiny.toml: 4 microbatches per step (local_batch_size 4, microbatch 1)
N_MB = 4
COMPARED = ("loss", "grad_norm", "wire/fwd_bytes", "wire/bwd_bytes", "wire/messages")


@pytest.mark.parametrize(  # each schedule, wire and backend's rules once: independent axes
    ("schedule", "wire", "rules"), [("GPipe", "8-bit", "gloo"), ("1F1B", "exact", "nccl")]
)
def test_preposted_receives_equal_just_in_time(tmp_path, schedule, wire, rules):
    """3 stages (the middle one pre-posts both directions): the same losses, gradient norms,
    bytes and messages, bit for bit, whether a step's receives are all posted at its start or
    each just before its compute (as torch's schedules do); 8-bit coordinates send codes and
    scales as one message. The 1F1B runs obey NCCL's point-to-point rules (``NCCL_RULES``)."""
    over = ["--parallelism.pipeline_parallel_schedule", schedule]
    over += ["--codec.bits", "8"] if wire == "8-bit" else []
    env = NCCL_RULES if rules == "nccl" else None
    runs = {
        on: torchrun(3, tmp_path / on, *over, "--transport.prepost_receives", on, env=env)
        for on in ("true", "false")
    }
    for key in COMPARED:
        assert [r[key] for r in runs["true"]] == [r[key] for r in runs["false"]], key
    for r in runs["true"]:
        for b in (0, 1):
            assert r[f"wire/messages/fwd/b{b}"] == r[f"wire/messages/bwd/b{b}"] == N_MB


def test_exchanged_gradient_norm_equals_the_all_reduce(tmp_path):
    """At 3 stages the norm summed from exchanged messages in stage order is TorchTitan's
    all-reduced norm to float rounding (another summation order; at 2 stages, one addition, bit
    for bit: ``test_exchanged_norm_is_bit_exact_at_two_stages``); the metrics rows that travel
    with it log what the all-gathered rows log. The exchange runs under NCCL's rules (its
    batched form, ``NCCL_RULES``)."""
    runs = {
        on: torchrun(3, tmp_path / on, "--transport.exchange_grad_norm", on,
                     env=NCCL_RULES if on == "true" else None)  # fmt: skip
        for on in ("true", "false")
    }
    for key in ("loss", "grad_norm"):
        exchanged, reduced = ([r[key] for r in runs[on]] for on in ("true", "false"))
        assert exchanged == pytest.approx(reduced, rel=1e-6), key
    _same_metrics_rows(runs["true"], runs["false"])


def _same_metrics_rows(exchanged: list[dict], gathered: list[dict]) -> None:
    for key in ("wire/fwd_bytes", "wire/bwd_bytes", "wire/messages", "data/ids_checksum"):
        assert [r[key] for r in exchanged] == [r[key] for r in gathered], key


def test_one_message_per_microbatch_with_the_link_stamp(tmp_path):
    """Under the link simulator the sender's clock travels inside the message: still one
    message per microbatch and direction, and the metered bytes are the payload's alone."""
    records = torchrun(
        2, tmp_path / "run", "--codec.bits", "8", "--wan.latency_ms", "5", "--training.steps", "2"
    )
    plain = torchrun(2, tmp_path / "plain", "--codec.bits", "8", "--training.steps", "2")
    for r, p in zip(records, plain, strict=True):
        assert r["wire/messages/fwd/b0"] == r["wire/messages/bwd/b0"] == N_MB
        assert r["wire/fwd_bytes/b0"] == p["wire/fwd_bytes/b0"]
        assert r["loss"] == p["loss"]
        assert r["wan/wait_s"] > 0 and "wan/wait_s" not in p  # the link model delivered them


def _steps(count_log: Path) -> dict[int, list[str]]:
    """One rank's probe count log: the collectives each of its training steps ran."""
    steps: dict[int, list[str]] = {}
    current = None
    for line in count_log.read_text().splitlines():
        if line.startswith("step "):
            current = int(line.split()[1])
            steps[current] = []
        elif current is not None:
            steps[current].append(line)
    return steps


@pytest.fixture(scope="module")
def probed_runs(tmp_path_factory):
    """``probed_runs(exchange)``: the records and the collective probe's count file of a
    6-step, 2-stage run with ``[transport] exchange_grad_norm = exchange``, logging at steps 1,
    3 and 6 and validating after steps 1 and 4 (each run once per module)."""
    made: dict[str, tuple[list[dict], Path]] = {}

    def make(exchange: str) -> tuple[list[dict], Path]:
        if exchange not in made:
            folder = tmp_path_factory.mktemp(f"probed-{exchange}")
            count = folder / "count.log"
            env = {
                "PYTHONPATH": os.pathsep.join([str(REPO / "tests" / "collective_probe"),
                                               os.environ.get("PYTHONPATH", "")]),
                "COLLECTIVE_PROBE_LOG": str(folder / "probe.log"),
                "COLLECTIVE_PROBE_COUNT": str(count),
            }  # fmt: skip
            records = torchrun(
                2, folder / "run", "--training.steps", "6", "--metrics.log_freq", "3",
                "--transport.exchange_grad_norm", exchange, *VALIDATE_AT_END[:2],
                "--validator.freq", "4", "--validator.steps", "1", env=env,
            )  # fmt: skip
            made[exchange] = records, count
        return made[exchange]

    return make


def test_exchanged_norm_is_bit_exact_at_two_stages(probed_runs):
    """At 2 stages the exchanged norm is one addition, as the all-reduce's: losses and norms
    equal bit for bit, and the metrics rows equal the all-gathered ones."""
    (exchanged, _), (reduced, _) = probed_runs("true"), probed_runs("false")
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in exchanged] == [r[key] for r in reduced], key
    _same_metrics_rows(exchanged, reduced)


@pytest.mark.parametrize("exchange", ["true", "false"])
def test_collectives_per_step(probed_runs, exchange):
    """Counted by the collective probe over steps 2-6 of 2 stages, logging at steps 1, 3 and 6
    and validating after steps 1 and 4. With the exchange a step runs no collective across the
    pipeline at all: the gradient norm and, on a log step, the metrics rows travel in
    pre-posted messages, and the non-finite guard reads that norm. Without it, TorchTitan's
    all-reduce of the norm every step and one all-gather of the metrics rows on a log step;
    ``wire/collectives`` counts them (a validation adds the broadcast of its loss). Every step
    followed directly by a training step (not the last, none before a validation) posts the
    next step's forward receives early."""
    records, count = probed_runs(exchange)
    logged = [r["step"] for r in records]
    assert logged == [1, 3, 6]
    norm, gather = ([], []) if exchange == "true" else (["all_reduce 2"], ["all_gather_single 2"])
    for rank in (0, 1):
        per_step = _steps(count.with_name(f"{count.name}.rank{rank}"))
        assert sorted(per_step) == [1, 2, 3, 4, 5, 6]
        for step, lines in per_step.items():
            early = ["post_next_forward"] if step in (2, 3, 5) else []
            assert [line for line in lines if line == "post_next_forward"] == early, step
            if step == 1:  # torch's one-time pipeline metadata inference may gather too
                continue
            collectives = [line for line in lines if line != "post_next_forward"]
            validation = ["broadcast 2"] if step == 4 else []  # its loss, from the last stage
            assert collectives == norm + (gather if step in logged else []) + validation, step
    assert all(r["wire/collectives"] == (1 if exchange == "true" else 2) for r in records)


def test_message_layout_packs_parts_at_aligned_offsets():
    """Parts of mixed element sizes and a float64 stamp round-trip through one uint8 buffer,
    each part a typed view (no padding: descending element size)."""
    codes = torch.randint(0, 255, (2, 3, 5), dtype=torch.uint8)
    scales = torch.randn(2, 3, 1).to(torch.bfloat16)
    index = torch.randint(0, 100, (2, 3, 5), dtype=torch.int16)
    layout = MessageLayout(tuple((t.shape, t.dtype) for t in (codes, scales, index)), True)
    stamp = torch.tensor([1234.5], dtype=torch.float64)
    packed = layout.pack([codes, scales, index], stamp)
    assert packed.dtype == torch.uint8 and packed.numel() == layout.nbytes == 8 + 30 + 12 + 60
    received = layout.empty(torch.device("cpu"))
    received.copy_(packed)
    parts, got_stamp = layout.unpack(received)
    for sent, got in zip((codes, scales, index), parts, strict=True):
        assert got.dtype == sent.dtype and torch.equal(got, sent)
        assert got.untyped_storage().data_ptr() == received.untyped_storage().data_ptr()
    assert got_stamp.item() == 1234.5
    single = MessageLayout(((codes.shape, codes.dtype),))
    assert single.direct and single.pack([codes]) is codes


def test_waits_on_cuda_are_read_from_stream_events():
    """On CUDA a receive's ``wait()`` returns at once and the compute stream waits: the meter
    sums the stream's stall between the two events around each wait (synchronizing on the last
    one when read), never the host time; on CPU it sums host times."""

    class Event:  # what ``torch.cuda.Event`` offers the meter
        def __init__(self, ms: float):
            self.ms, self.synchronized = ms, False

        def synchronize(self) -> None:
            self.synchronized = True

        def elapsed_time(self, end: Event) -> float:
            assert end.synchronized, "read before the stream reached it"
            return end.ms - self.ms

    meter = WireMeter(dim=64)
    meter.waited("fwd", 0, Event(10.0), Event(35.0))
    meter.waited("fwd", 0, Event(50.0), Event(52.5))
    meter.waited("bwd", 0, 1.0, 1.75)
    assert meter.wait_seconds(("fwd", 0)) == pytest.approx(0.0275)
    assert meter.wait_seconds(("bwd", 0)) == pytest.approx(0.75)
    assert mark(torch.device("cpu")) <= time.time()
    meter.reset()
    assert meter.wait_seconds(("fwd", 0)) == 0


def _sysctl_tree(root: Path, **values: str) -> Path:
    defaults = {
        "net.ipv4.tcp_slow_start_after_idle": "1",
        "net.core.wmem_max": "212992",
        "net.core.rmem_max": "212992",
        "net.ipv4.tcp_wmem": "4096 16384 4194304",
        "net.ipv4.tcp_rmem": "4096 131072 6291456",
        "net.ipv4.tcp_congestion_control": "cubic",
        "net.ipv4.tcp_available_congestion_control": "reno cubic",
    }
    for name, value in {**defaults, **values}.items():
        path = root / name.replace(".", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(value + "\n")
    return root


def test_tcp_check_names_the_fix_in_one_line(tmp_path):
    """A stock host against 80 Mbit/s + 50 ms (1 MB in flight): slow start after idle and the
    core buffer maxima are fixed, the autotuning maxima already cover twice the product."""
    root = _sysctl_tree(tmp_path)
    assert bdp_bytes(80, 50) == 1_000_000
    assert tcp_fixes(80, 50, root) == {
        "net.ipv4.tcp_slow_start_after_idle": "0",
        "net.core.wmem_max": "2000000",
        "net.core.rmem_max": "2000000",
    }
    advice = tcp_advice(80, 50, root)
    assert "\n" not in advice
    assert advice.endswith(
        "sysctl -w net.ipv4.tcp_slow_start_after_idle=0 net.core.wmem_max=2000000 "
        "net.core.rmem_max=2000000"
    )
    slow = tcp_advice(350, 80, _sysctl_tree(tmp_path / "b", **{
        "net.ipv4.tcp_available_congestion_control": "reno cubic bbr",
        "net.ipv4.tcp_congestion_control": "bbr"}))  # fmt: skip
    assert "net.ipv4.tcp_wmem='4096 16384 14000000'" in slow
    assert "net.ipv4.tcp_congestion_control=cubic" in slow
    tuned = _sysctl_tree(tmp_path / "c", **{
        "net.ipv4.tcp_slow_start_after_idle": "0", "net.core.wmem_max": "4194304",
        "net.core.rmem_max": "4194304"})  # fmt: skip
    assert tcp_advice(80, 50, tuned) is None


def test_tcp_check_asks_for_bbr_on_a_link_that_loses_packets(tmp_path):
    """From ``LOSSY_LINK`` on, BBR (which keeps its rate under random loss) instead of CUBIC;
    below it, CUBIC instead of BBR; a kernel without the wanted one is left alone."""
    tuned = {"net.ipv4.tcp_slow_start_after_idle": "0", "net.core.wmem_max": "4194304",
             "net.core.rmem_max": "4194304",
             "net.ipv4.tcp_available_congestion_control": "reno cubic bbr"}  # fmt: skip
    cubic = _sysctl_tree(tmp_path / "cubic", **tuned)
    bbr = _sysctl_tree(tmp_path / "bbr", **tuned, **{"net.ipv4.tcp_congestion_control": "bbr"})
    lossy = tcp_advice(80, 50, cubic, loss=LOSSY_LINK)
    assert lossy.endswith("sysctl -w net.ipv4.tcp_congestion_control=bbr")
    assert f"losing {100 * LOSSY_LINK:g}% of its packets" in lossy
    assert tcp_advice(80, 50, bbr, loss=LOSSY_LINK) is None
    assert tcp_fixes(80, 50, cubic, loss=LOSSY_LINK / 2) == {}
    assert tcp_fixes(80, 50, bbr, loss=LOSSY_LINK / 2) == {
        "net.ipv4.tcp_congestion_control": "cubic"}  # fmt: skip
    no_bbr = _sysctl_tree(tmp_path / "no-bbr", **{**tuned,
        "net.ipv4.tcp_available_congestion_control": "reno cubic"})  # fmt: skip
    assert tcp_advice(80, 50, no_bbr, loss=0.05) is None


def test_config_check_prints_the_tcp_line_for_a_stated_link():
    """The launcher's config check prints this node's advice (or nothing) on stderr."""
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.config", "--toml", str(TINY),
         "--transport.link_mbps", "80", "--transport.link_latency_ms", "50"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    advice = tcp_advice(80, 50)
    lines = [line for line in result.stderr.splitlines() if "TCP settings" in line]
    assert lines == ([advice] if advice else [])


def test_p2p_check_runs_both_kinds_of_round_trip_under_nccl_rules():
    """``scripts/p2p_check.py`` (the receiver- vs sender-driven check a user runs on two GPUs)
    completes between two local processes on the emulated NCCL backend, with the rules of a
    device-bound group (``tests/with_nccl_rules.py``, ``PM_NCCL_RULES=bound``), and reports both
    round trips per size; on one machine the latency is too small for its verdict to mean
    anything, so only its shape is checked here (the verdict on the real shaped link is in
    results/README.md)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "with_nccl_rules.py"), str(REPO / "scripts" / "p2p_check.py"),
           "--backend", "nccl_rules", "--sizes", "1", "4096", "--trials", "2", "--gap", "0.05"]  # fmt: skip
    env = {**os.environ, "PM_NCCL_RULES": "bound", "PM_NCCL_RULES_WAIT_S": "5"}
    result = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["backend"] == "nccl_rules" and report["driven"] in ("receiver", "sender")
    assert sorted(report["sizes"]) == ["1", "4096"]
    for times in report["sizes"].values():
        assert times["first"] > 0 and times["late"] > 0
