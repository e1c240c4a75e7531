# Sourced by the other scripts: cd to the repository root and make sure .venv exists.
# Creates .venv with the pinned dependencies (pyproject.toml) on first use.
#   PM_TORCH_CUDA  a CUDA build of the pinned torch version instead of PyPI's (CUDA 13.0, driver
#                  >= 580): e.g. cu128 for nodes on R525-R570 drivers, or cpu; an existing .venv
#                  with another build gets this one
#   PM_TORCH_INDEX the package index to take torch from (default, with PM_TORCH_CUDA:
#                  https://download.pytorch.org/whl/$PM_TORCH_CUDA)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
torch_version="$(sed -n 's/^ *"torch==\([^"]*\)".*/\1/p' pyproject.toml)"
if [ -n "${PM_TORCH_CUDA:-}" ]; then
    if ! [[ "$PM_TORCH_CUDA" =~ ^(cpu|cu[0-9]{3})$ ]]; then
        echo "error: PM_TORCH_CUDA=$PM_TORCH_CUDA: expected cpu or cuNNN (e.g. cu128, the CUDA" \
            "12.8 build of torch $torch_version)" >&2
        exit 2
    fi
    PM_TORCH_INDEX="${PM_TORCH_INDEX:-https://download.pytorch.org/whl/$PM_TORCH_CUDA}"
fi
install_torch() {
    # the pinned version, of build PM_TORCH_CUDA when given, from PM_TORCH_INDEX (with its
    # dependencies: the CUDA 12 and 13 builds need different nvidia-* libraries)
    local spec="torch==$torch_version${PM_TORCH_CUDA:++$PM_TORCH_CUDA}"
    echo "[setup] $spec from $PM_TORCH_INDEX"
    .venv/bin/python -m pip install --quiet --index-url "$PM_TORCH_INDEX" "$spec"
}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import protocol_models" 2>/dev/null; then
    echo "[setup] creating .venv with the pinned dependencies (first run only)..."
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    if [ -n "${PM_TORCH_INDEX:-}" ]; then install_torch; fi
    .venv/bin/python -m pip install --quiet -e '.[test]'
elif [ -n "${PM_TORCH_CUDA:-}" ] &&
    [ "$(.venv/bin/python -c 'import torch; print(torch.__version__.partition("+")[2])')" != "$PM_TORCH_CUDA" ]; then
    install_torch
fi
export PATH="$ROOT/.venv/bin:$PATH"
