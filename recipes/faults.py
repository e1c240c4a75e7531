"""Faults on the real shaped link: stalls, partitions, loss, a dead node, a kill during a
checkpoint save -- what each costs, and whether the run continues bit for bit.

    sudo python -m recipes.faults              # every scenario results.json lacks
    sudo python -m recipes.faults --fresh      # all of them again
    python -m recipes.faults --render-only     # table and plot from results.json

Two nodes, one namespace each, joined by ``recipes.common.tun_relay`` at 80 Mbit/s + 50 ms one
way (the TCP settings the config check recommends applied in each), run ``configs/debug_cpu.toml``
(the 2-stage GPipe demo, validation off, every step logged) for ``STEPS`` steps with per-node
checkpoints every ``INTERVAL`` steps, each node with a dump folder of its own (no shared disk),
launched by ``scripts/train.sh`` with ``MAX_RESTARTS=3``, the default stall bound
(``[transport] stall_bound_steps = 5``, ``stall_bound_floor_seconds = 60``) and
``OMP_NUM_THREADS=1``. Scenarios (``SCENARIOS``), each a fresh run:

* ``baseline``: no fault; its losses are the reference every other run is compared with, bit
  for bit, and its tokens/s the one the others' slowdown is stated against;
* ``stall-20s``: after step ``FAULT_AT`` the relay drops every packet for 20 s (no reset sent);
* ``partition-180s``: the same for 180 s;
* ``partition-180s-rto10s``: the same with Linux's ``net.ipv4.tcp_rto_max_ms = 10000`` in both
  namespaces (kernel 6.15+; default 120000): TCP retries a connection at least every 10 s, so
  the rendezvous notices the link's return sooner;
* ``loss-2pct``, ``loss-5pct``: each packet lost with that probability, both directions, all run;
* ``dead-node``: after step ``FAULT_AT`` every process in node 1's namespace is killed (``kill
  -9``), and node 1 is started again ``DEAD_S`` seconds later with the same command;
* ``kill-in-save``: node 1's processes are killed the moment its checkpoint folder of step
  ``2 x INTERVAL`` appears without DCP's ``.metadata`` (written last), then started again.

For each: when the fault began and ended, when a node first printed an ``error:`` line
(detected after), when the first step after the resume was logged (recovered after, from the
link's or node's return), how many logged steps were trained again (steps lost), whether every
step's loss equals the baseline's (bit-exact), the lines the user saw, and tokens/s over time
from when each step's record appeared (``results/faults/tokens_over_time.png``). The study
saves ``results/faults/results.json`` after every scenario and skips those it holds (a stopped
session resumes); every node's output is kept in ``results/faults/runs/<scenario>/``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from recipes.common import REPO, timing_overrides, tun_relay
from recipes.common.shaped_link import MASTER_PORT, apply_tcp_fixes, current_commit
from recipes.common.tun_relay import ADDRESSES, DEVICES, NAMESPACES, Shape, in_namespace

OUT = REPO / "results" / "faults"
RESULTS = OUT / "results.json"
TOML = REPO / "configs" / "debug_cpu.toml"
SHAPE = Shape(80.0, 50.0)
NODES = 2
STEPS = 80
INTERVAL = 10
FAULT_AT = 25
"""The step after which a timed fault starts (mid-interval: the worst case is the interval)."""
DEAD_S = 30.0
"""How long a killed node stays down before it is started again."""
RESTARTS = 3
SCENARIOS = {
    "baseline": {},
    "stall-20s": {"blackout": 20.0},
    "partition-180s": {"blackout": 180.0},
    "partition-180s-rto10s": {"blackout": 180.0, "sysctl": {"net.ipv4.tcp_rto_max_ms": "10000"}},
    "loss-2pct": {"loss": 0.02},
    "loss-5pct": {"loss": 0.05},
    "dead-node": {"kill": "timed"},
    "kill-in-save": {"kill": "in-save"},
}
OVERRIDES = [
    *timing_overrides(STEPS),
    "--checkpoint.enable", "--checkpoint.interval", str(INTERVAL), "--checkpoint.per_node",
    "--transport.link_mbps", str(SHAPE.mbps), "--transport.link_latency_ms", str(SHAPE.delay_ms),
]  # fmt: skip


STEP_LINE = re.compile(r"step:\s+(\d+)\s")
"""TorchTitan's console line of a logged step (between colour codes)."""


