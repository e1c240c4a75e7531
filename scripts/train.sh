#!/usr/bin/env bash
# Launch a training run with torchrun:
#   bash scripts/train.sh CONFIG.toml [--section.key value ...]
# The config is checked first (one-line error, no worker started). Environment:
#   NGPU          processes per node (alias NPROC_PER_NODE; default: what the config needs on one node)
#   NNODES        number of nodes (default 1); with NNODES>1 also set
#   NODE_RANK, MASTER_ADDR, MASTER_PORT (c10d rendezvous on MASTER_ADDR:MASTER_PORT)
#   LOG_RANK      local ranks whose output is shown (default: the last one, where the loss lives)
#   MAX_RESTARTS  restart the whole job this many times after a worker dies (default 0); with
#                 [checkpoint] enable = true it resumes from the newest complete checkpoint
#   PYTHON        interpreter with protocol_models installed (default: .venv/bin/python)
set -euo pipefail
if [ $# -lt 1 ]; then
    echo "usage: bash scripts/train.sh CONFIG.toml [--section.key value ...]" >&2
    exit 2
fi
config="$(realpath "$1")"
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"

check="$("$PYTHON" -m protocol_models.config --toml "$config" "$@")" || exit 2
nproc="$(sed -n 's/^nproc=//p' <<<"$check")"
if grep -q '^bundled_data=1' <<<"$check"; then
    "$PYTHON" -m protocol_models.data >/dev/null
fi

NNODES="${NNODES:-1}"
NGPU="${NGPU:-${NPROC_PER_NODE:-$(( nproc / NNODES ))}}"
LOG_RANK="${LOG_RANK:-$(( NGPU - 1 ))}"
if [ "$NNODES" -eq 1 ]; then
    rdzv=(--standalone)
else
    rdzv=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK}" --rdzv_backend c10d
          --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}")
fi
exec "$PYTHON" -m protocol_models.launch "${rdzv[@]}" --nproc_per_node "$NGPU" \
    --max-restarts "${MAX_RESTARTS:-0}" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m protocol_models.train --toml "$config" "$@"
