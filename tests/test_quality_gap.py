"""The quality-gap study's reading of a pair that rereads its text: training-loss windows from a
run's metrics, and the validation gap beside the training gap at the longest budget."""

from __future__ import annotations

import json

from recipes import quality_gap as study


def write_metrics(folder, losses: dict[int, float]) -> None:
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for step, loss in losses.items():
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
        f.write(json.dumps({"step": 24, "lr": 0.1}) + "\n")  # a record without the loss


def test_training_loss_windows_are_means_over_each_twelfth(tmp_path):
    write_metrics(tmp_path / "run", {s: float(s) for s in range(1, 25)})
    windows = study.train_loss(tmp_path / "run", 24)
    assert [end for end, _ in windows] == list(range(2, 25, 2))
    assert windows[0] == (2, 1.5) and windows[-1] == (24, 23.5)


def test_the_longest_pair_shows_both_gaps_per_validation():
    longest = max(arm.steps for arm in study.ARMS)
    arm = next(a for a in study.ARMS if a.steps == longest and a.method != "dense")
    step = longest // 2

    def entry(val: float, fit: float) -> dict:
        return {"val_curve": [[step, val]], "train_loss": [[step, fit]]}

    results = {"runs": {
        arm.twin.name: {"seeds": {"0": entry(4.0, 2.0)}},
        arm.name: {"seeds": {"0": entry(4.04, 2.1), "1": {"val_curve": [[step, 4.0]]}}},
    }}  # fmt: skip
    lines = study.render_rereading(results).strip().splitlines()
    assert lines[-1] == f"- {arm.name} seed 0 (validation / training): {step}: +1.00 / +5.00"
