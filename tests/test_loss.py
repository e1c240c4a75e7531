"""The chunked cross-entropy (``[model] loss_chunk_tokens``) equals TorchTitan's loss on the full
logits, in value and gradients, in process and in real pipelined runs."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, read_jsonl, torchrun
from torch.distributed.device_mesh import init_device_mesh
from torchtitan.components.loss import IGNORE_INDEX, CrossEntropyLoss, cross_entropy_loss
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

from protocol_models.config.run_config import ConfigError, load_config
from protocol_models.model.loss import ModelLoss, chunked_cross_entropy
from protocol_models.model.model import ModelArch, build_model_config
from protocol_models.training.protocol import ProtocolSettings

MB, SEQ, DIM, VOCAB = 2, 13, 16, 50


def _problem(dtype: torch.dtype = torch.float32):
    """Normed hidden states ``[MB, SEQ, DIM]``, a head ``[VOCAB, DIM]`` and labels ``[MB, SEQ]``
    of which some are ``IGNORE_INDEX``."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(MB, SEQ, DIM, generator=g).to(dtype).requires_grad_()
    weight = torch.randn(VOCAB, DIM, generator=g).div(DIM**0.5).to(dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (MB, SEQ), generator=g)
    labels[0, :3] = IGNORE_INDEX
    labels[1, -2:] = IGNORE_INDEX
    return hidden, weight, labels


def _stock(hidden, weight, labels, scale):
    """TorchTitan's head + ``CrossEntropyLoss``: the summed loss divided by ``scale``."""
    loss, _ = CrossEntropyLoss(CrossEntropyLoss.Config())(hidden @ weight.T, labels, scale)
    return loss


def _value_and_grads(loss, hidden, weight):
    loss.backward()
    grads = (hidden.grad.clone(), weight.grad.clone())
    hidden.grad = weight.grad = None
    return loss.detach(), *grads


@pytest.mark.parametrize("chunk", [1, 5, 7, 13, 26, 100])
def test_chunked_loss_and_gradients_equal_full_logits(chunk):
    hidden, weight, labels = _problem()
    valid = (labels != IGNORE_INDEX).sum()
    expected = _value_and_grads(_stock(hidden, weight, labels, valid), hidden, weight)
    summed = chunked_cross_entropy(hidden, weight, labels, chunk)
    assert summed.dtype == torch.float32 and summed.shape == ()
    got = _value_and_grads(ModelLoss(ModelLoss.Config())(summed, labels, valid)[0], hidden, weight)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    assert got[1][0, :3].abs().max() == 0  # ignored tokens get no gradient


