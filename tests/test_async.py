"""The asynchronous pipeline (``Async1F1B``): the delayed update rule on its own, the weight versions
a backward differentiates, and the pipelined run against its one-process emulation, through a
flush, a checkpoint and a resume on the emulated NCCL backend."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import NCCL_RULES, VALIDATE_AT_END, assert_same_run, read_jsonl, torchrun

from protocol_models.training.delayed import DelayedUpdates
from protocol_models.wire.async_schedule import hop_depth, max_hop_depth, stage_depths
from protocol_models.wire.weight_versions import WeightVersions

ASYNC = ["--parallelism.pipeline_parallel_schedule", "Async1F1B", "--training.steps", "6"]
FLUSH_AT_3 = ["--checkpoint.interval", "3", *VALIDATE_AT_END]  # validations (steps 1, 3, 6) and
# checkpoints (3, 6) drain the pipeline
PREDICT = ["--optimizer.weight_prediction", "1"]  # batch 6 runs on predicted weights (step 5 applies
# the last update before it, and is no flush)


def _batch(t: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(t)
    return torch.randn(8, 3, generator=g), torch.randn(8, 2, generator=g)


@pytest.mark.parametrize("predict", [0.0, 1.0])
def test_delayed_rule_applies_each_gradient_one_step_late(predict):
    """W_{t+1} = W_t - lr g_{t-1}, nothing at step 1, and a flush step applies g_{t-1} then g_t;
    g_t is taken at W_t, or with weight prediction ``a`` at W_t + a (W_t - W_{t-1}) when the step
    before applied an update and was no flush: checked against the rule written out by hand
    with plain SGD."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    reference = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    delayed = DelayedUpdates(params, predict=predict)
    sgd = torch.optim.SGD(params, lr=0.1)
    steps, flush_at = 6, {4, 6}
    pending, last_change, predicted = {}, None, 0
    for t in range(1, steps + 1):
        delayed.begin(t, t in flush_at)
        x, y = _batch(t)
        torch.nn.functional.mse_loss(model(x), y).backward()
        delayed.collect(max_norm=float("inf"))
        for update in delayed.due:
            delayed.load(update)
            sgd.step()
        delayed.applied()
        # the rule by hand: the gradient of batch t at the weights batch t used
        at = reference
        if predict and last_change is not None:
            at = [r + predict * c for r, c in zip(reference, last_change, strict=True)]
            predicted += 1
        w = [r.clone().requires_grad_() for r in at]
        torch.nn.functional.mse_loss(torch.nn.functional.linear(x, *w), y).backward()
        pending[t] = [v.grad for v in w]
        before, last_change = reference, None
        for b in [b for b in (t - 1, t) if b in pending and (b < t or t in flush_at)]:
            reference = [r - 0.1 * g for r, g in zip(reference, pending.pop(b), strict=True)]
            if t not in flush_at:
                last_change = [r - r0 for r, r0 in zip(reference, before, strict=True)]
        for p, r in zip(params, reference, strict=True):
            assert torch.allclose(p, r, rtol=0, atol=1e-6), t
    assert not pending, "the last (flush) step applied every gradient"
    assert predicted == (2 if predict else 0)  # steps 3 and 4


def _forward_then_update(versions_of: callable) -> list[torch.Tensor]:
    """Batch 0's forward with version 0, an update of the parameters given to version 1, batch
    1's forward with it, then batch 0's backward: the gradients batch 0's backward produced."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    versions = versions_of(model)
    versions.reset()
    x0, x1 = torch.randn(5, 3), torch.randn(5, 3)
    loss0 = versions.forward(0, x0).square().sum()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    versions.refresh(1)
    versions.forward(1, x1).square().sum().backward()
    loss0.backward()
    return versions.grads(0)


class _OneVersion(WeightVersions):
    """What a stage without two versions does: one set of weights, updated under a batch whose
    backward is still ahead (the new values swapped in without autograd noticing)."""

    def reset(self) -> None:
        super().reset()
        self.versions[1] = self.versions[0]

    @torch.no_grad()
    def refresh(self, version: int) -> None:
        for name, p in self.module.named_parameters():
            self.versions[version][name].data = p.detach().clone()


def test_a_backward_differentiates_the_weights_its_forward_used():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    x0 = torch.randn(5, 3)  # as in _forward_then_update
    model(x0).square().sum().backward()
    expected = [p.grad for p in model.parameters()]

    two = _forward_then_update(WeightVersions)
    assert all(torch.equal(g, e) for g, e in zip(two, expected, strict=True))
    one = _forward_then_update(_OneVersion)
    assert not all(torch.allclose(g, e) for g, e in zip(one, expected, strict=True))


def test_depths():
    """Depths fall by the hop per stage; the hop covers a round trip plus a microbatch's compute
    in bottleneck slots; the first stage's depth stays below the microbatches per step."""
    assert stage_depths(4, 2) == [6, 4, 2, 0]
    assert hop_depth(0.05, 0.001, 0.02, 0.04, slot_s=0.06) == 3  # (0.102 + 0.06) / 0.06 = 2.7
    assert hop_depth(0.0, 0.0, 0.02, 0.04, slot_s=0.06) == 1
    assert max_hop_depth(8, 16) == 2 and max_hop_depth(2, 4) == 3 and max_hop_depth(4, 3) == 0