class Node:
    """One node's ``protocol_models.launch`` in its namespace, with every output line kept with
    the time it was printed."""

    def __init__(self, node: int, folder: Path):
        self.node, self.folder = node, folder
        self.lines: list[tuple[float, str]] = []
        self.steps: list[tuple[float, int]] = []
        """When each logged step's line was printed (a restart's steps count from its resume)."""
        self.proc: subprocess.Popen | None = None

    def command(self) -> list[str]:
        """``scripts/train.sh`` as a user runs it on this node (in its namespace)."""
        env = [
            "env", f"NNODES={NODES}", f"NODE_RANK={self.node}", f"MASTER_ADDR={ADDRESSES[0]}",
            f"MASTER_PORT={MASTER_PORT}", f"LOCAL_ADDR={ADDRESSES[self.node]}", "NGPU=1",
            f"MAX_RESTARTS={RESTARTS}", f"GLOO_SOCKET_IFNAME={DEVICES[self.node]}",
            "OMP_NUM_THREADS=1", f"PYTHON={sys.executable}",
        ]  # fmt: skip
        train = ["bash", "scripts/train.sh", str(TOML),
                 "--dump_folder", str(self.folder / f"node{self.node}"), *OVERRIDES]  # fmt: skip
        return in_namespace(self.node, [*env, *train])

    def start(self) -> None:
        self.proc = subprocess.Popen(self.command(), cwd=REPO, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)  # fmt: skip
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        with open(self.folder / f"node{self.node}.log", "a") as log:
            for line in proc.stdout:
                now = time.time()
                self.lines.append((now, line.rstrip("\n")))
                logged = STEP_LINE.search(line)
                if logged:
                    self.steps.append((now, int(logged.group(1))))
                log.write(f"{now:.3f} {line}")
                log.flush()

    def last_step(self) -> int:
        return self.steps[-1][1] if self.steps else 0

    def kill(self) -> None:
        """``kill -9`` every process in the node's namespace (its launcher, agent, workers)."""
        pids = subprocess.run(["ip", "netns", "pids", NAMESPACES[self.node]],
                              capture_output=True, text=True).stdout.split()  # fmt: skip
        subprocess.run(["kill", "-9", *pids], check=False, capture_output=True)
        if self.proc is not None:
            self.proc.wait()

    def errors(self) -> list[tuple[float, str]]:
        return [(t, line) for t, line in self.lines if "error:" in line]


def wait_for(condition, timeout: float, every: float = 0.05) -> None:
    """Return once ``condition()`` holds; raise after ``timeout`` seconds."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if condition():
            return
        time.sleep(every)
    raise RuntimeError(f"faults: gave up waiting after {timeout:g} s")


def run_scenario(name: str, fault: dict, relay: tun_relay.Relay) -> dict:
    """One scenario, start to finish (module docstring); its row."""
    folder = OUT / "runs" / name
    subprocess.run(["rm", "-rf", str(folder)], check=True)
    folder.mkdir(parents=True)
    nodes = [Node(n, folder) for n in range(NODES)]
    last = nodes[-1]  # where the loss is logged
    relay.fault(loss=fault.get("loss", 0.0), blackout=0.0)
    restore = set_sysctls(fault.get("sysctl", {}))
    lost_before = relay.dropped()["lost"]
    began = time.time()
    fault_start = fault_end = None
    half_written = None
    try:
        for node in nodes:
            node.start()
        if "blackout" in fault:
            wait_for(lambda: last.last_step() >= FAULT_AT, 900)
            fault_start = time.time()
            relay.fault(blackout=fault["blackout"])
            time.sleep(fault["blackout"])
            fault_end = time.time()
        elif fault.get("kill") == "timed":
            wait_for(lambda: last.last_step() >= FAULT_AT, 900)
            fault_start = time.time()
            nodes[1].kill()
            time.sleep(DEAD_S)
            fault_end = time.time()
            nodes[1].start()
        elif fault.get("kill") == "in-save":
            step_dir = (folder / "node1" / "checkpoint" / f"node-1-of-{NODES}"
                        / f"step-{2 * INTERVAL}")  # fmt: skip
            wait_for(step_dir.exists, 900, every=0.002)
            fault_start = time.time()
            nodes[1].kill()
            time.sleep(10.0)
            half_written = not (step_dir / ".metadata").exists()  # as the restart finds it
            fault_end = time.time()
            nodes[1].start()
        codes = [node.proc.wait(timeout=3600) for node in nodes]
    finally:
        for node in nodes:
            if node.proc is not None and node.proc.poll() is None:
                node.kill()
        relay.fault(loss=0.0, blackout=0.0)
        set_sysctls(restore)
    from protocol_models.training.metrics import read_jsonl

    records = read_jsonl(folder / f"node{NODES - 1}" / "metrics.jsonl")
    row = {
        "fault": fault,
        "exit_codes": codes,
        "wall_s": time.time() - began,
        "lost_packets": relay.dropped()["lost"] - lost_before,
        "steps": [r["step"] for r in records],
        "losses": [r["loss"] for r in records],
        "events": [(round(t - began, 3), s) for t, s in last.steps],
        "tokens_per_step": records[-1]["n_tokens_seen"] / records[-1]["step"] if records else None,
        "errors": [(round(t - began, 3), n.node, line) for n in nodes for t, line in n.errors()],
        "resumed_at": resumed_steps(nodes),
    }
    if fault_start is not None:
        row["fault_window_s"] = [round(fault_start - began, 3), round(fault_end - began, 3)]
    if half_written is not None:
        row["killed_mid_save"] = half_written
        row["half_written_step"] = 2 * INTERVAL
    return row


def set_sysctls(values: dict[str, str]) -> dict[str, str]:
    """Set ``values`` in every node's namespace; return what they were."""
    before = {}
    for node in range(NODES):
        for key, value in values.items():
            run = in_namespace(node, ["sysctl", "-n", key])
            before[key] = subprocess.run(run, capture_output=True, text=True).stdout.strip()
            subprocess.run(in_namespace(node, ["sysctl", "-q", "-w", f"{key}={value}"]), check=True)
    return before


