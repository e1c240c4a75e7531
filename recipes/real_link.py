"""The transport benchmark: the same pipelined run with the link off, over a real shaped link,
and under the link simulator.

    python recipes/real_link.py            # as root; full run: ~25 min on a 2-core CPU
    python recipes/real_link.py --quick    # exercises the whole harness in a few minutes
    python recipes/real_link.py --sim-only # re-measure the simulator, keep the real runs
    python recipes/real_link.py --settings 80x50   # one link setting (Mbit/s x one-way ms)

The workload is ``configs/debug_cpu.toml`` (d=256, 8 layers, 2 GPipe stages, 4 microbatches of
2 x 256 tokens, validation off), once per mode (``dense`` and ``subspace`` k=8), at each link
setting (bandwidth, one-way delay):

* **link off**: two local processes, no link (the throughput a link should keep);
* **real**: two ``torchrun`` nodes (``--nnodes 2``, one process each), one per network namespace
  of ``recipes.tun_relay``, the pipeline's gloo traffic (and the rendezvous store's) crossing a
  userspace relay that shapes the rate and delays every packet; each namespace first gets the
  TCP settings ``protocol_models.wire.transport.tcp_fixes`` recommends for the link (recorded);
  before the runs, the link is probed (``recipes.link_probe``: UDP round trip, bulk TCP rate,
  the cost of one gloo message posted before and after its send);
* **simulated**: two local processes, no relay, ``--wan.bandwidth_mbps/--wan.latency_ms``.

Tokens/s uses the steady-state step time (``recipes.common.steady_step_time``, 5-step windows).
``--sim-only`` keeps the real runs and probes of an earlier ``results.json`` and moves its
simulated runs to ``sim_before`` (with the commit they were measured at), so a change to the link
model is judged against the same real measurements. Every worker runs with
``OMP_NUM_THREADS=1``; results.json keeps each run's per-step times and losses.

Writes ``results/real_link/{results.json,table.md,real_vs_simulated.png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from recipes import tun_relay
from recipes.common import REPO, steady_step_time, timing_overrides, train
from recipes.tun_relay import ADDRESSES, DEVICES, Shape, in_namespace, link_namespaces

TOML = REPO / "configs" / "debug_cpu.toml"
SETTINGS = [(10.0, 25.0), (80.0, 50.0)]  # (Mbit/s, one-way ms)
MODES = ["dense", "subspace"]
WINDOW = 5  # steps per steady-state window
MASTER_PORT = 29533
QUICK = ["--model.dim", "64", "--model.n_layers", "4", "--training.seq_len", "64"]


def setting_key(mbps: float, delay_ms: float) -> str:
    return f"{mbps:g}mbps_{delay_ms:g}ms"


def run_overrides(mode: str, steps: int, quick: bool) -> list[str]:
    """The overrides every run of ``mode`` shares (real and simulated)."""
    return [*(QUICK if quick else []), "--protocol.mode", mode, *timing_overrides(steps)]


def summarize(records: list[dict]) -> dict:
    """Steady step time (s), tokens/s and whether the windows agreed, from a run's records,
    with its per-step times and losses."""
    step_s, steady = steady_step_time(records, window=WINDOW)
    tokens_per_step = records[-1]["n_tokens_seen"] / records[-1]["step"]
    return {
        "step_s": step_s,
        "steady": steady,
        "tokens_per_s": tokens_per_step / step_s,
        "step_times": [r["time_metrics/end_to_end(s)"] for r in records],
        "losses": [r["loss"] for r in records],
    }


def link_off(folder: Path, mode: str, steps: int, quick: bool) -> dict:
    """One run with no link: two local processes."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    records = train(folder, run_overrides(mode, steps, quick), toml=TOML, nproc=2, env=env)
    return summarize(records)


def apply_tcp_fixes(shape: Shape) -> dict:
    """Give both namespaces the TCP settings the config check recommends for ``shape``; returns
    what was set, per namespace (a setting the kernel keeps global is noted as refused)."""
    applied = {}
    for side, ns in enumerate(tun_relay.NAMESPACES):
        ask = (
            "import json; from protocol_models.wire.transport import tcp_fixes; "
            f"print(json.dumps(tcp_fixes({shape.mbps}, {shape.delay_ms})))"
        )
        out = subprocess.run(in_namespace(side, [sys.executable, "-c", ask]), cwd=REPO,
                             capture_output=True, text=True, check=True)  # fmt: skip
        fixes = json.loads(out.stdout)
        applied[ns] = {}
        for name, value in fixes.items():
            done = subprocess.run(in_namespace(side, ["sysctl", "-q", "-w", f"{name}={value}"]),
                                  capture_output=True)  # fmt: skip
            applied[ns][name] = value if done.returncode == 0 else f"refused ({value})"
    return applied


