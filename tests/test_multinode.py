"""The multi-node path: two torchrun "nodes" on one machine, and what reaches wandb."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from conftest import REPO, TINY, read_jsonl


def test_two_nodes_train_and_log_to_offline_wandb(tmp_path):
    """Two torchrun processes with --nnodes 2 (c10d rendezvous on localhost), one pipeline stage
    each, the same config: they train, and the wire metrics reach an offline wandb run."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dump = tmp_path / "run"
    env = {**os.environ, "WANDB_MODE": "offline", "NNODES": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "NGPU": "1"}  # fmt: skip
    args = ["--dump_folder", str(dump), "--training.steps", "4", "--metrics.enable_wandb",
            "--metrics.wandb_project", "pm-two-nodes", "--metrics.wandb_tags", '["ci", "two-nodes"]']  # fmt: skip
    nodes = [
        subprocess.Popen(
            ["bash", "scripts/train.sh", str(TINY), *args], cwd=REPO, env={**env, "NODE_RANK": str(rank)},
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for rank in range(2)
    ]  # fmt: skip
    outputs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]

    records = read_jsonl(dump / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["wire/compression_ratio"] == 16.0

    (run_file,) = Path(dump, "wandb").rglob("run-*.wandb")
    dump_text = subprocess.run(
        [str(Path(sys.executable).parent / "wandb"), "beta", "leet", "inspect", str(run_file)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert 'project:  "pm-two-nodes"' in dump_text
    assert 'tags:  "ci"' in dump_text and 'tags:  "two-nodes"' in dump_text
    logged = dict(re.findall(r'nested_key:\s+"([^"]+)"\s+value_json:\s+"([^"]*)"', dump_text))
    for key in (
        "wire/fwd_bytes",
        "wire/bwd_bytes",
        "wire/compression_ratio",
        "wire/fwd_bytes/b0",
        "subspace/leak",
    ):
        assert key in logged, key
    assert float(logged["wire/compression_ratio"]) == 16.0
