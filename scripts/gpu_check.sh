#!/usr/bin/env bash
# First run on a new GPU node or cluster: a few real steps of a config's layout, then per-stage
# peak memory vs the planner, bytes per coordinate on the wire, tokens/s, P2P and data path.
#   bash scripts/gpu_check.sh CONFIG.toml [--steps N] [--section.key value ...]
# Multi-node: run it on every node with the same NNODES/NODE_RANK/MASTER_ADDR as scripts/train.sh.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m protocol_models.gpu_check "$@"
