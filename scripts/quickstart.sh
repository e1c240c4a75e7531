#!/usr/bin/env bash
# Quick start on a fresh machine: install (once), prepare the bundled Shakespeare data (once),
# train the 2-stage compressed demo on CPU, and print the loss and the measured compression.
#   bash scripts/quickstart.sh [--section.key value ...]
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python -m protocol_models.prepare
bash scripts/train.sh configs/debug_cpu.toml "$@"
python -m protocol_models.report configs/debug_cpu.toml "$@"
