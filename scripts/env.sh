# Sourced by the other scripts: cd to the repository root and make sure .venv exists.
# Creates .venv with the pinned dependencies (pyproject.toml) on first use.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import protocol_models" 2>/dev/null; then
    echo "[setup] creating .venv with the pinned dependencies (first run only)..."
    python3 -m venv .venv
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[test]'
fi
export PATH="$ROOT/.venv/bin:$PATH"
