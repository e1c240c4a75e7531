#!/usr/bin/env bash
# Lint and test: bash scripts/test.sh [pytest args]. Installs .venv on first use.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m protocol_models.prepare
ruff check .
python -m pytest -q --durations=25 "$@"
