"""Slow-link benchmark: tokens/s vs bandwidth, time-to-target T, and microbatching advice.

    python -m recipes.wan_benchmark            # full run (~45-60 min on a 2-core CPU)
    python -m recipes.wan_benchmark --quick    # exercises the whole harness in a few minutes

Every figure is measured from real pipelined runs (one process per stage, gloo) with the link
simulator of ``protocol_models.wire.link`` at the stages' send/recv hooks:

* tokens/s for ``dense`` and ``subspace`` at {unlimited (link off), 1000, 200, 80} Mbit/s with
  50 ms latency, on the reference workload and two variants (bandwidth-bound, latency-bound);
  step time is ProtocolNanoGPT's steady-state rule (three consecutive 10-step windows within 1%,
  their median) and is shown next to the analytical wire lower bound;
* T = steps to the target validation loss (from link-off runs; the link changes timing only)
  x steady step time with the link on, at 200 and 80 Mbit/s + 50 ms;
* the microbatch count that minimizes step time at 80 Mbit/s + 50 ms.

Writes ``results/wan/{results.json,table.md,throughput_vs_bandwidth.png}``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from protocol_models.wire.link import transfer_seconds
from recipes.common import (
    REPO,
    steady_step_time,
    steps_to_reach,
    timing_overrides,
    train,
    validation_curve,
)

LATENCY_MS = 50.0
BANDWIDTHS = [None, 1000.0, 200.0, 80.0]  # None: link off (a fast interconnect)
MODES = ["dense", "subspace"]
FIXED_TARGET = 6.3  # a validation loss both modes reach on the reference workload

WORKLOADS = {
    # the shared reference: d=256, 8 layers over 4 stages, 4 microbatches of 2 x 256 tokens
    "reference": [],
    # one layer per stage and 2 microbatches of 4 x 256 tokens: a dense message (1 MiB) takes
    # longer on the wire at 80-200 Mbit/s than a stage's compute on this CPU
    "bandwidth-bound": [
        "--model.n_layers",
        "4",
        "--parallelism.pipeline_parallel_microbatch_size",
        "4",
    ],
    # narrow model, short sequences, 8 microbatches of 64 tokens: every message is latency-bound
    "latency-bound": [
        "--model.dim",
        "128",
        "--model.n_layers",
        "4",
        "--training.seq_len",
        "64",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
    ],
}


def link_args(mbps: float | None) -> list[str]:
    if mbps is None:
        return []
    return ["--wan.bandwidth_mbps", str(mbps), "--wan.latency_ms", str(LATENCY_MS)]


def wire_lower_bound(record: dict, stages: int, mbps: float | None) -> float:
    """Seconds per step the busiest inbound wire needs: each rank receives the forward
    messages of the boundary before it and the backward messages of the boundary after it,
    one message per microbatch, each costing ``transfer_seconds`` (the bytes with their TCP/IP
    headers at the bandwidth, plus one latency), serialized. A bound: the extra latency of a
    receive posted after its send (``rendezvous_start``) is not always paid, so it is left out."""
    if mbps is None:
        return 0.0
    n_mb = record["n_microbatches"]

    def messages(key: str) -> float:  # n_mb messages of this boundary's per-step bytes / n_mb
        return n_mb * transfer_seconds(record[key] / n_mb, mbps * 1e6, LATENCY_MS / 1e3)

    per_rank = []
    for rank in range(stages):
        t = 0.0
        if rank > 0:
            t += messages(f"wire/fwd_bytes/b{rank - 1}")
        if rank < stages - 1:
            t += messages(f"wire/bwd_bytes/b{rank}")
        per_rank.append(t)
    return max(per_rank)


def measure(out: Path, name: str, overrides: list[str], steps: int, stages: int, n_mb: int) -> dict:
    records = train(out / name, [*overrides, *timing_overrides(steps)])
    step_s, steady = steady_step_time(records)
    last = dict(records[-1], n_microbatches=n_mb)
    return {
        "step_s": step_s,
        "steady": steady,
        "tokens_per_step": records[-1]["n_tokens_seen"] / records[-1]["step"],
        "wire_bytes_per_step": last["wire/fwd_bytes"] + last["wire/bwd_bytes"],
        "wan_wait_s": last.get("wan/wait_s", 0.0),
        "last": last,
    }


def workload_shape(overrides: list[str]) -> tuple[int, int]:
    """(stages, microbatches) of the reference workload after ``overrides``."""
    from protocol_models.config.run_config import load_config

    config = load_config(str(REPO / "configs" / "reference_cpu.toml"), overrides)
    par = config.parallelism
    return (
        par.pipeline_parallel_degree,
        config.training.local_batch_size // par.pipeline_parallel_microbatch_size,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny model, few steps: checks the harness"
    )
    parser.add_argument("--out", type=Path, default=REPO / "results" / "wan")
    parser.add_argument(
        "--render-only",
        action="store_true",
        help="re-derive T, table.md and the plot from an existing results.json (no runs)",
    )
    args = parser.parse_args()
    runs = args.out / "runs"

    quick = (
        ["--model.dim", "64", "--model.n_layers", "4", "--training.seq_len", "64"]
        if args.quick
        else []
    )
    workloads = {"reference": []} if args.quick else WORKLOADS
    bandwidths = [None, 80.0] if args.quick else BANDWIDTHS
    steps = 8 if args.quick else 45
    results: dict = {
        "latency_ms": LATENCY_MS,
        "quick": args.quick,
        "throughput": {},
        "T": {},
        "microbatching": {},
    }
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every measurement: a long run never loses its figures
        (args.out / "results.json").write_text(json.dumps(results, indent=2))

    if args.render_only:
        results = json.loads((args.out / "results.json").read_text())
        workloads = {"reference": []} if results["quick"] else WORKLOADS
        bandwidths = [None, 80.0] if results["quick"] else BANDWIDTHS
        time_to_target(results, bandwidths)
        save()
        report(results, workloads, bandwidths, args.out)
        return

    # 1. tokens/s vs bandwidth
    for workload, extra in workloads.items():
        stages, n_mb = workload_shape([*quick, *extra])
        for mode in MODES:
            for mbps in bandwidths:
                tag = f"{workload}/{mode}/{'off' if mbps is None else int(mbps)}"
                m = measure(
                    runs,
                    tag,
                    [*quick, *extra, "--protocol.mode", mode, *link_args(mbps)],
                    steps,
                    stages,
                    n_mb,
                )
                m["wire_lower_bound_s"] = wire_lower_bound(m.pop("last"), stages, mbps)
                m["tokens_per_s"] = m["tokens_per_step"] / m["step_s"]
                results["throughput"][tag] = m
                print(
                    f"{tag}: {m['tokens_per_s']:.0f} tok/s, step {m['step_s']:.3f}s "
                    f"(steady={m['steady']}), wire bound {m['wire_lower_bound_s']:.3f}s",
                    flush=True,
                )
                save()

    # 2. T = steps to target (link off) x steady step time (link on), reference workload
    t_steps = 10 if args.quick else 300
    val_freq = 5 if args.quick else 25
    curves = {}
    for mode in MODES:
        train(
            runs / f"T/{mode}",
            [
                *quick,
                "--protocol.mode",
                mode,
                "--training.steps",
                str(t_steps),
                "--validator.freq",
                str(val_freq),
            ],
        )
        curves[mode] = validation_curve(runs / f"T/{mode}")
    results["validation_curves"] = curves
    time_to_target(results, bandwidths)
    save()

    # 3. microbatch count minimizing step time at 80 Mbit/s + 50 ms (reference workload)
    for mode in MODES:
        sweep = {}
        for mb in [1, 2] if args.quick else [1, 2, 4, 8]:
            over = [
                *quick,
                "--protocol.mode",
                mode,
                "--parallelism.pipeline_parallel_microbatch_size",
                str(mb),
                *link_args(80.0),
            ]
            stages, n_mb = workload_shape(over)
            m = measure(runs, f"mb/{mode}/{n_mb}", over, 6 if args.quick else 25, stages, n_mb)
            sweep[n_mb] = m["step_s"]
        results["microbatching"][mode] = {
            "step_s_by_microbatches": sweep,
            "best": min(sweep, key=sweep.get),
        }

    save()
    report(results, workloads, bandwidths, args.out)


def report(results: dict, workloads, bandwidths, out: Path) -> None:
    (out / "table.md").write_text(render_table(results, workloads, bandwidths))
    plot(results, workloads, bandwidths, out / "throughput_vs_bandwidth.png")
    print((out / "table.md").read_text())


def time_to_target(results: dict, bandwidths) -> None:
    """T = steps to target (link-off validation curves) x steady step time, per link setting
    (link off and 200/80 Mbit/s + 50 ms), for the dense run's final loss and a fixed target."""
    curves = results["validation_curves"]
    targets = {"dense_final": curves["dense"][-1][1], "fixed": FIXED_TARGET}
    links = [b for b in (None, 200.0, 80.0) if b in bandwidths]
    results["T"] = {}
    for target_name, target in targets.items():
        for mode in MODES:
            reached = steps_to_reach(curves[mode], target, interpolate=False)
            for mbps in links:
                link = "off" if mbps is None else str(int(mbps))
                step_s = results["throughput"][f"reference/{mode}/{link}"]["step_s"]
                results["T"][f"{target_name}/{mode}/{link}"] = {
                    "target": target,
                    "steps": reached,
                    "step_s": step_s,
                    "T_s": None if reached is None else reached * step_s,
                }


