"""Time to target in the L4 regime: the reference workload on links that give it the wire-time
share of a 2B model on L4 GPUs at 80, 200 and 1000 Mbit/s (+ 50 ms).

    python recipes/l4_regime.py                 # the study (link-off step, timing, long runs)
    python recipes/l4_regime.py --quick         # tiny model, few steps: checks the harness
    python recipes/l4_regime.py --render-only   # table and plot from an existing results.json
    python recipes/l4_regime.py --reuse-timing [--cached-only]   # the links and step times of
        # the existing results.json (arms it lacks are timed on those links), then the budget
        # search (--cached-only: from the finished runs only)
    python recipes/l4_regime.py --real-link [--buffer bdp|100ms]   # as root: every arm of the
        # existing results.json timed on each emulated link over a real shaped link, next to
        # the simulator (~80 min)

1. **The emulated links.** The dense twin's link-off step of the pipelined reference workload
   (4 processes, gloo) is measured; ``protocol_models.emulate`` turns it, with the planner's
   prediction for ``configs/llama3_2b_protocol.toml`` on its GPUs (L4: ``[hardware]``, MFU 0.4),
   into the ``[wan]`` bandwidth and latency under which a dense reference boundary spends the
   same share of a step on the wire as the 2B model's at each target link.
2. **Step time** of every arm on each emulated link: pipelined runs, steady state
   (``common.steady_step_time`` over 2-step windows of an 8-step run, the first step left out:
   a dense step on the emulated 80 Mbit/s link lasts about a minute). Whether three windows
   agreed within 1% is kept as ``steady``.
3. **Steps to target**: the strict target is the dense twin's mean final validation loss at 300
   steps (the frontier's dense runs, Muon, seeds 0 and 1). The learning rate decays over each
   run's own budget, so a longer run's curve is not the 300-step run's: each compressed arm
   trains in one process (codecs in-graph, as in the frontier), seed 0, with growing budgets
   (``BUDGETS``; 300 is its frontier run) until a run ends at or below the target; the steps to
   target interpolate the final losses linearly between the two budgets around the crossing.
4. ``T = steps to target x step time``; ``T / time_scale`` is the L4-equivalent time.
5. ``--real-link``: the step times again, each arm on each emulated link twice, back to back:
   under the link simulator and over a real shaped link (``recipes.common.tun_relay``: 4 network
   namespaces, one torchrun node each, every pair of nodes over its own link at the emulated
   rate and one-way delay, the TCP settings the config check recommends applied in each; the
   relay's drop counts kept). ``--buffer`` sets the relay's drop-tail buffer (``BUFFERS``:
   one bandwidth-delay product by default, as the target link's 100 ms buffer is). The
   simulated runs replace the earlier step times (the simulator of this commit); ``T`` is then
   given for both, with the simulator's error against the real link. Resumable: a rerun times
   only the pairs results.json lacks for that buffer.

Arms: dense (the twin), the exact subspace wire (k=8), the quantized subspace arm of the
frontier with the smallest gap among those sending at most k=8's bytes, and the lossy baseline
(a ``wire.codecs`` codec) with the smallest gap at >= 32x (``--arms`` overrides both picks).

Writes ``results/l4_regime/{results.json,table.md,t_to_target.png}``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from protocol_models.cluster.emulate import emulated_link
from protocol_models.config.run_config import load_config
from protocol_models.wire.codecs import CODECS
from recipes import common
from recipes.common import (
    REFERENCE,
    REPO,
    run_folder,
    shaped_link,
    steady_step_time,
    steps_to_reach,
    timing_overrides,
    train,
    train_cached,
    tun_relay,
    validation_curve,
)
from recipes.common.arms import FRONTIER, OPTIMIZER

TARGET = REPO / "configs" / "llama3_2b_protocol.toml"
BANDWIDTHS = [80.0, 200.0, 1000.0]
LATENCY_MS = 50.0
BUDGETS = [300, 450, 600, 900]
"""Training budgets (steps) tried in turn for the steps to target; 300: the frontier's runs."""
QUICK_BUDGETS = [12, 18, 24]
TIMING_STEPS = 8
TIMING_WINDOW = 2

