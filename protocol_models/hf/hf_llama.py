"""The Hugging Face LLaMA layout: ``config.json``, parameter names, rotary order, safetensors.

* **Names and rotary order**: TorchTitan's own llama3 ``StateDictAdapter.to_hf``. TorchTitan's
  ``ComplexRoPE`` rotates the pairs ``(2i, 2i+1)`` of each head's query/key features as complex
  numbers; HF's ``rotate_half`` rotates ``(i, i + head_dim/2)``. The adapter permutes the rows of
  ``wq``/``wk`` within each head (evens first, then odds), so both compute the same scores.
* **config.json**: the true architecture, read off the built model config (RMSNorm eps, rope
  theta and scaling, kv heads, SwiGLU width) -- never TorchTitan's or HF's defaults.
* **Shards**: safetensors files of at most ``max_shard_bytes``, written as the groups arrive,
  plus ``model.safetensors.index.json`` when there is more than one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

from protocol_models.data.assets import OPTIONAL, REQUIRED
from protocol_models.model.model import ProtocolModel
from protocol_models.tools.errors import UserError

TOKENIZER_FILES = (REQUIRED, *OPTIONAL)
DEFAULT_SHARD_BYTES = 5 * 1024**3
"""Hugging Face's default shard size (5 GB)."""


def to_hf(model_config: ProtocolModel.Config, group: dict[str, torch.Tensor]):
    """TorchTitan-named dense tensors -> HF-named ones (``wq``/``wk`` rows permuted)."""
    return Llama3StateDictAdapter(model_config, None).to_hf(group)


def rope_scaling(rope) -> dict | None:
    """HF's ``rope_scaling`` for a TorchTitan ``ComplexRoPE.Config`` (None: plain RoPE)."""
    if rope.scaling == "none":
        return None
    if rope.scaling == "llama":
        return {
            "rope_type": "llama3",
            "factor": rope.scaling_factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    raise UserError(f"rope scaling {rope.scaling!r} has no Hugging Face LLaMA equivalent here")


def hf_config(
    model_config: ProtocolModel.Config,
    *,
    context: int,
    dtype: torch.dtype,
    special_ids: dict[str, int],
    init_std: float,
) -> dict:
    """``config.json`` of the dense LLaMA (``context``: the sequence length it was trained on;
    ``special_ids``: ``bos_token_id``/``eos_token_id`` where the tokenizer names them)."""
    block = model_config.layers[0]
    attention = block.attention
    head_dim = attention.head_dim or model_config.dim // attention.n_heads
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": model_config.dim,
        "intermediate_size": block.feed_forward.w1.out_features,
        "num_hidden_layers": len(model_config.layers),
        "num_attention_heads": attention.n_heads,
        "num_key_value_heads": attention.n_kv_heads or attention.n_heads,
        "head_dim": head_dim,
        "vocab_size": model_config.vocab_size,
        "hidden_act": "silu",
        "rms_norm_eps": block.attention_norm.eps,
        "rope_theta": attention.rope.theta,
        "rope_scaling": rope_scaling(attention.rope),
        "max_position_embeddings": context,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": init_std,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **special_ids,
    }


def copy_tokenizer(assets: Path, dest: Path) -> dict[str, int]:
    """Copy the run's tokenizer files into ``dest``; return ``{bos,eos}_token_id`` for the
    special tokens its ``tokenizer_config.json`` names."""
    if not (assets / REQUIRED).is_file():
        raise UserError(f"the run's tokenizer {assets / REQUIRED} is missing")
    for name in TOKENIZER_FILES:
        if (assets / name).is_file():
            shutil.copy2(assets / name, dest / name)
    settings_path = assets / OPTIONAL[0]
    settings = json.loads(settings_path.read_text()) if settings_path.is_file() else {}
    tokenizer = Tokenizer.from_file(str(assets / REQUIRED))
    ids = {}
    for role in ("bos", "eos"):
        token = settings.get(f"{role}_token")
        token = token.get("content") if isinstance(token, dict) else token
        if token is not None and tokenizer.token_to_id(token) is not None:
            ids[f"{role}_token_id"] = tokenizer.token_to_id(token)
    return ids


class ShardWriter:
    """Writes HF-named tensors into safetensors shards in ``folder`` as they arrive.

    Shards are named ``model-0000i-of-0000n.safetensors`` (or ``model.safetensors`` when there
    is one) once ``close`` knows ``n``; only the current shard is held in memory."""

    def __init__(self, folder: Path, dtype: torch.dtype, max_shard_bytes: int):
        self.folder, self.dtype, self.max_shard_bytes = folder, dtype, max_shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, tensor in tensors.items():
            tensor = tensor.to(self.dtype).contiguous()
            size = tensor.numel() * tensor.element_size()
            if self.pending and self.pending_bytes + size > self.max_shard_bytes:
                self._flush()
            self.pending[name] = tensor
            self.pending_bytes += size
            self.total_bytes += size

    def _flush(self) -> None:
        save_file(self.pending, self.folder / f"shard-{len(self.shards)}.tmp", {"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, name the shards, write the index; return the file names."""
        if self.pending:
            self._flush()
        n = len(self.shards)
        names = (
            ["model.safetensors"]
            if n == 1
            else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        )
        for i, name in enumerate(names):
            (self.folder / f"shard-{i}.tmp").rename(self.folder / name)
        if n > 1:
            index = {
                "metadata": {"total_size": self.total_bytes},
                "weight_map": {
                    tensor: name
                    for name, shard in zip(names, self.shards, strict=True)
                    for tensor in shard
                },
            }
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        return names
