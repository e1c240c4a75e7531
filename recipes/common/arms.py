"""The codec comparison's harness, shared by the studies on its workload (``compare``,
``frontier``, ``l4_regime``): arms, their overrides, the wire bytes of a run, training every
(arm, seed) through the run cache, and the summary of a study's runs."""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from protocol_models.cluster import plan
from protocol_models.config.run_config import load_config
from protocol_models.wire import codec_for
from protocol_models.wire.sizes import message_bytes
from recipes.common import (
    PARALLEL_RUNS,
    REPO,
    canonical_overrides,
    read_jsonl,
    repo_relative,
    run_folder,
    steps_to_reach,
    train_cached,
    validation_curve,
    wall_seconds,
)

OPTIMIZER = "muon"
"""The one optimizer of every arm (the subspace ablation's best): Muon on all block matrices."""
FRONTIER = REPO / "results" / "frontier" / "results.json"
"""The frontier study's runs: the same workload, so runs it measured are not trained again."""
QUICK_TOML = REPO / "tests" / "tiny.toml"
QUICK = ["--protocol.stages", "2", "--training.steps", "6", "--validator.enable",
         "--validator.freq", "3", "--validator.steps", "2"]  # fmt: skip


def arm(name: str, ratio: str, mode: str, extra: list[str], seeds: tuple[int, ...] = (0,)):
    """One row of the study: ``mode`` + ``extra`` overrides, trained once per seed."""
    return {"name": name, "ratio": ratio, "mode": mode, "extra": extra, "seeds": list(seeds)}


def overrides(a: dict, seed: int) -> list[str]:
    """The run's overrides. Dense and subspace k=8 use exactly the lists of the optimizer
    ablation (``recipes/ablation.py``), so the run cache trains them once for both studies."""
    mode = [] if a["mode"] == "subspace" else ["--protocol.mode", a["mode"]]
    return [*mode, *a["extra"], "--optimizer.name", OPTIMIZER, "--debug.seed", str(seed)]