def render_table(results: dict, workloads, bandwidths) -> str:
    bw_name = {None: "unlimited (link off)"}
    lines = [
        "### Tokens/s vs bandwidth (50 ms latency)",
        "",
        "| workload | bandwidth | dense tok/s | subspace tok/s | gain "
        "| dense step (wire bound) | subspace step (wire bound) |",
        "|---|---|---|---|---|---|---|",
    ]
    for workload in workloads:
        for mbps in bandwidths:
            key = "off" if mbps is None else int(mbps)
            d, s = (results["throughput"][f"{workload}/{m}/{key}"] for m in MODES)
            flag = lambda m: "" if m["steady"] else "*"  # noqa: E731
            bw = bw_name[mbps] if mbps is None else f"{mbps:.0f} Mbit/s"
            lines.append(
                f"| {workload} | {bw} | {d['tokens_per_s']:,.0f} | "
                f"{s['tokens_per_s']:,.0f} | {s['tokens_per_s'] / d['tokens_per_s']:.2f}x | "
                f"{d['step_s']:.3f}s{flag(d)} ({d['wire_lower_bound_s']:.3f}s) | "
                f"{s['step_s']:.3f}s{flag(s)} ({s['wire_lower_bound_s']:.3f}s) |"
            )
    lines += [
        "",
        "`*`: no three consecutive 10-step windows agreed within 1%; median of the last three.",
        "",
        "### Time to target, reference workload",
        "",
        "T = steps to the target validation loss (link off) x steady step time (link on).",
        "",
        "| target | mode | link | steps to target | step time | T |",
        "|---|---|---|---|---|---|",
    ]
    for key, t in results["T"].items():
        target_name, mode, mbps = key.split("/")
        steps = "not reached" if t["steps"] is None else str(t["steps"])
        total = "—" if t["T_s"] is None else f"{t['T_s']:,.0f} s"
        link = "unlimited (off)" if mbps == "off" else f"{mbps} Mbit/s + 50 ms"
        lines.append(
            f"| {target_name} ({t['target']:.3f}) | {mode} | {link} | {steps} "
            f"| {t['step_s']:.3f}s | {total} |"
        )
    lines += [
        "",
        "### Microbatching at 80 Mbit/s + 50 ms (reference workload, 8 sequences per step)",
        "",
        "| mode | step time by microbatch count | best |",
        "|---|---|---|",
    ]
    for mode, mb in results["microbatching"].items():
        sweep = ", ".join(f"{n}: {t:.3f}s" for n, t in sorted(mb["step_s_by_microbatches"].items()))
        lines.append(f"| {mode} | {sweep} | {mb['best']} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, workloads, bandwidths, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [b for b in bandwidths if b is not None]
    x_unlimited = max(finite) * 4
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for workload in workloads:
        xs = [x_unlimited if b is None else b for b in bandwidths]
        for mode, style in zip(MODES, ("--", "-"), strict=True):
            tps = [
                results["throughput"][f"{workload}/{mode}/{'off' if b is None else int(b)}"][
                    "tokens_per_s"
                ]
                for b in bandwidths
            ]
            ax1.plot(xs, tps, style, marker="o", label=f"{workload} {mode}")
        gain = [
            results["throughput"][f"{workload}/subspace/{'off' if b is None else int(b)}"][
                "tokens_per_s"
            ]
            / results["throughput"][f"{workload}/dense/{'off' if b is None else int(b)}"][
                "tokens_per_s"
            ]
            for b in bandwidths
        ]
        ax2.plot(xs, gain, marker="o", label=workload)
    for ax in (ax1, ax2):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks([*finite, x_unlimited], [*(f"{int(b)}" for b in finite), "off"])
        ax.set_xlabel(f"bandwidth (Mbit/s), {LATENCY_MS:.0f} ms latency")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("tokens/s (measured)")
    ax2.set_ylabel("subspace / dense tokens/s")
    ax2.axhline(1.0, color="grey", lw=0.8)
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=8)
    fig.suptitle(
        "Throughput gain vs bandwidth (CPU, gloo, simulated link)"
        + (" [quick]" if results["quick"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