@pytest.fixture(scope="module")
def async_runs(tmp_path_factory, seed_checkpoint):
    """``(emulated, pipelined, folder)``: the records of 6 async steps of the tiny model from
    ``seed_checkpoint(2)`` in one process and in 2 pipeline stages, with a validation after steps
    1, 3 and 6 and a checkpoint after steps 3 and 6 (each a flush), weight prediction on."""
    folder = tmp_path_factory.mktemp("async")
    load = ["--checkpoint.enable", "--checkpoint.initial_load_path", str(seed_checkpoint(2)),
            *ASYNC, *FLUSH_AT_3, *PREDICT]  # fmt: skip
    emulated = torchrun(1, folder / "pp1", "--protocol.stages", "2", *load)
    pipelined = torchrun(2, folder / "pp2", *load)
    return emulated, pipelined, folder


def test_pipelined_async_equals_its_one_process_emulation(async_runs):
    """Same loss and same norm of the applied gradient at every step, and the same validation
    losses. Steps 1, 3 and 6 flush (they apply every pending gradient), so steps 2 and 4 apply
    none (logged norm 0) and step 5 applies step 4's gradient."""
    emulated, pipelined, folder = async_runs
    assert_same_run(emulated, pipelined, steps=list(range(1, 7)))
    # steps 2, 4 and 5 gathered their metrics rows without waiting: their records, written a
    # log step later, carry the pipeline's figures like the others
    for r in pipelined:
        assert r["wire/messages"] > 0 and "memory/peak_gib/s1" in r and "data/ids_checksum" in r
    assert [r["grad_norm"] == 0 for r in pipelined] == [False, True, False, True, False, False]
    validations = [read_jsonl(folder / run / "validation.jsonl") for run in ("pp1", "pp2")]
    assert [r["step"] for r in validations[1]] == [1, 3, 6]
    for a, b in zip(*validations, strict=True):  # the forward-only pass of an empty pipeline
        loss = "validation_metrics/loss"
        assert abs(a[loss] - b[loss]) <= 2e-6 * a[loss], (a, b)


def test_flush_checkpoint_resume_on_nccl_is_bit_exact(async_runs, tmp_path):
    """The checkpoint after the flush at step 3, resumed on 2 stages on the emulated NCCL backend
    (``NCCL_RULES``: single sends and pre-posted receives on a group per boundary and direction,
    the norms on connected pair communicators, and TorchTitan's device-wide wait after the
    resumed process's first step, which is no flush: it drains the pipeline without applying
    its gradient early), gives the gloo run's steps 4-6 bit for bit."""
    _, pipelined, folder = async_runs
    resumed_dump = tmp_path / "resumed"
    shutil.copytree(folder / "pp2" / "checkpoint" / "step-3",
                    resumed_dump / "checkpoint" / "step-3")  # fmt: skip
    resumed, output = torchrun(2, resumed_dump, "--checkpoint.enable", *ASYNC, *FLUSH_AT_3,
                               *PREDICT, env=NCCL_RULES, return_output=True)  # fmt: skip
    assert "Training starts at step 4" in output
    assert [r["step"] for r in resumed] == [4, 5, 6]
    for key in ("loss", "grad_norm"):
        assert [r[key] for r in resumed] == [r[key] for r in pipelined[3:]], key
