"""The codec-comparison harness end to end (``recipes/compare.py --quick``: tiny model, 6 steps,
dense with two seeds, the subspace, a lossy codec, ResBM and MAPL trained in one process with
in-graph boundaries, then the error-vs-depth diagnostic of every codec), and what an ``--only``
pass records."""

from __future__ import annotations

import json
import math
import subprocess
import sys

from conftest import REPO

from recipes.compare import only_meta


def test_compare_quick_writes_well_formed_results(tmp_path):
    out = tmp_path / "compare"
    result = subprocess.run(
        [sys.executable, "-m", "recipes.compare", "--quick", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    runs = results["runs"]
    codecs = {"topk K=3", "quant int2", "lowrank k=4", "svd r=2"}
    assert set(runs) == {"dense", "subspace k=4", "quant int2", "resbm h=4", "mapl r=4"}
    assert len(runs["dense"]["seeds"]) == 2
    for name, entry in runs.items():
        for seed in entry["seeds"].values():
            steps = [step for step, _ in seed["val_curve"]]
            assert steps[-1] == 6 and all(math.isfinite(loss) for _, loss in seed["val_curve"])
        b = entry["bytes_per_step"]
        assert b["dense"] == 2 * 4 * 64 * 64 * 4  # fwd + bwd of 4 microbatches [1, 64, 64] fp32
        assert entry["ratio"] == b["dense"] / (b["fwd"] + b["bwd"])
        assert (entry["ratio"] == 1) == (name == "dense")
    assert runs["subspace k=4"]["ratio"] == 16
    assert runs["resbm h=4"]["ratio"] == 16 and runs["resbm h=4"]["mode"] == "resbm"
    assert runs["mapl r=4"]["ratio"] == 16 and runs["mapl r=4"]["mode"] == "mapl"
    depth = results["error_vs_depth"]
    assert set(depth["codecs"]) == codecs
    assert all(0 < e < 2 for c in depth["codecs"].values() for e in c["rel_error"])
    assert max(depth["subspace_control"]["rel_error"]) < 1e-5
    table = (out / "table.md").read_text()
    assert all(f"| {name} |" in table for name in runs)
    for png in ("val_loss.png", "error_vs_depth.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_only_passes_record_retrained_and_added_arms():
    """An ``--only`` pass keeps the earlier passes' records; arms the results held and the pass
    trained again are ``retrained`` (a held arm it kept is not), new ones ``added``, each with
    the pass's wall time."""
    previous = {"runs": {"dense": {}, "quant int2": {}, "quant int4": {}},
                "meta": {"retrained": {"arms": ["quant int2"], "wall_s": 60.0}}}  # fmt: skip
    names = ["resbm h=8", "resbm h=1", "quant int4", "dense"]
    meta = only_meta(previous, names, ["resbm h=8", "quant int4"], 120.0)
    assert meta == {
        "retrained": {"arms": ["quant int2", "quant int4"], "wall_s": 180.0},
        "added": {"arms": ["resbm h=8", "resbm h=1"], "wall_s": 120.0},
    }
    again = only_meta({"runs": {}, "meta": meta}, ["resbm h=8", "resbm h=32"], [], 30.0)
    assert again["added"] == {"arms": ["resbm h=8", "resbm h=1", "resbm h=32"], "wall_s": 150.0}
