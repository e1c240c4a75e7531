#!/usr/bin/env bash
# First run on a new GPU node or cluster: a few real steps of a config's layout, then per-stage
# peak memory vs the planner, bytes per coordinate on the wire, tokens/s, P2P and data path, the
# network NCCL used and its device memory on this node.
#   bash scripts/gpu_check.sh CONFIG.toml [--steps N] [--section.key value ...]
# Multi-node: run it on every node with the same NNODES/NODE_RANK/MASTER_ADDR as scripts/train.sh;
# the checklist then reads the NCCL settings of scripts/multinode.env, as the run will.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"   # (at the repository root from here)
if [ "${NNODES:-1}" -gt 1 ]; then
    source scripts/multinode.env   # values already set win
fi
python -m protocol_models.gpu_check "$@"
