"""Summarize a finished run from its JSONL metrics: first/last loss, validation, wire bytes.

python -m protocol_models.report CONFIG.toml [--section.key value ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

from protocol_models.config.run_config import ConfigError, load_config, split_argv, usage_asked
from protocol_models.training.metrics import read_jsonl


def summarize(dump_folder: Path) -> str:
    train = read_jsonl(dump_folder / "metrics.jsonl")
    if not train:
        raise SystemExit(f"error: no metrics in {dump_folder / 'metrics.jsonl'}")
    first, last = train[0], train[-1]
    lines = [
        f"run: {dump_folder}",
        f"train loss: {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
        f"(step {last['step']})",
    ]
    validation = read_jsonl(dump_folder / "validation.jsonl")
    if validation:
        v0, v1 = validation[0], validation[-1]
        lines.append(
            f"validation loss: {v0['validation_metrics/loss']:.4f} (step {v0['step']}) -> "
            f"{v1['validation_metrics/loss']:.4f} (step {v1['step']})"
        )
    if "wire/compression_ratio" in last:
        sent = last["wire/fwd_bytes"] + last["wire/bwd_bytes"]
        lines.append(
            f"wire per step: {sent:,.0f} B sent (fwd {last['wire/fwd_bytes']:,.0f} + bwd "
            f"{last['wire/bwd_bytes']:,.0f}) vs {last['wire/dense_bytes']:,.0f} B uncompressed "
            f"-> measured compression {last['wire/compression_ratio']:.1f}x"
        )
    if "subspace/leak" in last:
        lines.append(f"subspace leak at the boundaries: {last['subspace/leak']:.2e}")
    lines.append(f"throughput: {last['tps']:,.0f} tokens/s per process (last log step)")
    return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    if usage_asked(argv, __doc__):
        return 0
    if argv and not argv[0].startswith("--"):
        argv = ["--toml", *argv]
    toml_path, overrides = split_argv(argv)
    try:
        config = load_config(toml_path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(summarize(Path(config.dump_folder)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
