#!/usr/bin/env bash
# Start scripts/train.sh once on every node of a SLURM allocation (the sbatch scripts call it):
#   bash scripts/slurm/train_nodes.sh CONFIG.toml [--section.key value ...]
# NODE_RANK is each node's position in the node order you give, not SLURM's allocation order
# (SLURM_NODEID), because TorchTitan puts pipeline stage s on ranks s*D .. s*D+D-1 (D = world /
# stages): node n holds ranks n*G .. n*G+G-1 (G GPUs per node, from the config via train.sh).
# The node order, first match wins:
#   NODES=FILE      one line per node, "hostname [region]" (SLURM node names), node 0 first; the
#                   region is the node's REGION label (a stage spanning two labels is refused)
#   SLURM_HOSTFILE  its order (one host per line, as for --distribution=arbitrary)
#   otherwise       the allocation's node names, sorted
# Without a region column every node's label is its host name (REGION is unset on the nodes).
# MASTER_ADDR (the rendezvous) is the first node of the order; MASTER_PORT defaults to 29500.
# NCCL runs over plain TCP between regions: scripts/multinode.env holds the settings (a value
# exported before sbatch wins).
# srun starts the same command line on every node, so every node needs this checkout, with its
# .venv (or PYTHON), at the same absolute path, and the same code there: before anything else
# each node checks both against the node that runs this script (the batch host) and stops with
# one line naming itself and what differs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

checkout_fingerprint() {  # what every node must share: pyproject.toml, package, scripts, configs
    { echo pyproject.toml; find protocol_models scripts configs -type f \( -name '*.py' \
        -o -name '*.sh' -o -name '*.env' -o -name '*.sbatch' -o -name '*.toml' \); } |
        LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
}

# What srun runs on each node: a node without the checkout cannot open this script, so the
# path checks are inline; then --on-node below compares the code.
ON_NODE='root="$PM_CHECKOUT_ROOT" node="${SLURMD_NODENAME:-$(hostname)}" py="${PYTHON:-.venv/bin/python}"
if ! cd "$root" 2>/dev/null || [ ! -f scripts/slurm/train_nodes.sh ]; then
    echo "error: node $node: no checkout of this repository at $root; every node needs it (with" \
        "its .venv) at the same path as $PM_CHECKOUT_NODE, where the job runs" >&2
    exit 2
fi
if ! command -v "$py" >/dev/null; then
    echo "error: node $node: no $py in $root (PYTHON); every node needs the .venv at the same" \
        "path as $PM_CHECKOUT_NODE: run \`source scripts/env.sh\` in $root on $node once" >&2
    exit 2
fi
exec bash scripts/slurm/train_nodes.sh --on-node "$@"'

if [ "${1:-}" = "--on-node" ]; then  # one task per node, started by the srun below
    shift
    node="${SLURMD_NODENAME:-$(hostname)}"
    here="$(checkout_fingerprint)"
    if [ "$here" != "${PM_CHECKOUT:-}" ]; then
        head="$(git rev-parse --short HEAD 2>/dev/null || echo none)"
        echo "error: node $node: the checkout at $PWD differs from $PM_CHECKOUT_NODE's" \
            "(pyproject.toml, protocol_models/, scripts/, configs/: fingerprint $here, git HEAD" \
            "$head here; $PM_CHECKOUT, $PM_CHECKOUT_HEAD there); put the same code at that path" \
            "on every node" >&2
        exit 2
    fi
    line="$(awk -v host="$SLURMD_NODENAME" '$1 == host { print NR - 1, $2; exit }' <<<"$NODE_ORDER")"
    if [ -z "$line" ]; then
        echo "error: node $SLURMD_NODENAME is not in the node order" >&2
        exit 2
    fi
    read -r NODE_RANK region <<<"$line"
    if [ -n "${region:-}" ]; then export REGION="$region"; else unset REGION; fi
    echo "node $SLURMD_NODENAME: NODE_RANK=$NODE_RANK of $NNODES," \
        "REGION=${REGION:-unset (the host name)}, rendezvous $MASTER_ADDR:$MASTER_PORT"
    export NODE_RANK
    exec bash scripts/train.sh "$@"
fi

if [ $# -lt 1 ]; then
    echo "usage: bash scripts/slurm/train_nodes.sh CONFIG.toml [--section.key value ...]" >&2
    exit 2
fi
allocated="$(scontrol show hostnames "$SLURM_JOB_NODELIST")"
if [ -n "${NODES:-}" ]; then
    source="NODES=$NODES"
    NODE_ORDER="$(grep -v -e '^[[:space:]]*#' -e '^[[:space:]]*$' "$NODES")"
elif [ -n "${SLURM_HOSTFILE:-}" ]; then
    source="SLURM_HOSTFILE=$SLURM_HOSTFILE"
    NODE_ORDER="$(awk 'NF && !seen[$1]++ { print $1 }' "$SLURM_HOSTFILE")"
else
    source="the allocation"
    NODE_ORDER="$allocated"
fi
listed="$(awk '{ print $1 }' <<<"$NODE_ORDER")"
if [ "$(sort <<<"$listed")" != "$(sort <<<"$allocated")" ]; then
    echo "error: the node order ($source) lists [$(paste -sd' ' <<<"$listed")] but the job" \
        "has [$(paste -sd' ' <<<"$allocated")]; list every allocated node once" >&2
    exit 2
fi

export NODE_ORDER NNODES="$SLURM_NNODES"
export PM_CHECKOUT_ROOT="$PWD" PM_CHECKOUT="$(checkout_fingerprint)"
export PM_CHECKOUT_NODE="${SLURMD_NODENAME:-$(hostname)}"
export PM_CHECKOUT_HEAD="$(git rev-parse --short HEAD 2>/dev/null || echo none)"
export MASTER_ADDR="$(head -n 1 <<<"$listed")" MASTER_PORT="${MASTER_PORT:-29500}"
source scripts/multinode.env   # the NCCL/TCP settings, as scripts/train.sh reads them
echo "node order ($source): $(paste -sd' ' <<<"$listed"); rendezvous $MASTER_ADDR:$MASTER_PORT"
# (srun does not inherit sbatch's --cpus-per-task since SLURM 22.05: pass it on)
# (--chdir=/: a node without the checkout starts anyway, and ON_NODE says so in one line)
srun --kill-on-bad-exit=1 --ntasks-per-node=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} \
    --chdir=/ bash -c "$ON_NODE" train_nodes "$@"