QUICK = ["--model.dim", "64", "--model.n_layers", "4", "--training.seq_len", "64"]


def pick_arms(frontier: dict) -> dict[str, list[str]]:
    """Arm name -> its overrides (the module docstring's rule), from the frontier's results."""
    runs = frontier["runs"]
    arms = {"dense": ["--protocol.mode", "dense"], "subspace k=8 full": []}
    quantized = [n for n, e in runs.items() if e["mode"] == "subspace" and "-bit" in n]
    lossy = [n for n, e in runs.items() if e["mode"] in CODECS]
    for group in (quantized, lossy):
        at_32x = [n for n in group if runs[n]["ratio"] >= 32]
        if at_32x:
            best = min(at_32x, key=lambda n: runs[n]["gap_vs_dense_pct"])
            arms[best] = arm_overrides(runs[best])
    return arms


def arm_overrides(entry: dict) -> list[str]:
    """A frontier arm's own overrides (its runs' lists without optimizer and seed)."""
    over = next(iter(entry["seeds"].values()))["overrides"]
    return over[: over.index("--optimizer.name")]


def timed(steps: int) -> list[str]:
    """A timed run's overrides (``common.timing_overrides``), Muon like every study arm."""
    return [*timing_overrides(steps), "--optimizer.name", OPTIMIZER]