def simulated(folder: Path, mode: str, shape: Shape, steps: int, quick: bool) -> dict:
    """One run with the link simulator: two local processes."""
    wan = ["--wan.bandwidth_mbps", str(shape.mbps), "--wan.latency_ms", str(shape.delay_ms)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    records = train(folder, [*run_overrides(mode, steps, quick), *wan], toml=TOML, nproc=2,
                    env=env)  # fmt: skip
    return summarize(records)


def node_command(node: int, folder: Path, overrides: list[str]) -> list[str]:
    """torchrun for node ``node`` (0 or 1) in its namespace; node 0 hosts the store."""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        str(node),
        "--nproc_per_node",
        "1",
        "--master_addr",
        ADDRESSES[0],
        "--master_port",
        str(MASTER_PORT),
        "-m",
        "protocol_models.train",
        "--toml",
        str(TOML),
        "--dump_folder",
        str(folder),
        *overrides,
    ]
    env = ["env", f"GLOO_SOCKET_IFNAME={DEVICES[node]}", "PROTOCOL_MODELS_DEVICE=cpu"]
    env.append("OMP_NUM_THREADS=1")  # what torchrun sets for the simulated runs' 2 local processes
    return in_namespace(node, [*env, *torchrun])


@contextlib.contextmanager
def node_process(node: int, folder: Path, overrides: list[str]):
    """Node ``node``'s torchrun, logging to ``run_node<node>.log``; terminated (with its
    workers) if the ``with`` body ends before it does."""
    with open(folder / f"run_node{node}.log", "w") as log:
        cmd = node_command(node, folder, overrides)
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait()