def test_bf16_gradients_match_full_logits_to_bf16_rounding():
    """Logits in bf16 and an fp32 loss, as under FSDP mixed precision; the head gradient is
    accumulated over chunks in fp32, so it stays within bf16 rounding of the stock one."""
    hidden, weight, labels = _problem(torch.bfloat16)
    expected = _value_and_grads(_stock(hidden, weight, labels, 7.0), hidden, weight)
    got = _value_and_grads(chunked_cross_entropy(hidden, weight, labels, 4) / 7.0, hidden, weight)
    assert [t.dtype for t in got] == [torch.float32, torch.bfloat16, torch.bfloat16]
    torch.testing.assert_close(got[0], expected[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[1], expected[1])
    torch.testing.assert_close(got[2], expected[2], rtol=2e-2, atol=1e-3)


def test_only_inputs_are_saved_for_backward():
    """Autograd keeps ``hidden``, ``weight`` and ``labels``; the stock path also keeps the fp32
    log-softmax ``[MB * SEQ, VOCAB]`` (and a pipeline schedule its logits output)."""
    hidden, weight, labels = _problem()

    def saved_bytes(fn) -> int:
        saved = {}

        def pack(t):
            saved[(t.data_ptr(), t.shape)] = t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn()
        return sum(saved.values())

    inputs = hidden.numel() * 4 + weight.numel() * 4 + labels.numel() * 8
    assert saved_bytes(lambda: chunked_cross_entropy(hidden, weight, labels, 4)) == inputs
    assert saved_bytes(lambda: _stock(hidden, weight, labels, 1)) > MB * SEQ * VOCAB * 4


def test_model_returns_the_summed_loss_of_its_logits():
    arch = ModelArch(dim=32, n_layers=2, n_heads=2, vocab_size=64)
    stock = build_model_config(arch, ProtocolSettings(mode="dense"), 1).build()
    arch.loss_chunk_tokens = 5
    chunked = build_model_config(arch, ProtocolSettings(mode="dense"), 1).build()
    torch.manual_seed(0)
    stock.init_weights()
    chunked.load_state_dict(stock.state_dict())
    ids = torch.randint(0, arch.vocab_size, (2, 9))
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    torch.testing.assert_close(chunked(ids, labels=labels), cross_entropy_loss(stock(ids), labels))
    with pytest.raises(ValueError, match="needs `labels`"):
        chunked(ids)


def test_negative_chunk_is_refused():
    with pytest.raises(ConfigError) as err:
        load_config(str(TINY), ["--model.loss_chunk_tokens", "-1"], check_environment=False)
    assert str(err.value) == "model.loss_chunk_tokens = -1: must be >= 0 (0 = full logits)"


@pytest.fixture
def one_process_group():
    """A 1-rank gloo group and its ``fsdp`` mesh: FSDP2 as TorchTitan applies it at DP = 1."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reshard", ["default", "always"])
def test_fsdp_bf16_gradients_match_full_logits(one_process_group, reshard):
    """Under TorchTitan's FSDP wrapping with a bf16 parameter policy the loss reads the unsharded
    bf16 head weight, and two backwards accumulate into every sharded fp32 gradient what the
    stock head does (``always``: the norm/head unit is resharded after the forward and
    unsharded again for the backward)."""
    arch = ModelArch(dim=32, n_layers=2, n_heads=2, vocab_size=64)
    ids = torch.randint(0, arch.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    labels = ids.roll(-1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    grads = []
    for chunk in (0, 5):
        arch.loss_chunk_tokens = chunk
        model = build_model_config(arch, ProtocolSettings(mode="dense"), 1).build()
        torch.manual_seed(0)
        model.init_weights()
        apply_fsdp_to_decoder(
            model, one_process_group, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
            pp_enabled=False, reshard_after_forward_policy=reshard,
        )  # fmt: skip
        for _ in range(2):
            loss = model(ids, labels=labels) if chunk else cross_entropy_loss(model(ids), labels)
            loss.backward()
        assert loss.dtype == torch.float32
        grads.append({n: p.grad.full_tensor() for n, p in model.named_parameters()})
    stock, chunked = grads
    assert stock.keys() == chunked.keys()
    for name, expected in stock.items():
        assert chunked[name].dtype == torch.float32
        scale = expected.abs().max()
        torch.testing.assert_close(
            chunked[name], expected, rtol=0, atol=1e-2 * scale, msg=lambda m, n=name: f"{n}: {m}"
        )


def _assert_close_runs(a: list[dict], b: list[dict], keys: tuple[str, ...], rtol: float):
    assert len(a) == len(b) > 0
    for ra, rb in zip(a, b, strict=True):
        for key in keys:
            assert abs(ra[key] - rb[key]) <= rtol * abs(ra[key]), (key, ra[key], rb[key])


VALIDATION = ["--validator.enable", "--validator.freq", "2", "--validator.steps", "2"]


def _run(nproc: int, folder, *overrides: str) -> tuple[list[dict], list[dict]]:
    """Training and validation records of a tiny run with validation at steps 1 and 2."""
    records = torchrun(nproc, folder, *VALIDATION, *overrides)
    return records, read_jsonl(folder / "validation.jsonl")


@pytest.fixture(scope="module")
def stock_pipelined(tmp_path_factory):
    return _run(2, tmp_path_factory.mktemp("stock"))


def test_pipelined_chunked_loss_equals_stock(tmp_path, stock_pipelined):
    """2-stage GPipe, 4 microbatches of 64 tokens, 16-token chunks: the same training losses,
    gradient norms and validation losses (schedule eval) as the stock head."""
    train, validation = _run(2, tmp_path, "--model.loss_chunk_tokens", "16")
    _assert_close_runs(stock_pipelined[0], train, ("loss", "grad_norm"), rtol=1e-5)
    _assert_close_runs(stock_pipelined[1], validation, ("validation_metrics/loss",), rtol=1e-5)


def test_pipelined_chunked_loss_in_bf16(tmp_path, stock_pipelined):
    """The same run with bf16 parameters (the exact bf16 comparison is the in-process FSDP test):
    it trains and validates, within bf16 rounding of the fp32 stock run."""
    train, validation = _run(
        2, tmp_path, "--model.loss_chunk_tokens", "16",
        "--training.mixed_precision_param", "bfloat16",
    )  # fmt: skip
    _assert_close_runs(stock_pipelined[0], train, ("loss",), rtol=1e-3)
    _assert_close_runs(stock_pipelined[1], validation, ("validation_metrics/loss",), rtol=1e-3)


def test_single_process_chunked_loss_equals_stock(tmp_path):
    """Without pipelining the Trainer and the Validator call the loss on the model's output."""
    stock = _run(1, tmp_path / "stock")
    chunked = _run(1, tmp_path / "chunked", "--model.loss_chunk_tokens", "16")
    _assert_close_runs(stock[0], chunked[0], ("loss", "grad_norm"), rtol=1e-5)
    _assert_close_runs(stock[1], chunked[1], ("validation_metrics/loss",), rtol=1e-5)
