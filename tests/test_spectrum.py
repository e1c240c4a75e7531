"""The concentration measures of the scale study on synthetic cases with known answers, and the
data-driven subspace: a basis file refused in one line when it is not a basis, trained on by
every stage and kept bit for bit through a resume, and written by ``pilot_basis`` from a
trained run (a subspace model's boundary writes lie in span(U): the file recovers it)."""

from __future__ import annotations

import math
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, TINY, torchrun
from safetensors.torch import load_file, save_file

from protocol_models.config.run_config import load_config
from protocol_models.hf.checkpoint_files import CheckpointTensors
from protocol_models.model.spectrum import (
    effective_rank,
    energy_share,
    principal_basis,
    second_moment,
)
from protocol_models.model.subspace import leak_tolerance, make_basis_and_table, orthonormalize
from protocol_models.tools.errors import ConfigError


def _orthonormal(rows: int, cols: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return orthonormalize(torch.randn(rows, cols, generator=gen, dtype=torch.float64)).contiguous()


def test_effective_rank_and_energy_share_of_known_spectra():
    """A matrix ``A diag(s) B^T`` with orthonormal ``A``, ``B`` has singular values ``s``: its
    effective rank is ``exp(H(s / sum s))`` (3 for three equal values, 1 at rank one) and its top-k
    energy share ``sum_{i<k} s_i^2 / sum s_i^2``, whatever ``A`` and ``B`` are."""
    left, right = _orthonormal(40, 6, 0), _orthonormal(24, 6, 1)

    def with_spectrum(*s: float) -> torch.Tensor:
        return left @ torch.diag(torch.tensor(s, dtype=torch.float64)) @ right.T

    assert effective_rank(with_spectrum(2, 2, 2, 0, 0, 0)) == pytest.approx(3, rel=1e-9)
    assert effective_rank(with_spectrum(5, 0, 0, 0, 0, 0)) == pytest.approx(1, rel=1e-9)
    s = torch.tensor([4.0, 3, 2, 1, 1, 0.5], dtype=torch.float64)
    p = s / s.sum()
    assert effective_rank(with_spectrum(*s)) == pytest.approx(math.exp(-(p * p.log()).sum()))
    rows = with_spectrum(*s)  # [40, 24]: 40 vectors of width 24
    assert energy_share(second_moment(rows), 2) == pytest.approx(25 / 31.25, rel=1e-9)
    assert energy_share(second_moment(rows), 6) == pytest.approx(1, rel=1e-9)
    halves = second_moment(rows[:17]) + second_moment(rows[17:])  # accumulated batch by batch
    assert torch.allclose(halves, second_moment(rows))


def test_principal_basis_recovers_the_subspace_the_rows_lie_in():
    """Rows ``c U^T`` with U ``[32, 4]``: the top-4 share is 1 and the basis spans U (the same
    projector), orthonormal to fp32 rounding, each column's largest entry positive; a fifth,
    weaker direction added to the rows is not picked for k = 4."""
    basis = _orthonormal(32, 4, 2).float()
    gen = torch.Generator().manual_seed(3)
    rows = torch.randn(500, 4, generator=gen) * torch.tensor([5.0, 4, 3, 2]) @ basis.T
    assert energy_share(second_moment(rows), 4) == pytest.approx(1, abs=1e-6)
    found = principal_basis(second_moment(rows), 4)
    assert found.dtype == torch.float32 and found.shape == (32, 4) and found.is_contiguous()
    assert (found.T @ found - torch.eye(4)).abs().max() < leak_tolerance(torch.float32)
    assert torch.allclose(found @ found.T, basis @ basis.T, atol=1e-5)
    assert bool((found[found.abs().argmax(dim=0), torch.arange(4)] > 0).all())
    assert torch.equal(principal_basis(second_moment(-rows), 4), found)  # signs: of M alone
    weak = _orthonormal(32, 1, 4).float()
    noisy = second_moment(rows + 0.5 * torch.randn(500, 1, generator=gen) @ weak.T)
    assert torch.allclose(principal_basis(noisy, 4) @ principal_basis(noisy, 4).T,
                          basis @ basis.T, atol=0.05)  # fmt: skip
    assert 0.95 < energy_share(noisy, 4) < 1


def test_the_study_pairs_seeds_and_fits_the_trend():
    """``recipes/scale.py`` on a synthetic results file: each seed's gap against the twin's same
    seed, the fitted gap per doubling of d (a line in log d) and the factor per doubling (a power
    law) per seed and pooled, and rows not yet run marked."""
    from recipes.scale import WIDTHS, Arm, gaps, render_table, trends

    def study(seed0_gaps, seed1_extra=0.5):
        runs = {}
        for d, shrink in zip(WIDTHS, seed0_gaps, strict=True):
            for wire, gap in (("dense", 0.0), ("exact", shrink)):
                seeds = {str(s): {"final_val_loss": 4.0 * (1 + (gap + seed1_extra * s * (wire != "dense")) / 100),
                                  "wall_s": 10.0} for s in (0, 1)}  # fmt: skip
                runs[Arm(d, wire).name] = {"ratio": 32.0, "seeds": seeds}
        return {"runs": runs}

    results = study((2.0, 1.0, 0.0))  # gap 2, 1, 0 % (+0.5 seed 1)
    assert gaps(results, Arm(128, "exact")) == pytest.approx([2.0, 2.5])
    assert gaps(results, Arm(128, "8-bit")) is None
    fitted = trends(results)
    assert fitted["exact per doubling of d"]["per seed"] == pytest.approx([-1.0, -1.0])
    assert fitted["exact per doubling of d"]["pooled"] == pytest.approx(-1.0)
    assert "exact factor per doubling of d" not in fitted  # a gap of 0 has no power law
    assert "8-bit per doubling of d" not in fitted
    table = render_table(results)
    assert "| d=128 exact 300 steps | 4 | 32x | 300 | 4.0800 / 4.1000 | +2.00 / +2.50 (mean +2.25)" in table
    assert "| d=512 8-bit 300 steps | 16 | | 300 | not run yet | | |" in table
    assert "The 12 of 26 runs trained so far: wall times sum to 0.0 h" in table

    halving = trends(study((4.0, 2.0, 1.0), seed1_extra=0.0))["exact factor per doubling of d"]
    assert halving["per seed"] == pytest.approx([0.5, 0.5])
    assert halving["pooled"] == pytest.approx(0.5)
    mixed = study((4.0, 2.0, 1.0), seed1_extra=4.0)  # seed 1: 8, 6, 5 %
    factor = trends(mixed)["exact factor per doubling of d"]
    assert factor["per seed"][1] == pytest.approx((5 / 8) ** 0.5)
    assert factor["pooled"] == pytest.approx((0.5 * (5 / 8) ** 0.5) ** 0.5)  # geometric mean
    assert "- exact factor per doubling of d: 0.50, 0.79; pooled 0.63" in render_table(mixed)


def _basis_file(path, basis: torch.Tensor):
    save_file({"basis": basis.contiguous()}, str(path))
    return str(path)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: {"basis": torch.randn(64, 3)}, "is torch.float32 [64, 3], expected torch.float32 [model.dim, protocol.k] = [64, 4]"),
        (lambda: {"basis": torch.randn(64, 4)}, "are not orthonormal"),
        (lambda: {"u": _orthonormal(64, 4, 0).float()}, "no tensor 'basis' (has ['u'])"),
        (lambda: {"basis": torch.full((64, 4), math.nan)}, "holds non-finite values"),
        (None, "not a readable safetensors file"),
    ],
)
def test_a_file_that_is_not_a_basis_is_refused_in_one_line(tmp_path, make, says):
    path = tmp_path / "u.safetensors"
    if make is None:
        path.write_bytes(b"not safetensors")
    else:
        save_file(make(), str(path))
    with pytest.raises(ConfigError) as err:
        load_config(str(TINY), ["--protocol.basis_file", str(path), "--dump_folder",
                                str(tmp_path / "run")])  # fmt: skip
    assert str(err.value).startswith(f"protocol.basis_file = '{path}': ")
    assert says in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="needs protocol.mode = 'subspace'"):
        load_config(str(TINY), ["--protocol.basis_file", str(path), "--protocol.mode", "dense"],
                    check_environment=False)  # fmt: skip


