#!/usr/bin/env bash
# Launch a training run with torchrun:
#   bash scripts/train.sh CONFIG.toml [--section.key value ...]
# The config, and the environment below against it, are checked first (one-line error,
# exit code 2, no worker started). Environment:
#   NGPU          processes per node (alias NPROC_PER_NODE; default: what the config needs on one node)
#   NNODES        number of nodes (default 1); with NNODES>1 also set
#   NODE_RANK     this node's place, 0..NNODES-1: node n gets global ranks n*NGPU .. n*NGPU+NGPU-1
#                 and TorchTitan puts pipeline stage s on ranks s*D .. s*D+D-1 (D = world / stages)
#   MASTER_ADDR, MASTER_PORT  c10d rendezvous endpoint: node 0's address, reachable by all
#                 (node 0 hosts the store; port 29500)
#   LOCAL_ADDR    the address other nodes reach this node by (default on node 0: MASTER_ADDR,
#                 where the workers' store is announced; elsewhere torch's default, the FQDN)
#   REGION        this node's region label (default: its host name); a stage whose data-parallel
#                 group spans two labels is refused at start-up
#   LOG_RANK      local ranks whose output is shown (default: the last one, where the loss lives);
#                 a failed run's last line is the first failing rank's error, shown or not
#   MAX_RESTARTS  restart the whole job this many times after a worker dies (default 0); with
#                 [checkpoint] enable = true it resumes from the newest complete checkpoint (a
#                 worker's user error ends the run instead: it would recur)
#   PYTHON        interpreter with protocol_models installed (default: .venv/bin/python)
# With NNODES>1 the NCCL/TCP settings of scripts/multinode.env apply (an exported value wins).
set -euo pipefail
asked_help=0
for arg in "$@"; do
    if [ "$arg" = -h ] || [ "$arg" = --help ]; then asked_help=1; fi
done
if [ $# -lt 1 ] || [ "$asked_help" = 1 ]; then
    # the usage: this file's opening comment
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -n 's/^# \{0,1\}//p' >&"$(( $# ? 1 : 2 ))"
    exit "$(( $# ? 0 : 2 ))"
fi
config="$(realpath "$1")"
shift
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
if ! command -v "$PYTHON" >/dev/null; then  # e.g. a node whose checkout has no .venv yet
    echo "error: PYTHON = $PYTHON: no such program in $PWD on $HOSTNAME; run" \
        "\`source scripts/env.sh\` here once (it creates .venv)$( [ "${NNODES:-1}" -gt 1 ] &&
        echo ", on every node: each needs the checkout and its .venv")" >&2
    exit 2
fi

# the check, then (same process) the bundled data and the token ids of a map-style corpus,
# made once per node here, a "data:" line each
check="$("$PYTHON" -m protocol_models.config --prepare --toml "$config" "$@")" || exit 2
nproc="$(sed -n 's/^nproc=//p' <<<"$check")"
if grep -q '^device=cpu' <<<"$check"; then
    export PROTOCOL_MODELS_DEVICE=cpu   # bind TorchTitan to the CPU even where a GPU exists
fi

NNODES="${NNODES:-1}"
NGPU="${NGPU:-${NPROC_PER_NODE:-$(( nproc / NNODES ))}}"
LOG_RANK="${LOG_RANK:-$(( NGPU - 1 ))}"
if [ "$NNODES" -eq 1 ]; then
    rdzv=(--standalone)
else
    source scripts/multinode.env   # NCCL over plain TCP between nodes (values already set win)
    rdzv=(--nnodes "$NNODES" --node_rank "${NODE_RANK:?set NODE_RANK}" --rdzv_backend c10d
          --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}")
    # the workers' store runs on node 0 and is announced by this address (torch's default is
    # the host's FQDN, which other regions may not resolve)
    local_addr="${LOCAL_ADDR:-}"
    if [ -z "$local_addr" ] && [ "$NODE_RANK" = 0 ]; then local_addr="$MASTER_ADDR"; fi
    if [ -n "$local_addr" ]; then rdzv+=(--local-addr "$local_addr"); fi
fi
exec "$PYTHON" -m protocol_models.launch "${rdzv[@]}" --nproc_per_node "$NGPU" \
    --max-restarts "${MAX_RESTARTS:-0}" --local-ranks-filter "$LOG_RANK" --tee 3 \
    --log-line-prefix-template '[rank${rank}]:' \
    -m protocol_models.train --toml "$config" "$@"