def resumed_steps(nodes: list[Node]) -> list[int]:
    """The steps the workers started at, every attempt (node 0's, who logs them)."""
    marker = "Training starts at step "
    return [int(line.split(marker)[1].split()[0].rstrip(".,"))
            for _, line in nodes[0].lines if marker in line]  # fmt: skip


def summarize(name: str, row: dict, baseline: dict | None) -> dict:
    """The table's figures of one scenario's row."""
    events = row["events"]
    out: dict = {"finished": row["exit_codes"] == [0] * NODES and row["steps"] == list(
        range(1, STEPS + 1))}
    if baseline is not None:
        out["bit_exact"] = row["losses"] == baseline["losses"]
    out["tokens_per_s"] = steady_rate(row)
    window = row.get("fault_window_s")
    errors = row["errors"]
    if window is not None:
        first_error = next((t for t, _, _ in errors if t >= window[0]), None)
        out["detected_after_s"] = None if first_error is None else first_error - window[0]
        before = [s for t, s in events if t <= (first_error or window[1])]
        last_before = max(before) if before else 0
        resumed = row["resumed_at"][1:] if len(row["resumed_at"]) > 1 else []
        if resumed:
            start = resumed[-1]
            out["resumed_from_step"] = start - 1
            out["steps_lost"] = last_before - (start - 1)
            back = [t for t, s in events if t > window[1] and s == start]
            out["recovered_after_s"] = back[0] - window[1] if back else None
        else:
            out["steps_lost"] = 0
            after = [t for t, s in events if t > window[1]]
            out["recovered_after_s"] = after[0] - window[1] if after else None
        out["restarts"] = max(len(row["resumed_at"]) - 1, 0)
    said = [line.split("error: ", 1)[-1] for _, _, line in errors]
    out["user_saw"] = said[0] if said else ""
    if not out["finished"] and len(said) > 1:
        out["user_saw"] += f" … then: {said[-1]}"
    return out


def steady_rate(row: dict) -> float | None:
    """Tokens/s over the run's steps logged without a restart between them: median of 10-step
    windows' rates (from the records' arrival times)."""
    events, tokens = row["events"], row["tokens_per_step"]
    if not tokens or len(events) < 12:
        return None
    rates = []
    for i in range(1, len(events) - 10, 10):
        (t0, s0), (t1, s1) = events[i], events[i + 10]
        if s1 - s0 == 10 and t1 > t0:
            rates.append(10 * tokens / (t1 - t0))
    return statistics.median(rates) if rates else None