def test_a_basis_file_is_every_stage_s_u_and_resumes_bit_exactly(tmp_path):
    """2 stages train on U from a file (the stages agree at start-up on its digest, and the
    boundary is exact); the checkpoint holds that U bit for bit, not the seeded one, and a
    resume from step 2 replays steps 3-4 bit for bit."""
    seeded, _ = make_basis_and_table(7, 64, 4, 8192)
    basis = _orthonormal(64, 4, 11).float()
    path = _basis_file(tmp_path / "u.safetensors", basis)
    args = ["--protocol.basis_file", path, "--training.steps", "4", "--checkpoint.enable",
            "--checkpoint.interval", "2"]  # fmt: skip
    reference = torchrun(2, tmp_path / "run", *args)
    assert all(r["subspace/leak"] < leak_tolerance(torch.float32) for r in reference)
    for step in (2, 4):
        stored = CheckpointTensors(tmp_path / "run" / "checkpoint" / f"step-{step}").load(["basis"])
        assert torch.equal(stored["basis"], basis) and not torch.equal(stored["basis"], seeded)
    shutil.rmtree(tmp_path / "run" / "checkpoint" / "step-4")
    resumed = torchrun(2, tmp_path / "run", *args)
    assert [r["loss"] for r in resumed] == [r["loss"] for r in reference]
    assert [r["grad_norm"] for r in resumed][2:] == [r["grad_norm"] for r in reference][2:]
    stored = CheckpointTensors(tmp_path / "run" / "checkpoint" / "step-4").load(["basis"])
    assert torch.equal(stored["basis"], basis)
    # a resume from another U (another file, or none) is refused, not silently replaced
    other = _basis_file(tmp_path / "other.safetensors", _orthonormal(64, 4, 12).float())
    for swap in (["--protocol.basis_file", other], ["--protocol.basis_file", ""]):
        result = subprocess.run(
            [sys.executable, "-m", "protocol_models.launch", "--standalone", "--nproc_per_node",
             "2", "-m", "protocol_models.train", "--toml", str(TINY), "--dump_folder",
             str(tmp_path / "run"), *args, "--training.steps", "6", *swap],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert result.returncode == 2, result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert errors and "was trained from another U than protocol.basis_file" in errors[0]
        assert "Traceback" not in result.stderr


def test_pilot_basis_of_a_subspace_run_recovers_its_u(tmp_path, seeded_runs):
    """A trained 2-stage subspace model writes into span(U) upstream of its boundary, so the
    principal subspace of its boundary writes is span(U): ``pilot_basis`` finds it, says the
    subspace holds ~100% of the energy, and the file it writes is a valid basis file."""
    single, _ = seeded_runs(2)
    out = tmp_path / "u.safetensors"
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.pilot_basis", "--checkpoint",
         str(single / "checkpoint"), "--k", "4", "--out", str(out), "--steps", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "at the boundaries after blocks [2]: the subspace holds 100.0% of their energy" in (
        result.stdout
    )
    found = load_file(str(out))["basis"]
    trained = CheckpointTensors(sorted((single / "checkpoint").glob("step-*"))[-1]).load(["basis"])
    u = trained["basis"]
    assert torch.allclose(found @ found.T, u @ u.T, atol=1e-4)
    load_config(str(TINY), ["--protocol.basis_file", str(out), "--dump_folder",
                            str(tmp_path / "run")])  # fmt: skip
    assert not list(tmp_path.glob(".*partial"))
    bad = subprocess.run(
        [sys.executable, "-m", "protocol_models.pilot_basis", "--checkpoint",
         str(single / "checkpoint"), "--k", "65", "--out", str(tmp_path / "v.safetensors")],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip() == (
        "error: --k 65: must be at most model.dim = 64"
    )
