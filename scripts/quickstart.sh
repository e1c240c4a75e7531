#!/usr/bin/env bash
# Quick start on a fresh machine: install (once), prepare the bundled Shakespeare data (once),
# train the 2-stage compressed demo on CPU into outputs/quickstart (a checkpoint at its last step,
# for export/generate/evaluate), and print the loss, the measured compression and what to try next.
#   bash scripts/quickstart.sh [--section.key value ...]
# A previous quick start's folder is kept as outputs/quickstart.previous (replacing an older one).
for arg in "$@"; do
    if [ "$arg" = -h ] || [ "$arg" = --help ]; then  # the usage: this opening comment, nothing run
        sed -n '2,/^# A previous/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
        exit 0
    fi
done
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
dump=outputs/quickstart
run=(configs/debug_cpu.toml --dump_folder "$dump" --checkpoint.enable true
     --checkpoint.interval 1000000 "$@")   # the checkpoint of the last step only
python -m protocol_models.config --toml "${run[@]}" >/dev/null || exit 2
if [ -d "$dump" ]; then
    rm -rf "$dump.previous"
    mv "$dump" "$dump.previous"
    echo "[quickstart] the previous quick start's run is now in $dump.previous"
fi
bash scripts/train.sh "${run[@]}"
python -m protocol_models.report "${run[@]}"
cat <<EOF

Next, with the checkpoint in $dump/checkpoint (docs/after_training.md):
  python -m protocol_models.export --checkpoint $dump/checkpoint --out exported/quickstart
  python -m protocol_models.generate --checkpoint $dump/checkpoint --prompt "ROMEO:" --max-new-tokens 64 --temperature 0.8 --top-k 40 --seed 0
    (sampled: Shakespeare-like words and fragments, not sentences, after 200 CPU steps;
     greedy decoding, --temperature 0, gives only empty lines)
  python -m protocol_models.evaluate --checkpoint $dump/checkpoint
EOF
