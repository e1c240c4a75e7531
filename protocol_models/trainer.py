"""TorchTitan Trainer and Validator extensions for Protocol Models.

* The ``ModelSpec`` is derived from the config's ``[model]`` and ``[protocol]`` tables, with the
  plugin's pipelining function bound to this trainer's wire meter.
* Token ids reach every pipeline stage as the forward kwarg ``token_ids``: every rank of a
  pipeline group reads the same microbatches, so ids never cross the wire.
* With the causal ``sdpa`` backend, the dataloader's per-document ``positions`` are dropped so
  RoPE sees the same packed-sequence positions the causal mask uses.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.components.validate import Validator
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.trainer import Trainer

from protocol_models.codecs import LOSSY_MODES, CodecSettings, build_codec
from protocol_models.errors import StartupError
from protocol_models.grassmann import SubspaceTracker
from protocol_models.link import LinkSettings, SimulatedLink
from protocol_models.metrics import ProtocolMetricsProcessor
from protocol_models.model import ModelArch, ProtocolSettings, build_model_spec
from protocol_models.optimizers import bind_subspace
from protocol_models.pipeline import pipeline_protocol
from protocol_models.stage import WireMeter


def add_protocol_kwargs(
    inputs: torch.Tensor, extra_kwargs: dict[str, Any], model_config
) -> dict[str, Any]:
    """Forward kwargs every stage receives: the token ids ``[mb, seq]`` (and positions unless the
    attention is plain causal SDPA)."""
    extra_kwargs["token_ids"] = inputs
    inner = model_config.first_attention.inner_attention
    if isinstance(inner, ScaledDotProductAttention.Config):
        extra_kwargs.pop("positions", None)
    return extra_kwargs


@dataclass(kw_only=True, slots=True)
class HardwareSettings:
    """TOML table ``[hardware]``: what the planner checks a layout against."""

    gpu_memory_gib: float = 80.0
    """Memory of one accelerator; ``python -m protocol_models.plan`` fails if a stage needs more."""
    gpus_per_node: int = 8
    """Processes per node; the planner prints which nodes hold which pipeline stage."""


class ProtocolValidator(Validator):
    """TorchTitan's Validator, passing token ids to every stage."""

    @dataclass(kw_only=True, slots=True)
    class Config(Validator.Config):
        pass

    def post_dataloading_process(self, input_dict, labels, model_parts):
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels, model_parts)
        return inputs, labels, add_protocol_kwargs(inputs, extra, model_parts[0].config)