def link_off_step(out: Path, quick: list[str], steps: int) -> float:
    """The dense twin's steady link-off step time, pipelined as the timing runs are."""
    records = train(out / "link_off", [*quick, "--protocol.mode", "dense", *timed(steps)])
    return steady_step_time(records)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps")
    parser.add_argument("--out", type=Path, default=REPO / "results" / "l4_regime")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--arms", nargs="+", metavar="NAME",
                        help="frontier arm names instead of the two picks")  # fmt: skip
    parser.add_argument(
        "--reuse-timing",
        action="store_true",
        help="take the emulated links and step times of the existing results.json; "
        "time only the arms it lacks",
    )
    parser.add_argument(
        "--real-link",
        action="store_true",
        help="time the existing results.json's arms over a real shaped link, paired with the "
        "simulator (root)",
    )
    parser.add_argument("--buffer", choices=list(BUFFERS), default="bdp",
                        help="with --real-link: the relay's drop-tail buffer")  # fmt: skip
    parser.add_argument(
        "--cached-only",
        action="store_true",
        help="budget search over the finished runs only (no budget run is trained; arms "
        "--reuse-timing lacks are still timed)",
    )
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.render_only:
        report(json.loads((args.out / "results.json").read_text()), args.out)
        return
    quick = QUICK if args.quick else []
    frontier = json.loads(FRONTIER.read_text())
    arms = pick_arms(frontier)
    if args.real_link:
        problem = tun_relay.check_privileges()
        if problem:
            parser.error(problem)
        tun_relay.exit_on_sigterm()
        results = json.loads((args.out / "results.json").read_text())
        timed_arms = {n: arms.get(n) or arm_overrides(frontier["runs"][n])
                      for n in results["steps_to_target"]}  # fmt: skip
        time_on_real_links(results, timed_arms, quick, args.out, args.buffer)
        report(results, args.out)
        return
    if args.arms:
        arms = {
            "dense": arms["dense"],
            **{n: arm_overrides(frontier["runs"][n]) for n in args.arms},
        }
    if args.reuse_timing:
        results = json.loads((args.out / "results.json").read_text())
        if results["meta"]["quick"] != args.quick:
            parser.error(f"--reuse-timing: {args.out / 'results.json'} holds "
                         f"{'quick' if results['meta']['quick'] else 'full'} timings")  # fmt: skip
        untimed = {n: over for n, over in arms.items() if not timed_on_every_link(results, n)}
        time_on_links(results, untimed, quick, args.out)
    else:
        results = time_arms(arms, quick, args.out)
    if args.quick:  # keep the harness check's tiny runs out of the shared study cache
        common.RUN_CACHE = args.out / "runs" / "cache"
    if args.quick:
        base = {name: final_loss(over, quick, QUICK_BUDGETS[0]) for name, over in arms.items()}
    else:  # the frontier's 300-step runs (the dense twin: its two seeds' mean)
        base = {name: frontier["runs"][name]["seeds"]["0"]["val_curve"][-1][1] for name in arms}
        base["dense"] = frontier["runs"]["dense"]["final_val_loss"]
    target = base["dense"]
    budgets = QUICK_BUDGETS if args.quick else BUDGETS
    results["meta"].update(target_loss=target, base_steps=budgets[0])
    results["steps_to_target"] = {
        name: budget_search(over, quick, budgets, base[name], target, args.cached_only)
        for name, over in arms.items()
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    report(results, args.out)


def time_arms(arms: dict[str, list[str]], quick: list[str], out: Path) -> dict:
    """The link-off step, the emulated links and every arm's step time on each (the module
    docstring's steps 1 and 2), saved to ``out/results.json`` as they come."""
    reference = load_config(str(REFERENCE), quick, check_environment=False)
    target = load_config(str(TARGET), [], check_environment=False)
    step_off = link_off_step(out / "runs", quick, 12 if quick else 45)
    results: dict = {"meta": {"quick": bool(quick), "target": str(TARGET.relative_to(REPO)),
                              "latency_ms": LATENCY_MS, "link_off_step_s": step_off},
                     "links": {}, "step_s": {}, "steady": {}, "steps_to_target": {}}  # fmt: skip
    for mbps in BANDWIDTHS:
        link = emulated_link(target, mbps, LATENCY_MS, reference, step_off)
        results["links"][str(int(mbps))] = vars(link)
    time_on_links(results, arms, quick, out)
    return results


def time_on_links(results: dict, arms: dict[str, list[str]], quick: list[str], out: Path) -> None:
    """Each arm's steady step time on each of ``results``' emulated links, added to ``results``
    and saved to ``out/results.json`` as they come."""
    steps = 6 if quick else TIMING_STEPS
    for mbps, link in results["links"].items():
        wan = ["--wan.bandwidth_mbps", f"{link['bandwidth_mbps']:.6g}",
               "--wan.latency_ms", f"{link['latency_ms']:.6g}"]  # fmt: skip
        for name, over in arms.items():
            records = train(out / "runs" / f"{name}/{mbps}", [*quick, *over, *wan, *timed(steps)])
            step_s, steady = steady_step_time(records, window=TIMING_WINDOW)
            results["step_s"][f"{name}/{mbps}"] = step_s
            results.setdefault("steady", {})[f"{name}/{mbps}"] = steady
            (out / "results.json").write_text(json.dumps(results, indent=1))


BUFFERS = {"bdp": None, "100ms": 100.0}
"""The relay's drop-tail buffer per ``--buffer``: one bandwidth-delay product of the emulated link
(``2 x latency``; None) -- what a 100 ms router buffer is on the target's 80 Mbit/s + 50 ms link,
1 MB against its 86 kB messages -- or 100 ms as on the transport benchmark's links, which at an
emulated 0.717 Mbit/s holds 9 kB: less than one k=8 message, so every burst loses packets."""


BUFFER_WORDS = {"bdp": "one bandwidth-delay product", "100ms": "100 ms"}


def queue_ms(buffer: str, latency_ms: float) -> float:
    """The relay's ``queue_ms`` for ``buffer`` (``BUFFERS``) on a link of ``latency_ms``."""
    return BUFFERS[buffer] or 2 * latency_ms


def time_on_real_links(results: dict, arms: dict[str, list[str]], quick: list[str], out: Path,
                       buffer: str = "bdp") -> None:  # fmt: skip
    """The module docstring's step 5: each arm on each of ``results``' emulated links, simulated
    and then over the real relay with drop-tail ``buffer``; ``results["real_link"][buffer]``
    takes both step times (with steadiness, drop counts, whether the losses equal the simulated
    run's bit for bit, the queue, the TCP settings and the commit), ``results["step_s"]`` the
    simulated ones; saved after every pair, and the pairs it holds are not timed again."""
    steps = 6 if quick else TIMING_STEPS
    reference = load_config(str(REFERENCE), quick, check_environment=False)
    nodes = reference.parallelism.pipeline_parallel_degree
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    fields = ("step_s", "steady", "sim_step_s", "sim_steady", "dropped", "losses_equal",
              "queue_ms", "tcp", "commits")  # fmt: skip
    real = results.setdefault("real_link", {}).setdefault(buffer, {f: {} for f in fields})
    for mbps, link in results["links"].items():
        todo = {n: over for n, over in arms.items() if f"{n}/{mbps}" not in real["step_s"]}
        if not todo:
            continue
        queue = queue_ms(buffer, link["latency_ms"])
        shape = tun_relay.Shape(link["bandwidth_mbps"], link["latency_ms"], queue)
        with tun_relay.link_namespaces(shape, nodes) as relay:
            real["tcp"][mbps] = shaped_link.apply_tcp_fixes(shape, nodes)
            real["queue_ms"][mbps] = queue
            for name, over in todo.items():
                key = f"{name}/{mbps}"
                folder = out / "runs" / "real_link" / buffer / key
                over = [*quick, *over, *timed(steps)]
                wan = ["--wan.bandwidth_mbps", f"{shape.mbps:.6g}",
                       "--wan.latency_ms", f"{shape.delay_ms:.6g}"]  # fmt: skip
                simulated = train(folder / "sim", [*over, *wan], env=env)
                records, dropped = shaped_link.real_run(folder / "real", over, nodes, relay,
                                                         toml=REFERENCE)  # fmt: skip
                sim_time = steady_step_time(simulated, window=TIMING_WINDOW)
                results["step_s"][key], results["steady"][key] = sim_time
                real["sim_step_s"][key], real["sim_steady"][key] = sim_time
                real["step_s"][key], real["steady"][key] = steady_step_time(
                    records, window=TIMING_WINDOW
                )
                real["dropped"][key] = sum(dropped.values())
                real["losses_equal"][key] = [r["loss"] for r in records] == [
                    r["loss"] for r in simulated
                ]
                real["commits"][key] = shaped_link.current_commit()
                (out / "results.json").write_text(json.dumps(results, indent=1))


def timed_on_every_link(results: dict, name: str) -> bool:
    return all(f"{name}/{mbps}" in results["step_s"] for mbps in results["links"])


def budget_search(over: list[str], quick: list[str], budgets: list[int], base_loss: float,
                  target: float, cached_only: bool = False) -> dict:  # fmt: skip
    """Train budgets ``budgets[1:]`` in turn until one ends at or below ``target``; the steps to
    target interpolate linearly between the budgets around the crossing (None: not reached at
    the largest budget). ``(budget, final validation loss)`` pairs are kept. ``cached_only``:
    stop at the first budget not trained yet, kept as ``pending``."""
    points = [(budgets[0], base_loss)]
    for budget in budgets[1:]:
        if points[-1][1] <= target:
            break
        loss = final_loss(over, quick, budget, cached_only)
        if loss is None:
            return {"budgets": points, "steps": None, "pending": budget}
        points.append((budget, loss))
    return {"budgets": points, "steps": steps_to_reach(points, target)}


def final_loss(over: list[str], quick: list[str], steps: int, cached_only: bool = False):
    """The final validation loss of a one-process run of ``over`` (seed 0, Muon) with a budget
    of ``steps`` (its own warm-up and decay), through the run cache (``cached_only``: None
    unless that run has finished)."""
    quick_val = ["--validator.freq", str(steps), "--validator.steps", "2"] if quick else []
    over = [*quick, *quick_val, *over, "--training.steps", str(steps),
            "--optimizer.name", OPTIMIZER, "--debug.seed", "0"]  # fmt: skip
    if cached_only and not (run_folder(over) / "done").is_file():
        return None
    return validation_curve(train_cached(over))[-1][1]


def real_buffers(results: dict) -> list[str]:
    """The ``--buffer`` settings ``results`` has real-link timings for, the table's first:
    ``bdp`` when timed, else the first timed."""
    timed = list(results.get("real_link", {}))
    return sorted(timed, key=lambda b: b != "bdp")


def t_rows(results: dict) -> list[dict]:
    """Per (target link, arm): steps to target, step time, T, L4-equivalent T, T(dense) / T;
    with ``--real-link`` timings, the simulated step paired with the first of ``real_buffers``
    and the same from its real step (``*_real``), the simulator's error against it (%, positive:
    optimistic), and every buffer's real step (``step_s_real_by_buffer``)."""
    buffers = real_buffers(results)
    real = results["real_link"][buffers[0]] if buffers else {"step_s": {}, "sim_step_s": {}}

    def t_of(name: str, step_s: float | None) -> float | None:
        steps = results["steps_to_target"][name]["steps"]
        return None if steps is None or step_s is None else steps * step_s

    def simulated(key: str) -> float:
        return real["sim_step_s"].get(key, results["step_s"][key])

    rows = []
    for mbps, link in results["links"].items():
        dense = {"": t_of("dense", simulated(f"dense/{mbps}")),
                 "_real": t_of("dense", real["step_s"].get(f"dense/{mbps}"))}  # fmt: skip
        for name, reach in results["steps_to_target"].items():
            key = f"{name}/{mbps}"
            row = {"mbps": int(mbps), "arm": name, "steps": reach["steps"]}
            for suffix, step_s in (("", simulated(key)), ("_real", real["step_s"].get(key))):
                t, base = t_of(name, step_s), dense[suffix]
                row[f"step_s{suffix}"], row[f"T_s{suffix}"] = step_s, t
                row[f"T_l4_s{suffix}"] = None if t is None else t / link["time_scale"]
                row[f"speedup{suffix}"] = None if t is None or base is None else base / t
            if row["step_s_real"] is not None:  # tokens/s simulated over real, - 1
                row["sim_error_pct"] = 100 * (row["step_s_real"] / row["step_s"] - 1)
            row["step_s_real_by_buffer"] = {
                b: results["real_link"][b]["step_s"].get(key) for b in buffers
            }
            rows.append(row)
    return rows


def render_table(results: dict) -> str:
    meta = results["meta"]
    buffers = real_buffers(results)
    real = results["real_link"][buffers[0]] if buffers else None
    others = buffers[1:]
    lines = [
        f"Reference workload, pipelined over 4 processes (gloo) on links emulating "
        f"`{meta['target']}` on its GPUs at each bandwidth + {meta['latency_ms']:g} ms; "
        f"link-off dense step {meta['link_off_step_s']:.3f} s. Target: validation loss "
        f"{meta['target_loss']:.3f} (the dense twin's at {meta['base_steps']} steps).",
        "",
    ]
    if real:
        lines += [
            "Step times measured on each emulated link twice, back to back: under the link "
            "simulator and over a real shaped link (4 torchrun nodes in network namespaces, "
            "every pair over its own link through a userspace relay), its drop-tail buffer "
            f"{BUFFER_WORDS[buffers[0]]}. The error is the simulator's tokens/s against the "
            "real link's (positive: optimistic); dropped: the relay's drops during the real run.",
            "",
        ]
        head = ["target link", "emulated link", "arm", "steps to target", "step simulated",
                "step real", "simulator error",
                *(f"step real, buffer {BUFFER_WORDS[b]}" for b in others),
                "T simulated", "T real", "T real (L4 equiv.)", "T(dense) / T real",
                "dropped"]  # fmt: skip
    else:
        head = ["target link", "emulated link", "arm", "steps to target", "step time", "T",
                "T (L4 equiv.)", "T(dense) / T"]  # fmt: skip
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in t_rows(results):
        key = f"{row['arm']}/{row['mbps']}"
        link = results["links"][str(row["mbps"])]
        reached = row["steps"] is not None
        reach = results["steps_to_target"][row["arm"]]
        missing = f"not within {reach['budgets'][-1][0]}" + (
            f" ({reach['pending']} not run yet)" if "pending" in reach else ""
        )

        def step(seconds, steady) -> str:
            return "–" if seconds is None else f"{seconds:.2f} s{'' if steady else '*'}"

        cells = [f"{row['mbps']} Mbit/s",
                 f"{link['bandwidth_mbps']:.3g} Mbit/s + {link['latency_ms']:.0f} ms",
                 row["arm"], f"{row['steps']:.0f}" if reached else missing]  # fmt: skip
        if real:
            timed_real = row["step_s_real"] is not None
            sim_steady = real["sim_steady"].get(key, results.get("steady", {}).get(key, True))
            cells += [
                step(row["step_s"], sim_steady),
                step(row["step_s_real"], real["steady"].get(key, True)),
                f"{row['sim_error_pct']:+.0f}%" if timed_real else "–",
                *(step(row["step_s_real_by_buffer"][b],
                       results["real_link"][b]["steady"].get(key, True)) for b in others),
                f"{row['T_s']:,.0f} s" if reached else "–",
                f"{row['T_s_real']:,.0f} s" if reached and timed_real else "–",
                f"{row['T_l4_s_real']:,.0f} s" if reached and timed_real else "–",
                f"{row['speedup_real']:.1f}x" if row["speedup_real"] is not None else "–",
                str(real["dropped"].get(key, "–")),
            ]  # fmt: skip
        else:
            cells += [step(row["step_s"], results.get("steady", {}).get(key, True))] + (
                [f"{row['T_s']:,.0f} s", f"{row['T_l4_s']:,.0f} s", f"{row['speedup']:.1f}x"]
                if reached
                else ["—", "—", "—"]
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"`*`: no three consecutive {TIMING_WINDOW}-step windows agreed within 1%; "
              "the median of the last three.", ""]  # fmt: skip
    for b in buffers:
        same = all(results["real_link"][b]["losses_equal"].values())
        lines += [f"Losses over the real link (buffer {BUFFER_WORDS[b]}) equal the simulated "
                  f"run's bit for bit: {'yes, every pair' if same else '**no**'}.", ""]  # fmt: skip
    lines += ["Budgets tried (steps: final validation loss, seed 0):", ""]
    for name, reach in results["steps_to_target"].items():
        tried = ", ".join(f"{b}: {loss:.3f}" for b, loss in reach["budgets"])
        lines.append(f"- {name}: {tried}")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    rows = t_rows(results)
    for i, arm in enumerate(results["steps_to_target"]):
        color = f"C{i}"
        for suffix, style, label in (("", "o-", arm), ("_real", "s--", f"{arm} (real link)")):
            points = sorted((r["mbps"], r[f"T_l4_s{suffix}"]) for r in rows
                            if r["arm"] == arm and r[f"T_l4_s{suffix}"] is not None)  # fmt: skip
            if points:
                ax.plot(*zip(*points, strict=True), style, color=color, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("target link bandwidth (Mbit/s, + 50 ms)")
    ax.set_ylabel("time to target, L4-equivalent (s)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(results: dict, out: Path) -> None:
    (out / "table.md").write_text(render_table(results))
    plot(results, out / "t_to_target.png")
    print((out / "table.md").read_text())


if __name__ == "__main__":
    main()
