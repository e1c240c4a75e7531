"""Error accumulation with depth (paper claim C4, Theorem B.1), on trained checkpoints.

The trained dense model runs a held-out validation batch twice: clean, and with a lossy codec
inserted after **every** layer (``decode(encode(x))`` at each of the ``n_layers - 1`` layer
boundaries). At each boundary ``l`` the relative error of the residual stream
``||x̂_l - x_l|| / ||x_l||`` is recorded, plus the final loss with the codecs in place. The
control is the trained subspace model with its exact codec (``c = (x - F[ids]) U``, rebuilt as
``F[ids] + c U^T``) after every layer of its constrained range.

Used by ``recipes/compare.py`` (results in ``results/compare/results.json`` under
``error_vs_depth`` and ``results/compare/error_vs_depth.png``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

from protocol_models.config.run_config import load_config
from protocol_models.model import subspace
from protocol_models.model.layout import stage_layer_ranges
from protocol_models.model.model import build_model_config
from protocol_models.wire.codecs import CodecSettings, build_codec
from recipes.common import repo_relative

CODECS = {  # name -> (mode, [codec] settings), at ~8x and ~32x like the training study
    "topk K=21 (8x)": ("topk", CodecSettings(topk=21)),
    "quant int4 (8x)": ("quant", CodecSettings(bits=4)),
    "lowrank k=32 (8x)": ("lowrank", CodecSettings(rank=32)),
    "svd r=21 (8x)": ("svd", CodecSettings(rank=21)),
    "topk K=5 (32x)": ("topk", CodecSettings(topk=5)),
    "quant int2 (15x)": ("quant", CodecSettings(bits=2)),
    "lowrank k=8 (32x)": ("lowrank", CodecSettings(rank=8)),
    "svd r=5 (32x)": ("svd", CodecSettings(rank=5)),
}
QUICK_CODECS = {
    "topk K=3": ("topk", CodecSettings(topk=3)),
    "quant int2": ("quant", CodecSettings(bits=2)),
    "lowrank k=4": ("lowrank", CodecSettings(rank=4)),
    "svd r=2": ("svd", CodecSettings(rank=2)),
}


def load_model(toml: Path, overrides: list[str], folder: Path) -> tuple[torch.nn.Module, dict]:
    """The run's model (4-stage layout, fp32, CPU) with the weights of its final checkpoint."""
    config = load_config(str(toml), overrides, check_environment=False)
    stages = config.layout_stages
    with torch.device("meta"):
        model = build_model_config(config.model, config.protocol, stages).build()
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_states(buffer_device=torch.device("cpu"))
    checkpoint = max((folder / "checkpoint").glob("step-*"), key=lambda p: int(p.name[5:]))
    saved = dcp.FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    state = {name: t for name, t in model.state_dict().items() if name in saved}
    missing = set(model.state_dict()) - set(state)
    # runs from before U became persistent lack "basis": it is the seeded one init built
    assert missing <= {"basis"}, f"{checkpoint} lacks {sorted(missing)}"
    dcp.load(state, checkpoint_id=str(checkpoint))
    model.load_state_dict(state, strict=False)
    model.eval()
    info = {
        "checkpoint": repo_relative(checkpoint),
        "microbatch": config.parallelism.pipeline_parallel_microbatch_size,
        "seq_len": config.training.seq_len,
        "stages": stages,
        "protocol_seed": config.protocol.seed,
        "ranges": stage_layer_ranges(config.model.n_layers, stages),
    }
    return model, info


def validation_batch(seq_len: int, sequences: int) -> torch.Tensor:
    """The first ``sequences x (seq_len + 1)`` tokens of the held-out split (documents joined
    with BOS/EOS, as the training loader packs them): inputs ``[sequences, seq_len]``."""
    from tokenizers import Tokenizer

    from protocol_models.data.prepared import BOS, EOS
    from protocol_models.data.shakespeare import DEFAULT_CACHE

    cache = Path(__file__).resolve().parents[1] / DEFAULT_CACHE
    tokenizer = Tokenizer.from_file(str(cache / "tokenizer" / "tokenizer.json"))
    ids: list[int] = []
    with open(cache / "validation.jsonl") as f:
        for line in f:
            ids += tokenizer.encode(BOS + json.loads(line)["text"] + EOS).ids
            if len(ids) > sequences * (seq_len + 1):
                break
    flat = torch.tensor(ids[: sequences * (seq_len + 1)])
    return flat.view(sequences, seq_len + 1)


