"""Per-node checkpoints when a pipeline stage's FSDP group spans nodes (the 8B layout: a stage on
two nodes of 8 GPUs): each node's checkpoint holds its own ranks' chunks of every sharded tensor.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, read_jsonl
from test_multinode import _errors, _two_nodes
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

from protocol_models.hf.checkpoint_files import CheckpointTensors
from protocol_models.tools.errors import UserError
from protocol_models.training.checkpointing import NodeSavePlanner

FSDP_ACROSS_NODES = ["--parallelism.pipeline_parallel_degree", "1",
                     "--parallelism.data_parallel_shard_degree", "4"]  # fmt: skip
"""2 nodes x 2 processes, one stage: its 4-way FSDP group spans both nodes."""
EMBEDDING = "tok_embeddings.weight"  # [8192, 64] in tests/tiny.toml, rows sharded 4 ways


def _shard_plan(rows: list[tuple[int, int]]) -> SavePlan:
    """One rank's save plan: the row ranges ``(start, count)`` of an [8, 4] tensor ``w``."""
    items = [
        WriteItem(
            index=MetadataIndex("w", torch.Size([start, 0])),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(torch.Size([start, 0]), torch.Size([count, 4])),
                properties=TensorProperties(dtype=torch.float32),
                size=torch.Size([8, 4]),
            ),
        )
        for start, count in rows
    ]
    return SavePlan(items)


def test_node_save_planner_checks_what_a_node_holds():
    """A node whose two ranks hold rows 0-3 of w: DCP's planner refuses the save (the chunks do
    not cover w), the node planner writes both chunks once; overlapping chunks are refused."""
    plans = [_shard_plan([(0, 2)]), _shard_plan([(2, 2)])]
    with pytest.raises(ValueError, match="invalid fill tensor-volume: 32 chunks-volume: 16"):
        DefaultSavePlanner(flatten_state_dict=False)._create_global_plan(plans)
    _, metadata = NodeSavePlanner(flatten_state_dict=False)._create_global_plan(plans)
    chunks = metadata.state_dict_metadata["w"].chunks
    assert [(c.offsets[0], c.sizes[0]) for c in chunks] == [(0, 2), (2, 2)]
    with pytest.raises(
        ValueError, match="node checkpoint: invalid global plan: w: chunks .* overlap"
    ):
        NodeSavePlanner(flatten_state_dict=False)._create_global_plan(
            [_shard_plan([(0, 3)]), _shard_plan([(2, 2)])]
        )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_fsdp_group_across_nodes_saves_per_node_resumes_exactly_and_exports(tmp_path):
    """Two nodes of 2 processes (same REGION, separate dump folders: no shared disk), one stage
    FSDP-sharded 4 ways across both, per-node checkpoints every 2 steps. Each node saves (DCP's
    own check refused: "invalid fill tensor-volume") and its ``.metadata`` lists its own half of
    every sharded tensor; a relaunch from step 2 reproduces steps 3-4's losses exactly; the
    gathered node folders export, a node's folder alone says how much of a tensor it lacks; a
    resume with another split of the shards over the nodes (HSDP 2 x 2) stops both nodes with
    the same one line."""
    args = ["--checkpoint.enable", "--checkpoint.per_node", "true", "--checkpoint.interval", "2",
            "--training.steps", "4"]  # fmt: skip
    dumps = {r: tmp_path / f"node{r}" for r in (0, 1)}

    def launch(name, *extra):
        return _two_nodes(
            tmp_path / name, [*args, *FSDP_ACROSS_NODES, *extra], {0: "r0", 1: "r0"},
            env={"NGPU": "2", "OMP_NUM_THREADS": "1"},
            node_args={r: ["--dump_folder", str(dumps[r])] for r in (0, 1)},
        )  # fmt: skip

    reference = launch("reference")
    for code, output in reference.values():
        assert code == 0 and "Failed to validate global plan" not in output, output[-3000:]
    folders = {r: dumps[r] / "checkpoint" / f"node-{r}-of-2" for r in (0, 1)}
    for r in (0, 1):
        assert sorted(p.name for p in folders[r].iterdir()) == ["step-2", "step-4"]
        saved = dcp.FileSystemReader(str(folders[r] / "step-2")).read_metadata()
        for name in (EMBEDDING, f"optimizer.state.{EMBEDDING}.exp_avg"):
            rows = [(c.offsets[0], c.sizes[0]) for c in saved.state_dict_metadata[name].chunks]
            assert sorted(rows) == [(4096 * r, 2048), (4096 * r + 2048, 2048)], (name, rows)
    (metrics,) = [d / "metrics.jsonl" for d in dumps.values() if (d / "metrics.jsonl").exists()]
    uninterrupted = {rec["step"]: rec["loss"] for rec in read_jsonl(metrics)}
    assert sorted(uninterrupted) == [1, 2, 3, 4]

    # the run stopped after step 2's checkpoint: relaunched, it resumes there on both nodes
    for r in (0, 1):
        shutil.rmtree(folders[r] / "step-4")
    metrics.unlink()
    resumed = launch("resumed")
    for code, output in resumed.values():
        assert code == 0 and "Training starts at step 3" in output, output[-3000:]
    assert {rec["step"]: rec["loss"] for rec in read_jsonl(metrics)} == {
        s: uninterrupted[s] for s in (3, 4)
    }

    # export: the node folders copied into one checkpoint folder hold every tensor whole
    gathered = tmp_path / "gathered"
    shutil.copytree(dumps[0] / "checkpoint", gathered)
    shutil.copytree(folders[1], gathered / "node-1-of-2")
    step_dirs = [gathered / f"node-{r}-of-2" / "step-4" for r in (0, 1)]
    whole = CheckpointTensors(step_dirs).load([EMBEDDING])[EMBEDDING]
    for r, step_dir in enumerate(step_dirs):
        part = {EMBEDDING: torch.full((8192, 64), float("nan"))}
        dcp.load(part, storage_reader=dcp.FileSystemReader(str(step_dir)), no_dist=True)
        rows = slice(4096 * r, 4096 * r + 4096)
        assert (
            not part[EMBEDDING][rows].isnan().any() and part[EMBEDDING].isnan().sum() == 4096 * 64
        )
        assert torch.equal(whole[rows], part[EMBEDDING][rows])
    with pytest.raises(UserError) as lacking:
        CheckpointTensors(step_dirs[:1])
    assert "is only partly stored in these folders (" in str(lacking.value)
    assert "of its 524288 elements)" in str(lacking.value) and "\n" not in str(lacking.value)
    done = subprocess.run(
        [sys.executable, "-m", "protocol_models.export", "--checkpoint", str(gathered),
         "--out", str(tmp_path / "hf")], cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "node-*/step-4" in done.stdout and (tmp_path / "hf" / "config.json").is_file()

    # another layout: 2 replicas of 2-way FSDP; rank 1 holds rows 4096-8191, node 0 saved 0-4095
    other = launch("other_layout", "--parallelism.data_parallel_shard_degree", "2",
                   "--parallelism.data_parallel_replicate_degree", "2")  # fmt: skip
    lines = []
    for code, output in other.values():
        assert code == 2 and "Traceback" not in output, output[-3000:]
        (line,) = _errors(output)
        lines.append(line.split("error: ", 1)[1])
    assert lines[0] == lines[1], lines
    assert lines[0].startswith(
        f"checkpoint {str(folders[0] / 'step-4')!r} lacks what rank 1 (node 0) needs"
    )
    assert (
        "ranks lacking something: 1, 2)" in lines[0]
        and "resume with the layout that wrote it" in lines[0]
    )