class ProtocolTrainer(Trainer):
    """TorchTitan's Trainer for a Protocol LLaMA; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        model: ModelArch = field(default_factory=ModelArch)
        protocol: ProtocolSettings = field(default_factory=ProtocolSettings)
        metrics: ProtocolMetricsProcessor.Config = field(
            default_factory=ProtocolMetricsProcessor.Config
        )
        validator: ProtocolValidator.Config = field(default_factory=ProtocolValidator.Config)
        wan: LinkSettings = field(default_factory=LinkSettings)
        hardware: HardwareSettings = field(default_factory=HardwareSettings)
        codec: CodecSettings = field(default_factory=CodecSettings)

        @property
        def layout_stages(self) -> int:
            """The pipeline layout the model is built for."""
            return self.protocol.stages or self.parallelism.pipeline_parallel_degree

    def __init__(self, config: Config):
        self.wire_meter = WireMeter(dim=config.model.dim)
        self.link = SimulatedLink(config.wan) if config.wan.enabled else None
        config.model_spec = build_model_spec(
            config.model,
            config.protocol,
            config.layout_stages,
            pipelining_fn=partial(
                pipeline_protocol,
                meter=self.wire_meter,
                link=self.link,
                codec=build_codec(
                    config.protocol.mode, config.codec, config.model.dim, config.protocol.seed
                ),
            ),
            codec=config.codec,
            microbatch=config.parallelism.pipeline_parallel_microbatch_size,
        )
        super().__init__(config)
        self.metrics_processor.wire_meter = self.wire_meter
        self.metrics_processor.link = self.link
        self.check_stages_agree()
        bind_subspace(self.optimizers, self.model_parts)
        protocol = config.protocol
        self.subspace_tracker = None
        if protocol.update_every > 0 and self.model_parts[0].subspace:
            self.subspace_tracker = SubspaceTracker(
                self.model_parts,
                self.optimizers,
                update_every=protocol.update_every,
                angle_deg=protocol.update_angle_deg,
                after_update=self.check_stages_agree,
            )
        self.optimizers.subspace = self.subspace_tracker
        self.metrics_processor.subspace = self.subspace_tracker
        self.table_digest = _digest(self.model_parts[0], ("token_table",))

    def check_stages_agree(self) -> None:
        """Every pipeline stage must hold the same subspace (U, F and their seed) and layout;
        a mismatch (e.g. two nodes launched with different [protocol] settings) would decode
        silently wrong activations, so it stops the run before step 1."""
        if not self.parallel_dims.pp_enabled:
            return
        mine = (
            protocol_identity(self.config),
            _digest(self.model_parts[0], ("basis", "token_table")).hex(),
        )
        group = self.parallel_dims.get_mesh("pp").get_group()
        everyone: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        if len(set(everyone)) > 1:
            stages = "; ".join(
                f"stage {i}: {identity}, U/F sha256 {h[:12]}"
                for i, (identity, h) in enumerate(everyone)
            )
            raise StartupError(
                f"pipeline stages disagree on the subspace ({stages}); every node must run "
                "the same [model] and [protocol] settings"
            )

    def state_dict(self) -> dict[str, Any]:
        """TorchTitan's train state plus the subspace's: a sha256 of F (regenerated from the
        seed, verified on load) and, with updates on, the update count and this rank's window
        sum of ``dL/dU`` (U itself is a model buffer)."""
        state = super().state_dict()
        if self.table_digest:
            state["subspace_table_sha256"] = torch.frombuffer(
                bytearray(self.table_digest), dtype=torch.uint8
            )
        if self.subspace_tracker is not None:
            state.update(self.subspace_tracker.state_dict(dist.get_rank()))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        stored = state_dict.get("subspace_table_sha256")
        if stored is not None and bytes(stored.tolist()) != self.table_digest:
            raise StartupError(
                f"checkpoint in {self.config.checkpoint.folder!r} was trained with a different "
                f"token table F than protocol.seed = {self.config.protocol.seed} generates "
                f"(sha256 {bytes(stored.tolist()).hex()[:12]} vs {self.table_digest.hex()[:12]});"
                " resume with the run's original [protocol] seed and [model] sizes"
            )
        if self.subspace_tracker is not None:
            self.subspace_tracker.load_state_dict(state_dict, dist.get_rank())

    def post_dataloading_process(self, input_dict, labels):
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        return inputs, labels, add_protocol_kwargs(inputs, extra, self.model_config)

    def train_step(self, data_iterator):
        self.optimizers.current_step = self.step
        self.wire_meter.reset()
        if self.link is not None:
            self.link.reset_counters()
        for part in self.model_parts:
            part.pop_boundary_leak()
        super().train_step(data_iterator)


def _digest(model: torch.nn.Module, names: tuple[str, ...]) -> bytes:
    """sha256 of this stage's named buffers (b"" in dense mode, where there are none)."""
    buffers = [getattr(model, name, None) for name in names]
    if all(b is None for b in buffers):
        return b""
    digest = hashlib.sha256()
    for buffer in buffers:
        if buffer is not None:
            digest.update(buffer.detach().cpu().float().contiguous().numpy().tobytes())
    return digest.digest()


def protocol_identity(config: ProtocolTrainer.Config) -> str:
    """What every pipeline stage must share to decode its neighbours' messages, as the text a
    mismatch error shows: the subspace (mode, k, seed, width) and, in a lossy mode, the codec
    settings (they fix the payload shapes and the backward)."""
    protocol = config.protocol
    identity = f"mode={protocol.mode}, k={protocol.k}, seed={protocol.seed}, dim={config.model.dim}"
    if protocol.mode in LOSSY_MODES:
        identity += f", codec {config.codec}"
    return identity