def render(results: dict) -> None:
    rows = results["scenarios"]
    base = rows.get("baseline")
    dirty = " with the working-tree changes the next commit holds" if results.get("dirty") else ""
    lines = [
        f"# Faults on the real link ({SHAPE.mbps:g} Mbit/s + {SHAPE.delay_ms:g} ms, {NODES} nodes)",
        "",
        f"`sudo python -m recipes.faults` at commit {results.get('commit', '?')}{dirty}: "
        f"configs/debug_cpu.toml, {STEPS} steps, per-node checkpoints every {INTERVAL} steps, "
        f"`--max-restarts {RESTARTS}`, default stall bound (5 x median step + 60 s).",
        "",
        "| scenario | detected after (s) | recovered after (s) | steps lost | restarts | bit-exact "
        "| tokens/s (vs baseline) | what the user saw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        s = summarize(name, row, base if name != "baseline" else None)
        rate = s["tokens_per_s"]
        vs = ""
        if base is not None and rate and name != "baseline":
            vs = f" ({100 * rate / summarize('baseline', base, None)['tokens_per_s']:.0f}%)"
        lines.append(
            f"| {name} | {_num(s.get('detected_after_s'))} | {_num(s.get('recovered_after_s'))} "
            f"| {s.get('steps_lost', 0)} | {s.get('restarts', 0)} "
            f"| {_exact(name, s)} | {_num(rate, 0) + vs if s['finished'] else '—'} "
            f"| {s['user_saw'] or '(nothing)'} |"
        )
        if "killed_mid_save" in row:
            mid, step = row["killed_mid_save"], row["half_written_step"]
            resumed = summarize(name, row, None).get("resumed_from_step")
            lines.append(f"|  ↳ node 1 killed while writing step {step}: no .metadata at the "
                         f"restart ({mid}); resumed from step {resumed} |||||||")  # fmt: skip
    (OUT / "table.md").write_text("\n".join(lines) + "\n")
    plot(rows)


def _exact(name: str, s: dict) -> str:
    if not s["finished"]:
        return "run ended"
    return "—" if name == "baseline" else ("yes" if s.get("bit_exact") else "NO")


def _num(x, digits: int = 1) -> str:
    return "—" if x is None else f"{x:.{digits}f}"


def plot(rows: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rows), 1, figsize=(9, 1.9 * len(rows)), sharex=True)
    for ax, (name, row) in zip(axes, rows.items(), strict=True):
        events, tokens = row["events"], row["tokens_per_step"] or 0
        xs, ys = [], []
        for (t0, s0), (t1, s1) in zip(events, events[1:], strict=False):
            if s1 == s0 + 1 and t1 > t0:
                xs.append(t1)
                ys.append(tokens / (t1 - t0))
        ax.plot(xs, ys, ".", ms=3)
        if "fault_window_s" in row:
            ax.axvspan(*row["fault_window_s"], color="tab:red", alpha=0.2)
        for t, _, _ in row["errors"]:
            ax.axvline(t, color="tab:red", lw=0.8)
        ax.set_ylabel("tokens/s")
        ax.set_title(name, fontsize=9, loc="left")
    axes[-1].set_xlabel("seconds since launch (red band: the fault; red line: an error line)")
    fig.tight_layout()
    fig.savefig(OUT / "tokens_over_time.png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m recipes.faults")
    parser.add_argument("--fresh", action="store_true", help="run every scenario again")
    parser.add_argument("--render-only", action="store_true", help="no runs")
    parser.add_argument("--only", nargs="*", choices=list(SCENARIOS), help="these scenarios")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() and not args.fresh else {}
    results.setdefault("scenarios", {})
    if not args.render_only:
        problem = tun_relay.check_privileges()
        if problem:
            sys.exit(f"error: {problem}")
        todo = [n for n in (args.only or SCENARIOS) if args.only or n not in results["scenarios"]]
        with tun_relay.link_namespaces(SHAPE, NODES) as relay:
            results["tcp"] = apply_tcp_fixes(SHAPE, NODES)
            for name in todo:
                print(f"faults: {name} ...", flush=True)
                row = run_scenario(name, SCENARIOS[name], relay)
                results["scenarios"][name] = row
                results["commit"] = current_commit()
                results["dirty"] = bool(subprocess.run(
                    ["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                    capture_output=True, text=True).stdout.strip())  # fmt: skip
                RESULTS.write_text(json.dumps(results, indent=1))
                base = results["scenarios"].get("baseline")
                print(f"faults: {name}: {summarize(name, row, base)}", flush=True)
    ordered = {n: results["scenarios"][n] for n in SCENARIOS if n in results["scenarios"]}
    render({**results, "scenarios": ordered})


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