def wire_bytes(toml: Path, over: list[str]) -> dict:
    """Bytes one training step sends over all boundaries (``wire.sizes.message_bytes`` of the
    run's mode at the workload's fp32 boundary ``[mb, seq, d]``: the packed payload sizes, tested
    equal to what the codecs send). ``dense``: the same messages uncompressed."""
    config = load_config(str(toml), over, check_environment=False)
    arch, protocol, par = config.model, config.protocol, config.parallelism
    shape = (par.pipeline_parallel_microbatch_size, config.training.seq_len, arch.dim)
    messages = (config.training.local_batch_size // shape[0]) * (config.layout_stages - 1)
    codec = codec_for(config)

    def size(direction: str, mode: str = protocol.mode) -> int:
        exact = mode != protocol.mode
        one = message_bytes(mode, shape, torch.float32, direction, k=protocol.k,
                            codec=None if exact else codec)  # fmt: skip
        return messages * one

    return {"fwd": size("fwd"), "bwd": size("bwd"), "dense": 2 * size("fwd", "dense")}


def sync_bytes(toml: Path, over: list[str]) -> int:
    """Bytes one training step exchanges over all boundaries apart from the activation wire
    (``plan.sync_bytes``: MAPL's gradient and codebook exchange;
    tested equal to what a pipelined run meters as ``wire/sync_bytes``)."""
    config = load_config(str(toml), over, check_environment=False)
    return sum(plan.sync_bytes(config)) * (config.layout_stages - 1)


def run_all(
    arms: list[dict],
    toml: Path,
    quick_over: list[str],
    cached_only: bool,
    stored: dict | None = None,
) -> dict:
    """Train every (arm, seed) through the shared cache, ``PARALLEL_RUNS`` at a time
    (``cached_only``: take the finished ones, train nothing). ``stored`` (``stored_runs``): runs
    already measured by a study's results.json, keyed by their overrides, taken as they are
    when their wire still sends the bytes it sent then (a codec whose payload changed since,
    e.g. the quantizer's scales, is trained again)."""
    jobs = [(a, s) for a in arms for s in a["seeds"]]
    stored = stored or {}

    def one(job) -> dict | None:
        a, seed = job
        over = [*quick_over, *overrides(a, seed)]
        sent, entry = stored.get(canonical_overrides(overrides(a, seed)), (None, None))
        if entry is not None and sent == wire_bytes(toml, over):
            return entry
        if cached_only:
            folder = run_folder(over, toml=toml, nproc=1)
            return seed_entry(a, seed, folder) if (folder / "done").is_file() else None
        folder = train_cached(over, toml=toml, nproc=1)
        print(f"done: {a['name']} seed {seed} ({folder.name})", flush=True)
        return seed_entry(a, seed, folder)

    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        measured = list(pool.map(one, jobs))
    results: dict = {}
    for (a, seed), entry in zip(jobs, measured, strict=True):
        if entry is None:
            continue
        if a["name"] not in results:  # bytes do not depend on the seed: measured once per arm
            results[a["name"]] = {
                "ratio_group": a["ratio"], "mode": a["mode"],
                "bytes_per_step": wire_bytes(toml, [*quick_over, *overrides(a, seed)]),
                "sync_bytes_per_step": sync_bytes(toml, [*quick_over, *overrides(a, seed)]),
                "seeds": {},
            }  # fmt: skip
        results[a["name"]]["seeds"][str(seed)] = entry
    return results


def select_arms(parser: argparse.ArgumentParser, arms: list[dict], names: list[str]) -> list[dict]:
    """The arms called ``names`` (an ``--only`` list); one error line for a name not among them."""
    unknown = set(names) - {a["name"] for a in arms}
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; the arms: {[a['name'] for a in arms]}")
    return [a for a in arms if a["name"] in names]


def seed_entry(a: dict, seed: int, folder: Path) -> dict:
    """What a study keeps of one finished run: its validation curve, last training loss, wall."""
    train = read_jsonl(folder / "metrics.jsonl")
    return {
        "run": repo_relative(folder),
        "overrides": overrides(a, seed),
        "val_curve": validation_curve(folder),
        "final_train_loss": train[-1]["loss"] if train else None,
        "wall_s": wall_seconds(folder),
    }


def stored_runs(results_json: Path) -> dict:
    """The runs a study's results.json holds, keyed by their sorted overrides (what
    ``run_all`` looks them up by): ``(bytes_per_step of their arm, the seed's entry)``."""
    if not results_json.is_file():
        return {}
    runs = json.loads(results_json.read_text())["runs"]
    return {canonical_overrides(s["overrides"]): (e["bytes_per_step"], s)
            for e in runs.values() for s in e["seeds"].values()}  # fmt: skip


def summarize(results: dict) -> None:
    """Per arm: mean/min/max final validation loss, perplexity, gap vs dense, ratio, and the
    steps the dense mean curve needs to reach the arm's mean final loss (linear interpolation
    between its validation points)."""
    dense_curve = mean_curve(results["dense"])
    dense_final = dense_curve[-1][1]
    for entry in results.values():
        finals = [s["val_curve"][-1][1] for s in entry["seeds"].values()]
        mean = sum(finals) / len(finals)
        b = entry["bytes_per_step"]
        entry.update({
            "final_val_loss": mean, "final_val_loss_min": min(finals),
            "final_val_loss_max": max(finals), "perplexity": float(torch.tensor(mean).exp()),
            "gap_vs_dense_pct": 100 * (mean - dense_final) / dense_final,
            "ratio": b["dense"] / (b["fwd"] + b["bwd"]),
            "dense_steps_to_reach": dense_steps_to(dense_curve, mean),
            "wall_s": sum(s["wall_s"] for s in entry["seeds"].values()) / len(finals),
        })  # fmt: skip


def mean_curve(entry: dict) -> list[tuple[int, float]]:
    curves = [s["val_curve"] for s in entry["seeds"].values()]
    return [(c[0][0], sum(p[1] for p in c) / len(c)) for c in zip(*curves, strict=True)]


def dense_steps_to(curve: list[tuple[int, float]], target: float) -> dict:
    """Steps the dense curve needs to reach ``target``: ``{"steps": float}`` interpolated,
    ``{"beyond": last_step}`` if it never gets there, ``{"before": first_step}`` if its first
    validation point is already below it."""
    if curve[0][1] <= target:
        return {"before": curve[0][0]}
    steps = steps_to_reach(curve, target)
    return {"beyond": curve[-1][0]} if steps is None else {"steps": steps}
