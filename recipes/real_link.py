"""The transport benchmark: the same pipelined run with the link off, over a real shaped link,
and under the link simulator, on 2 and 3 nodes.

    python -m recipes.real_link            # as root; full run: ~60 min on a 2-core CPU
    python -m recipes.real_link --quick    # exercises the whole harness in a few minutes
    python -m recipes.real_link --settings 80x50 --nodes 2 3   # one link setting, both sizes
    python -m recipes.real_link --settings 80x50 --arms subspace-async   # one arm
    python -m recipes.real_link --settings 80x50 --nodes 2 --arms dense subspace --loss 0.01
        # the relay loses 1% of the packets, each direction; the simulator models TCP's recovery
    python -m recipes.real_link --sim-only # re-measure the simulator, keep the real runs
    python -m recipes.real_link --probe-only [--stock-buffers]   # the 2-node probes again
        # (--stock-buffers: at a stock host's 212,992 B socket buffer maxima, plus one dense
        # real run per setting)

The workload is ``configs/debug_cpu.toml`` (d=256, 8 layers, GPipe, 4 microbatches of 2 x 256
tokens, every step logged, validation off) on ``nodes`` pipeline stages (2, or 3 in a chain),
once per arm (``ARMS``: ``dense``, ``subspace`` k=8, and ``subspace-async``: k=8 under
``Async1F1B``, 8 microbatches of 1 x 256 tokens, hop depth 2 or 3, every 5th step logged), at each
link setting (bandwidth, one-way delay):

* **link off**: ``nodes`` local processes, no link (the throughput a link should keep);
* **real**: ``nodes`` ``torchrun`` nodes (one process each), one per network namespace of
  ``recipes.common.tun_relay``, every byte between them (gloo's and the rendezvous store's)
  crossing a userspace relay that shapes the rate and delays every packet, each pair of nodes
  over a link of its own; each namespace first gets the TCP settings
  ``protocol_models.wire.transport.tcp_fixes`` recommends for the link (recorded); before the
  2-node runs the link is probed (``recipes.common.link_probe``: UDP round trip, bulk TCP rate, the
  cost of one gloo message posted before and after its send; ``scripts/p2p_check.py`` over
  gloo: whether a late receive costs a round trip more); the relay's drop counts per run are
  recorded;
* **simulated**: ``nodes`` local processes, no relay, ``--wan.bandwidth_mbps/--wan.latency_ms``
  (and ``--wan.packet_loss``).

With ``--loss p`` the relay drops each packet with probability ``p`` (both directions, every pair,
seeded) for the real runs, the simulator gets ``--wan.packet_loss p`` (``wire.tcp_loss``), and the
rows are keyed apart (``80mbps_50ms_1pct_loss``). The table then also gives the planner's figure
(``python -m protocol_models.plan``'s ``cluster.plan.predict_step``): the seconds per step it
predicts the loss adds, against what the loss added to the real step (the real step at that loss
less the real step of the same link without loss, both medians).

The link-off and real runs come in pairs, ``--repeats`` of them, one right after the other: this
machine's compute speed drifts by several percent over minutes, and a pair shares it. Tokens/s
uses each run's steady-state step time (``recipes.common.steady_step_time``, 5-step windows);
a row reports the median over its repeats, and ``kept`` is the real median over the link-off
median. Each real run also records the median per step of the time its stages waited for each
boundary's messages and of the messages and collectives that crossed the links.

Every worker runs with ``OMP_NUM_THREADS=1``. results.json is saved after every run and keeps
each run's per-step times and losses; a rerun skips what it already holds with the same harness
(``--fresh`` starts anew), so the study resumes where a stopped session left it.
``--sim-only`` keeps the real runs and moves the simulated ones to ``sim_before`` (with their
commit), so a change to the link model is judged against the same real measurements.

Writes ``results/real_link/{results.json,table.md,real_vs_simulated.png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from recipes.common import REPO, steady_step_time, timing_overrides, train, tun_relay
from recipes.common.shaped_link import (
    MASTER_PORT,
    allow_congestion_control,
    apply_tcp_fixes,
    current_commit,
    host_sysctl,
    real_run,
)
from recipes.common.tun_relay import (
    ADDRESSES,
    DEVICES,
    Relay,
    Shape,
    in_namespace,
    link_namespaces,
)

TOML = REPO / "configs" / "debug_cpu.toml"
SETTINGS = [(10.0, 25.0), (80.0, 50.0)]  # (Mbit/s, one-way ms)
NODES = [2, 3]
WINDOW = 5  # steps per steady-state window
ARMS = {
    "dense": ["--protocol.mode", "dense"],
    "subspace": ["--protocol.mode", "subspace"],
    "subspace-async": ["--protocol.mode", "subspace",
                       "--parallelism.pipeline_parallel_schedule", "Async1F1B",
                       "--parallelism.pipeline_parallel_microbatch_size", "1",
                       "--optimizer.weight_prediction", "1", "--metrics.log_freq", str(WINDOW)],
}  # fmt: skip
ARMS["subspace-async-hop2"] = [*ARMS["subspace-async"], "--transport.async_hop_depth", "2"]
ASYNC_HOP = {2: 2, 3: 3}
"""The ``Async1F1B`` arm's hop depth per node count: ``wire.async_schedule.hop_depth`` at 50 ms,
``ceil((2 L + T) / T)`` with ``T`` a microbatch's forward + backward on the busiest stage, from
the link-off step over 8 microbatches (2 nodes: ~1.1 s, T ~ 0.14 s, depth 2; 3 nodes: ~0.7 s,
T ~ 0.09 s, depth 3; at depth 2 the 3-node run kept 92%: the ``subspace-async-hop2`` row)."""
"""What each row runs, beside the shared overrides. The ``Async1F1B`` arm (with weight
prediction, as recommended) runs 8 microbatches of 1 x 256 tokens (enough for 3 stages at hop
depth 3, ``ASYNC_HOP``); it logs every ``WINDOW``-th step, as a user would (its log step gathers
the stages' rows without waiting for them), so each of its records is one window's mean step
time; it runs ``ASYNC_STEPS``."""
ASYNC_STEPS = 1 + 8 * WINDOW
STOCK_BUFFER_BYTES = 212_992
"""``net.core.{w,r}mem_max`` of a stock Linux host."""
STOCK_BUFFER_KEYS = ("net.core.wmem_max", "net.core.rmem_max")
QUICK = ["--model.dim", "64", "--model.n_layers", "4", "--training.seq_len", "64"]
PER_STEP = ("wire/messages", "wire/collectives", "wire/collective_rounds")
"""Counters of what crossed the links each step, kept (median over steady steps) per real run,
with every ``wire/recv_wait_s/*`` (the time the stages waited for each boundary's messages)."""


def setting_key(mbps: float, delay_ms: float, loss: float = 0.0, cc: str = "") -> str:
    """``80mbps_50ms``, with ``_1pct_loss`` under loss and ``_bbr`` under another congestion
    control than the one ``tcp_fixes`` sets."""
    lost = f"_{100 * loss:g}pct_loss" if loss else ""
    return f"{mbps:g}mbps_{delay_ms:g}ms{lost}{f'_{cc}' if cc else ''}"


def parse_setting(key: str) -> tuple[float, float, float, str]:
    """``setting_key``'s ``(mbps, delay_ms, loss, cc)``."""
    pattern = r"([\d.]+)mbps_([\d.]+)ms(?:_([\d.]+)pct_loss)?(?:_([a-z]+))?"
    mbps, delay, pct, cc = re.fullmatch(pattern, key).groups()
    return float(mbps), float(delay), float(pct or 0) / 100, cc or ""


def run_key(mbps: float, delay_ms: float, nodes: int, mode: str, loss: float = 0.0,
            cc: str = "") -> str:  # fmt: skip
    return f"{setting_key(mbps, delay_ms, loss, cc)}/{nodes}n/{mode}"


def run_overrides(arm: str, nodes: int, steps: int, quick: bool) -> list[str]:
    """The overrides every run of ``arm`` on ``nodes`` stages shares (off, real, simulated)."""
    stages = ["--parallelism.pipeline_parallel_degree", str(nodes)]
    extra = []
    if arm.startswith("subspace-async"):
        steps = steps if quick else ASYNC_STEPS
        extra = ["--transport.async_hop_depth", str(ASYNC_HOP[nodes])]  # an arm's own wins
    return [*(QUICK if quick else []), *stages, *timing_overrides(steps), *extra, *ARMS[arm]]


def summarize(records: list[dict]) -> dict:
    """Steady step time (s), tokens/s and whether the windows agreed, from a run's records,
    with its per-step times and losses, and the medians of the per-step link counters. A run
    that logged every ``WINDOW``-th step has one record per window (after the first two: step
    1, and the first window's record, which TorchTitan divides by ``WINDOW`` though it spans
    one step fewer)."""
    logged_every = records[-1]["step"] - records[-2]["step"]
    if logged_every == WINDOW:
        step_s, steady = steady_step_time(records, window=1, skip=2)
    else:
        step_s, steady = steady_step_time(records, window=WINDOW)
    tokens_per_step = records[-1]["n_tokens_seen"] / records[-1]["step"]
    steady_records = records[-3 * WINDOW :]
    counters = {
        key: statistics.median(r[key] for r in steady_records)
        for key in sorted(records[-1])
        if key in PER_STEP or key.startswith("wire/recv_wait_s/")
    }
    return {
        "step_s": step_s,
        "steady": steady,
        "tokens_per_s": tokens_per_step / step_s,
        "step_times": [r["time_metrics/end_to_end(s)"] for r in records],
        "losses": [r["loss"] for r in records],
        "per_step": counters,
    }


def link_off(folder: Path, arm: str, nodes: int, steps: int, quick: bool) -> dict:
    """One run with no link: ``nodes`` local processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    overrides = run_overrides(arm, nodes, steps, quick)
    return summarize(train(folder, overrides, toml=TOML, nproc=nodes, env=env))


def simulated(folder: Path, arm: str, nodes: int, shape: Shape, steps: int, quick: bool,
              loss: float = 0.0) -> dict:  # fmt: skip
    """One run with the link simulator: ``nodes`` local processes."""
    wan = ["--wan.bandwidth_mbps", str(shape.mbps), "--wan.latency_ms", str(shape.delay_ms),
           "--wan.packet_loss", str(loss)]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    overrides = [*run_overrides(arm, nodes, steps, quick), *wan]
    return summarize(train(folder, overrides, toml=TOML, nproc=nodes, env=env))


def real(folder: Path, arm: str, nodes: int, relay: Relay, steps: int, quick: bool) -> dict:
    """One run of the study over the relay (``real_run``), summarized."""
    over = run_overrides(arm, nodes, steps, quick)
    records, dropped = real_run(folder, over, nodes, relay, toml=TOML)
    return {**summarize(records), "dropped": dropped}


@contextlib.contextmanager
def background(side: int, args: list[str]):
    """A ``recipes.common.link_probe`` server in namespace ``side`` for the ``with`` body."""
    cmd = in_namespace(side, [sys.executable, "-m", "recipes.common.link_probe", *args])
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.terminate()
        proc.wait()


def probe_json(side: int, args: list[str], env: dict | None = None) -> dict:
    """Run a measuring probe in namespace ``side``; its last stdout line, as JSON."""
    cmd = in_namespace(side, [sys.executable, "-m", "recipes.common.link_probe", *args])
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def probe(shape: Shape, loss: float = 0.0) -> dict:
    """Round trip, bulk TCP rate (2 s of data at the rate; 2 MB under loss) and gloo message
    costs."""
    result = {}
    with background(1, ["rtt-server"]):
        result.update(probe_json(0, ["rtt", "--peer", ADDRESSES[1]]))
    nbytes = str(2_000_000 if loss else int(shape.mbps * 1e6 / 8 * 2))
    with background(1, ["bulk-server"]):
        result.update(probe_json(0, ["bulk", "--peer", ADDRESSES[1], "--nbytes", nbytes]))
    gloo = ["gloo", "--master", ADDRESSES[0]]
    env0 = {**os.environ, "GLOO_SOCKET_IFNAME": DEVICES[0]}
    sender = subprocess.Popen(
        in_namespace(0, [sys.executable, "-m", "recipes.common.link_probe", *gloo, "--rank", "0"]),
        cwd=REPO,
        env=env0,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        env1 = {**os.environ, "GLOO_SOCKET_IFNAME": DEVICES[1]}
        result["gloo_message_s"] = probe_json(1, [*gloo, "--rank", "1"], env=env1)
    finally:
        sender.wait()
    result["p2p_check"] = p2p_check()
    return result


def set_congestion_control(name: str, nodes: int) -> str:
    """Set ``net.ipv4.tcp_congestion_control`` to ``name`` in every namespace (after
    ``apply_tcp_fixes``, which may have chosen another; a namespace may only choose from the
    host's allowed list, so it joins that list first); returns it."""
    allow_congestion_control(name)
    for node in range(nodes):
        setting = f"net.ipv4.tcp_congestion_control={name}"
        subprocess.run(in_namespace(node, ["sysctl", "-q", "-w", setting]), check=True)
    return name


def p2p_check() -> dict:
    """``scripts/p2p_check.py --backend gloo`` across the link (rank 0 in node a's namespace):
    its round trips per size and its verdict (receiver- or sender-driven)."""
    port = str(MASTER_PORT + 1)

    def command(node: int) -> list[str]:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                    "--node_rank", str(node), "--nproc_per_node", "1", "--master_addr",
                    ADDRESSES[0], "--master_port", port, "scripts/p2p_check.py", "--backend",
                    "gloo"]  # fmt: skip
        return in_namespace(node, ["env", f"GLOO_SOCKET_IFNAME={DEVICES[node]}", *torchrun])

    peer = subprocess.Popen(command(1), cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        out = subprocess.run(command(0), cwd=REPO, capture_output=True, text=True, check=True)
    finally:
        peer.wait()
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def stock_buffers():
    """The host's socket buffer maxima at a stock kernel's 212,992 B for the ``with`` body (the
    namespaces created inside inherit them), restored afterwards."""
    keys = STOCK_BUFFER_KEYS
    before = {k: host_sysctl(k) for k in keys}
    try:
        for k in keys:
            subprocess.run(["sysctl", "-q", "-w", f"{k}={STOCK_BUFFER_BYTES}"], check=True)
        yield before
    finally:
        for k, v in before.items():
            subprocess.run(["sysctl", "-q", "-w", f"{k}={v}"], check=True)


def probe_study(args: argparse.Namespace, steps: int) -> None:
    """``--probe-only``: re-measure the 2-node probes of every setting into ``results.json``
    (the runs are kept); with ``--stock-buffers``, under a stock host's socket buffer maxima,
    with one real dense run per setting, into ``stock_buffers``."""
    path = args.out / "results.json"
    results = json.loads(path.read_text())
    for setting in args.settings:
        mbps, delay_ms = (float(v) for v in setting.split("x"))
        key, shape = setting_key(mbps, delay_ms), Shape(mbps, delay_ms)
        buffers = stock_buffers() if args.stock_buffers else contextlib.nullcontext({})
        with buffers as host, link_namespaces(shape, 2) as relay:
            tcp = apply_tcp_fixes(shape, 2, skip=STOCK_BUFFER_KEYS if args.stock_buffers else ())
            for node, ns in enumerate(tun_relay.NAMESPACES[:2]):  # what the namespaces run with
                read = ["sysctl", "-n", *STOCK_BUFFER_KEYS]
                out = subprocess.run(in_namespace(node, read), capture_output=True, text=True)
                tcp[ns].update(zip(STOCK_BUFFER_KEYS, out.stdout.split(), strict=True))
            if not args.stock_buffers:
                results["tcp"][f"{key}/2n"] = tcp
                results["probes"][key] = probe(shape)
            else:
                folder = args.out / "runs" / f"{key}/2n/dense/stock_buffers"
                results.setdefault("stock_buffers", {})[key] = {
                    "host_before": host, "tcp": tcp, "probes": probe(shape),
                    "dense_real": real(folder, "dense", 2, relay, steps, args.quick),
                }  # fmt: skip
        path.write_text(json.dumps(results, indent=2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--sim-only", action="store_true", help="re-measure the simulator only")
    parser.add_argument("--fresh", action="store_true", help="ignore an earlier results.json")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "real_link")
    every = [f"{m:g}x{d:g}" for m, d in SETTINGS]
    parser.add_argument("--settings", nargs="+", default=every,
                        help="link settings MBPSxMS (default: all)")  # fmt: skip
    parser.add_argument("--nodes", nargs="+", type=int, default=NODES, choices=NODES)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS),
                        help="what the rows run (default: all)")  # fmt: skip
    parser.add_argument("--repeats", type=int, default=2, help="link-off/real pairs per row")
    parser.add_argument("--loss", type=float, default=0.0,
                        help="probability that the link loses each packet (default 0)")
    parser.add_argument("--congestion-control", default="", choices=["", "bbr", "cubic", "reno"],
                        help="TCP congestion control in the namespaces instead of the one "
                        "tcp_fixes sets (rows keyed apart; no simulated run)")  # fmt: skip
    parser.add_argument("--probe-only", action="store_true", help="re-measure the probes only")
    stock = "with --probe-only: probes and a dense run at stock buffers"
    parser.add_argument("--stock-buffers", action="store_true", help=stock)
    args = parser.parse_args()
    problem = tun_relay.check_privileges()
    if problem and not args.sim_only:
        sys.exit(f"error: {problem}")
    tun_relay.exit_on_sigterm()
    steps = 1 + 3 * WINDOW if args.quick else 1 + 5 * WINDOW
    if args.probe_only:
        probe_study(args, steps)
        return
    results = measure(args, steps)
    (args.out / "table.md").write_text(render_table(results))
    plot(results, args.out / "real_vs_simulated.png")
    print((args.out / "table.md").read_text())


def measure(args: argparse.Namespace, steps: int) -> dict:
    """Every run of the study, saved to ``results.json`` after each one; what an earlier
    ``results.json`` of the same harness holds is kept and not run again."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    started = time.time()
    harness = {"quick": args.quick, "steps": steps, "window": WINDOW, "version": 2}
    fresh = {**harness, "probes": {}, "tcp": {}, "runs": {}, "sim": {}, "commits": {}}
    results = json.loads(path.read_text()) if path.is_file() and not args.fresh else fresh
    if any(results.get(k) != v for k, v in harness.items()):
        results = fresh  # another harness or an earlier version: start anew
    if args.sim_only:
        results["sim_before"] = {"commits": dict(results["commits"]), "runs": dict(results["sim"])}
        results["sim"] = {}
    save = lambda: path.write_text(json.dumps(results, indent=2))  # noqa: E731
    settings = [tuple(float(v) for v in s.split("x")) for s in args.settings]
    loss, cc = args.loss, args.congestion_control
    for (mbps, delay_ms), nodes in itertools.product(settings, args.nodes):
        shape = Shape(mbps, delay_ms)
        keys = [run_key(mbps, delay_ms, nodes, arm, loss, cc) for arm in args.arms]
        todo = [k for k in keys if len(results["runs"].get(k, {}).get("real", [])) < args.repeats]
        if todo and not args.sim_only:
            with link_namespaces(shape, nodes) as relay:
                relay.fault(loss=loss)
                setting = f"{setting_key(mbps, delay_ms, loss, cc)}/{nodes}n"
                results["tcp"][setting] = apply_tcp_fixes(shape, nodes)
                if cc:
                    results["tcp"][setting]["chosen"] = set_congestion_control(cc, nodes)
                if nodes == 2:
                    results["probes"][setting_key(mbps, delay_ms, loss, cc)] = probe(shape, loss)
                save()
                for key, arm in zip(keys, args.arms, strict=True):
                    row = results["runs"].setdefault(key, {"off": [], "real": []})
                    while len(row["real"]) < args.repeats:
                        run = args.out / "runs" / key / f"r{len(row['real'])}"
                        row["off"].append(link_off(run / "off", arm, nodes, steps, args.quick))
                        row["real"].append(real(run / "real", arm, nodes, relay, steps,
                                                args.quick))  # fmt: skip
                        results["commits"][key] = current_commit()
                        save()
        for key, arm in zip(keys, args.arms, strict=True):
            if key not in results["sim"] and not cc:  # the simulator models CUBIC
                folder = args.out / "runs" / key / "sim"
                results["sim"][key] = simulated(folder, arm, nodes, shape, steps, args.quick, loss)
                results["commits"][f"sim/{key}"] = current_commit()
                save()
    results["wall_s"] = results.get("wall_s", 0.0) + time.time() - started
    save()
    return results


def median_of(runs: list[dict], field: str = "tokens_per_s") -> float:
    return statistics.median(r[field] for r in runs)


def planned_tokens_per_s(key: str, off_runs: list[dict], results: dict) -> float | None:
    """The planner's tokens/s for row ``key`` (``cluster.plan.predict_step``, GPipe rows only),
    its compute calibrated to the row's link-off runs: the MFU at 1 TFLOP/s that makes its
    link-off prediction the measured link-off step, so what is left to compare is its network
    model (packet loss included)."""
    from protocol_models.cluster.network import Link
    from protocol_models.cluster.plan import plan_stages, predict_step
    from protocol_models.config.run_config import load_config

    setting, nodes, arm = key.split("/")
    mbps, delay, loss, cc = parse_setting(setting)
    if arm not in ("dense", "subspace") or cc:  # the planner models CUBIC
        return None
    stages = int(nodes.removesuffix("n"))
    overrides = [*run_overrides(arm, stages, results["steps"], results["quick"]),
                 "--hardware.peak_tflops", "1"]  # fmt: skip
    config = load_config(str(TOML), overrides, check_environment=False)
    plans = plan_stages(config)
    off_step = median_of(off_runs, "step_s")
    mfu = predict_step(config, plans, [Link(None, 0.0)] * (stages - 1), 1.0)["step_s"] / off_step
    step = predict_step(config, plans, [Link(mbps, delay, loss=loss)] * (stages - 1), mfu)
    return median_of(off_runs) * off_step / step["step_s"]


def error_pct(sim: dict, real_runs: list[dict]) -> float:
    """The simulator's tokens/s relative to the real link's median, % (positive: optimistic)."""
    return 100 * (sim["tokens_per_s"] / median_of(real_runs) - 1)


def render_table(results: dict) -> str:
    """One row per (link, nodes, mode): link-off and real tokens/s (medians over the pairs), the
    real step time, the share of its link-off throughput the real run kept, whether every real
    run's losses equal its link-off twin's bit for bit, the time the stages waited for messages
    per step, the packets the relay dropped, and the simulator's tokens/s with its error against
    the real link (before and after, with ``--sim-only``), and the planner's
    (``planned_tokens_per_s``) with its error."""
    before = results.get("sim_before", {}).get("runs")
    head = "| link | nodes | mode | pairs | link-off tok/s | real tok/s | real step | kept |"
    head += " losses = link-off | waited/step | dropped | simulated tok/s | error |"
    if before:
        head = head.replace(" simulated tok/s | error |",
                            " simulated before | error | simulated after | error |")  # fmt: skip
    head += " planner tok/s | error |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    unsteady = False
    for key, row in results["runs"].items():
        setting, nodes, mode = key.split("/")
        mbps, delay, loss, cc = parse_setting(setting)
        off, real_runs = row["off"], row["real"]
        same = all(r["losses"] == o["losses"] for r, o in zip(real_runs, off, strict=True))
        unsteady |= not all(r["steady"] for r in off + real_runs)
        waited = statistics.median(
            sum(v for k, v in r["per_step"].items() if k.startswith("wire/recv_wait_s/"))
            for r in real_runs
        )
        dropped = sum(sum(r.get("dropped", {}).values()) for r in real_runs)
        link = f"{mbps:g} Mbit/s + {delay:g} ms" + (f", {100 * loss:g}% loss" if loss else "")
        link += f", {cc.upper()}" if cc else ""
        cells = [link, nodes.removesuffix("n"), mode,
                 str(len(real_runs)), f"{median_of(off):.0f}", f"{median_of(real_runs):.0f}",
                 f"{median_of(real_runs, 'step_s'):.3f}s",
                 f"{100 * median_of(real_runs) / median_of(off):.0f}%",
                 "yes" if same else "**no**", f"{waited:.3f}s", str(dropped)]  # fmt: skip
        for runs in [before, results["sim"]] if before else [results["sim"]]:
            sim = (runs or {}).get(key)
            cells += ["–", "–"] if sim is None else [
                f"{sim['tokens_per_s']:.0f}", f"{error_pct(sim, real_runs):+.0f}%"]
        planned = planned_tokens_per_s(key, off, results)
        cells += ["–", "–"] if planned is None else [
            f"{planned:.0f}", f"{error_pct({'tokens_per_s': planned}, real_runs):+.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Medians over each row's link-off/real pairs (each run back to back); "
              "waited/step: the stages' summed wait for messages per step (real link)."]
    if unsteady:
        lines.append("Some runs had no three consecutive 5-step windows within 1%: their median "
                     "of the last three windows is used (results.json: `steady`).")  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["runs"])
    series = {
        "link off": {k: median_of(results["runs"][k]["off"]) for k in keys},
        "real link": {k: median_of(results["runs"][k]["real"]) for k in keys},
    }
    sims = {"simulated": results["sim"]}
    if "sim_before" in results:
        sims = {"simulated (before)": results["sim_before"]["runs"],
                "simulated (after)": results["sim"]}  # fmt: skip
    for name, runs in sims.items():
        series[name] = {k: runs[k]["tokens_per_s"] for k in keys if k in runs}
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, [values.get(k, 0) for k in keys], width, label=name)
    ax.set_xticks(range(len(keys)), [k.replace("/", "\n") for k in keys], fontsize=7)
    ax.set_ylabel("tokens/s (steady state)")
    ax.legend(fontsize=8)
    ax.set_title("Real shaped link vs link simulator" + (" [quick]" if results["quick"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