def real(folder: Path, mode: str, steps: int, quick: bool) -> dict:
    """One run over the relay: two torchrun nodes, one per namespace (the link must be up)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").unlink(missing_ok=True)
    overrides = run_overrides(mode, steps, quick)
    with contextlib.ExitStack() as stack:
        procs = [stack.enter_context(node_process(n, folder, overrides)) for n in (0, 1)]
        codes = [proc.wait() for proc in procs]
    if any(codes):
        raise RuntimeError(f"real-link run failed {codes}; see {folder}/run_node*.log")
    from protocol_models.metrics import read_jsonl

    return summarize(read_jsonl(folder / "metrics.jsonl"))


@contextlib.contextmanager
def background(side: int, args: list[str]):
    """A ``recipes.link_probe`` server in namespace ``side`` for the ``with`` body."""
    cmd = in_namespace(side, [sys.executable, "-m", "recipes.link_probe", *args])
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        yield
    finally:
        proc.terminate()
        proc.wait()


def probe_json(side: int, args: list[str], env: dict | None = None) -> dict:
    """Run a measuring probe in namespace ``side``; its last stdout line, as JSON."""
    cmd = in_namespace(side, [sys.executable, "-m", "recipes.link_probe", *args])
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout.strip().splitlines()[-1])


def probe(shape: Shape) -> dict:
    """Round trip, bulk TCP rate (2 s of data at the rate) and gloo message costs."""
    result = {}
    with background(1, ["rtt-server"]):
        result.update(probe_json(0, ["rtt", "--peer", ADDRESSES[1]]))
    nbytes = str(int(shape.mbps * 1e6 / 8 * 2))
    with background(1, ["bulk-server"]):
        result.update(probe_json(0, ["bulk", "--peer", ADDRESSES[1], "--nbytes", nbytes]))
    gloo = ["gloo", "--master", ADDRESSES[0]]
    env0 = {**os.environ, "GLOO_SOCKET_IFNAME": DEVICES[0]}
    sender = subprocess.Popen(
        in_namespace(0, [sys.executable, "-m", "recipes.link_probe", *gloo, "--rank", "0"]),
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
    return result


def current_commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True)
    return out.stdout.decode().strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--sim-only", action="store_true", help="re-measure the simulator only")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "real_link")
    every = [f"{m:g}x{d:g}" for m, d in SETTINGS]
    parser.add_argument("--settings", nargs="+", default=every,
                        help="link settings MBPSxMS (default: all)")  # fmt: skip
    args = parser.parse_args()
    problem = tun_relay.check_privileges()
    if problem and not args.sim_only:
        sys.exit(f"error: {problem}")
    tun_relay.exit_on_sigterm()
    steps = 1 + 3 * WINDOW if args.quick else 1 + 5 * WINDOW
    results = measure(args, steps)
    (args.out / "table.md").write_text(render_table(results))
    plot(results, args.out / "real_vs_simulated.png")
    print((args.out / "table.md").read_text())


def measure(args: argparse.Namespace, steps: int) -> dict:
    """Every run of the study, saved to ``results.json`` after each one."""
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "results.json"
    started = time.time()
    settings = [tuple(float(v) for v in s.split("x")) for s in args.settings]
    fresh = {"quick": args.quick, "steps": steps, "window": WINDOW, "probes": {}, "real": {},
             "off": {}, "tcp": {}, "sim": {}}  # fmt: skip
    results = json.loads(path.read_text()) if path.is_file() else fresh
    if results.get("quick") != args.quick or "off" not in results:
        results = fresh  # another harness or an earlier version: start anew
    if args.sim_only:
        results["sim_before"] = {"commit": results["sim_commit"], "runs": dict(results["sim"])}
    results.update(sim_commit=current_commit(), commit=current_commit())
    save = lambda: path.write_text(json.dumps(results, indent=2))  # noqa: E731
    if not args.sim_only:
        for mode in MODES:
            results["off"][mode] = link_off(args.out / "runs" / "off" / mode, mode, steps,
                                            args.quick)  # fmt: skip
            save()
    for mbps, delay_ms in settings:
        key, shape = setting_key(mbps, delay_ms), Shape(mbps, delay_ms)
        if not args.sim_only:
            with link_namespaces(shape):
                results["tcp"][key] = apply_tcp_fixes(shape)
                results["probes"][key] = probe(shape)
                save()
                for mode in MODES:
                    folder = args.out / "runs" / "real" / key / mode
                    results["real"][f"{key}/{mode}"] = real(folder, mode, steps, args.quick)
                    save()
        for mode in MODES:
            folder = args.out / "runs" / "sim" / key / mode
            results["sim"][f"{key}/{mode}"] = simulated(folder, mode, shape, steps, args.quick)
            save()
    results["wall_s" if not args.sim_only else "sim_only_wall_s"] = time.time() - started
    save()
    return results


def error_pct(sim: dict, real: dict) -> float:
    """The simulator's tokens/s relative to the real link's, % (positive: optimistic)."""
    return 100 * (sim["tokens_per_s"] / real["tokens_per_s"] - 1)


def render_table(results: dict) -> str:
    """One row per (link, mode): link-off and real tokens/s, the share of its link-off
    throughput the real run kept, whether its losses equal the link-off run's bit for bit, and
    the simulator's tokens/s and error against the real link (before and after, with
    ``--sim-only``)."""
    before = results.get("sim_before", {}).get("runs")
    head = "| link | mode | link-off tok/s | real tok/s | real step | kept | losses = link-off |"
    head += " simulated tok/s | error |"
    if before:
        head = head.replace(" simulated tok/s | error |",
                            " simulated before | error | simulated after | error |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    flag = lambda m: "" if m["steady"] else "*"  # noqa: E731
    for key, real in results["real"].items():
        setting, mode = key.split("/")
        mbps, delay = setting.removesuffix("ms").split("mbps_")
        off = results["off"][mode]
        same = real.get("losses") == off.get("losses")
        cells = [f"{mbps} Mbit/s + {delay} ms", mode, f"{off['tokens_per_s']:.0f}{flag(off)}",
                 f"{real['tokens_per_s']:.0f}", f"{real['step_s']:.3f}s{flag(real)}",
                 f"{100 * real['tokens_per_s'] / off['tokens_per_s']:.0f}%",
                 "yes" if same else "**no**"]  # fmt: skip
        for runs in [before, results["sim"]] if before else [results["sim"]]:
            sim = runs.get(key)
            cells += ["–", "–"] if sim is None else [
                f"{sim['tokens_per_s']:.0f}{flag(sim)}", f"{error_pct(sim, real):+.0f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    note = "`*`: no three consecutive 5-step windows agreed within 1%; median of the last three."
    lines += ["", note]
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(results["real"])
    off = {k: results["off"][k.split("/")[1]] for k in keys}
    series = {"link off": off, "real link": results["real"], "simulated": results["sim"]}
    if "sim_before" in results:
        series = {"link off": off, "real link": results["real"],
                  "simulated (before)": results["sim_before"]["runs"]}  # fmt: skip
        series["simulated (after)"] = results["sim"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (name, runs) in enumerate(series.items()):
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(keys))]
        ax.bar(xs, [runs[k]["tokens_per_s"] if k in runs else 0 for k in keys], width, label=name)
    ax.set_xticks(range(len(keys)), [k.replace("/", "\n") for k in keys], fontsize=8)
    ax.set_ylabel("tokens/s (steady state)")
    ax.legend(fontsize=8)
    ax.set_title("Real shaped link vs link simulator" + (" [quick]" if results["quick"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