@torch.no_grad()
def run_stream(model, tokens: torch.Tensor, microbatch: int, boundary=None, after=()):
    """Residual stream after every layer ``[n_layers]`` of ``[B, seq, d]`` and the mean loss,
    with ``boundary(h, ids)`` applied (per microbatch) after the layers in ``after``."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    streams, losses = [], []
    for ids, target in zip(inputs.split(microbatch), labels.split(microbatch), strict=True):
        h = model._stream_in(ids, ids)
        basis = model.basis if getattr(model, "factored", False) else None
        per_layer = []
        for name, layer in model.layers.items():
            h = layer(h, None, None, basis=basis)
            if int(name) in after:
                h = boundary(h, ids)
            per_layer.append(h)
        streams.append(per_layer)
        logits = model.lm_head(model.norm(h))
        losses.append(F.cross_entropy(logits.flatten(0, 1).float(), target.flatten()))
    layers = [torch.cat(parts) for parts in zip(*streams, strict=True)]
    return layers, float(torch.stack(losses).mean())


def relative_errors(noisy: list[torch.Tensor], clean: list[torch.Tensor]) -> list[float]:
    return [float((a - b).norm() / b.norm()) for a, b in zip(noisy, clean, strict=True)]


def error_vs_depth(
    toml: Path, quick_over: list[str], dense_folder: Path, subspace_folder: Path, quick: bool
) -> dict:
    """Relative stream error after each layer for every codec (dense checkpoint) and for the
    exact subspace codec (subspace checkpoint); see the module docstring."""
    torch.manual_seed(0)
    config_over = [*quick_over, "--parallelism.pipeline_parallel_degree", "1"]
    model, info = load_model(toml, [*config_over, "--protocol.mode", "dense"], dense_folder)
    mb, sequences = info["microbatch"], 2 if quick else 8
    tokens = validation_batch(info["seq_len"], sequences)
    every = range(len(model.layers) - 1)
    clean, clean_loss = run_stream(model, tokens, mb)
    out = {
        "tokens": tokens.numel() - sequences,
        "checkpoint_dense": info["checkpoint"],
        "dense_loss": clean_loss,
        "codecs": {},
    }
    for name, (mode, settings) in (QUICK_CODECS if quick else CODECS).items():
        codec = build_codec(mode, settings, model.config.dim, info["protocol_seed"])

        def boundary(h, ids, codec=codec):
            return codec.decode(codec.encode(h), h.shape)

        noisy, loss = run_stream(model, tokens, mb, boundary, set(every))
        out["codecs"][name] = {
            "after_layer": list(every),
            "rel_error": relative_errors(noisy, clean)[: len(every)],
            "loss_with_codec_every_layer": loss,
        }
    model, info = load_model(toml, config_over, subspace_folder)
    constrained = [layer for r in info["ranges"][:-1] for layer in r]
    u, table = model.basis.detach(), model.token_table

    def exact(h, ids):
        return subspace.decode(subspace.encode(h, ids, u, table), ids, u, table)

    clean, clean_loss = run_stream(model, tokens, mb)
    noisy, loss = run_stream(model, tokens, mb, exact, set(constrained))
    out["subspace_control"] = {
        "checkpoint": info["checkpoint"],
        "after_layer": constrained,
        "rel_error": relative_errors(noisy, clean)[: len(constrained)],
        "loss": clean_loss,
        "loss_with_codec_every_layer": loss,
    }
    return out


def plot_error(results: dict, path: Path, suffix: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, e in results["codecs"].items():
        style = "--" if "(8x)" in name else "-"
        ax.plot([i + 1 for i in e["after_layer"]], e["rel_error"], style, marker="o", label=name)
    control = results["subspace_control"]
    ax.plot([i + 1 for i in control["after_layer"]], control["rel_error"], "k-", marker="s",
            lw=2, label="subspace (exact, trained subspace model)")  # fmt: skip
    ax.set_yscale("log")
    ax.set_xlabel("boundary after layer l (codec inserted after every layer up to l)")
    ax.set_ylabel("||x̂_l - x_l|| / ||x_l||")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    ax.set_title(f"Relative stream error vs depth{suffix}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
