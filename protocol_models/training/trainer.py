"""TorchTitan's Trainer for Protocol Models: it builds the run's wire and model spec, checks at
start-up that the stages agree and where they run, and trains with the plugin's step.

* The ``ModelSpec`` is derived from the config's ``[model]`` and ``[protocol]`` tables. The
  trainer owns the run's ``Wire`` (meter, codec, link: built once) and hands it at construction
  to the pipelining and parallelize functions the spec carries; the metrics processor reads it.
* ``ModelSpec.post_optimizer_build_fn`` (``training.optimizer_hook``) binds the subspace
  optimizers to the model and, with ``[protocol] update_every``, gives the optimizer container
  its ``SubspaceTracker``.
* Its collaborators live in rooms of their own: the step and its clipping (``training.step``),
  the stage kwargs (``training.stage_kwargs``), the validator (``training.validator``), the
  ``[hardware]`` table and MFU peak (``training.hardware``), the placement check
  (``training.placement``) and what the stages must agree on (``training.stage_identity``).
* Token ids reach every pipeline stage as the forward kwarg ``token_ids``: every rank of a
  pipeline group reads the same microbatches, so ids never cross the wire (a checksum of them is
  compared across the stages at every log step).
* With the causal ``sdpa`` backend, the dataloader's per-document ``positions`` are dropped so
  RoPE sees the same packed-sequence positions the causal mask uses.
* With ``[model] loss_chunk_tokens``, the labels reach every stage as the kwarg ``labels``; the
  last stage returns the summed loss and ``ModelLoss`` normalizes it
  (``protocol_models.model.loss``).
* With ``[parallelism] pipeline_parallel_schedule = "Async1F1B"`` every step applies the previous
  step's gradient (``training.delayed``); the trainer tells the schedule and the rule which steps
  flush (``flush_after_step``), and the logged ``grad_norm`` is that of the update applied.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.distributed import ParallelDims
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from protocol_models.data.loader import TextDataLoader
from protocol_models.model.loss import ModelLoss
from protocol_models.model.model import ModelArch, build_model_spec
from protocol_models.tools import gather, nccl_rules
from protocol_models.tools.errors import StartupError, as_link_fault
from protocol_models.training import run_record
from protocol_models.training.console import Progress
from protocol_models.training.delayed import DelayedUpdates
from protocol_models.training.grassmann import SubspaceTracker
from protocol_models.training.hardware import HardwareSettings
from protocol_models.training.metrics import ProtocolMetricsProcessor
from protocol_models.training.optimizer_hook import after_optimizers_built
from protocol_models.training.placement import (
    RankPlace,
    describe_placement,
    interleaved_regions,
    placement_problem,
)
from protocol_models.training.protocol import ProtocolSettings
from protocol_models.training.stage_identity import protocol_identity, subspace_digest
from protocol_models.training.stage_kwargs import add_protocol_kwargs
from protocol_models.training.stall_watch import StallWatch
from protocol_models.training.step import StepClipping, optimizer_step
from protocol_models.training.validator import ProtocolValidator
from protocol_models.wire import Wire
from protocol_models.wire.async_schedule import ASYNC_SCHEDULE
from protocol_models.wire.boundary_groups import follows_nccl
from protocol_models.wire.codecs import CodecSettings
from protocol_models.wire.link import LinkSettings
from protocol_models.wire.norm_exchange import NormExchange
from protocol_models.wire.pipeline import parallelize_protocol, pipeline_protocol
from protocol_models.wire.stage import Waiting
from protocol_models.wire.transport import TransportSettings


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
        transport: TransportSettings = field(default_factory=TransportSettings)
        hardware: HardwareSettings = field(default_factory=HardwareSettings)
        codec: CodecSettings = field(default_factory=CodecSettings)
        dataloader: TextDataLoader.Config = field(default_factory=TextDataLoader.Config)
        hf_assets_repo: str = ""
        """The Hub repository the tokenizer in ``hf_assets_path`` comes from; a missing
        tokenizer is refused with the command that fetches it
        (``python -m protocol_models.assets``)."""

        @property
        def layout_stages(self) -> int:
            """The pipeline layout the model is built for."""
            return self.protocol.stages or self.parallelism.pipeline_parallel_degree

        @property
        def replicas(self) -> int:
            """Data-parallel ranks per pipeline stage (replicated x FSDP-sharded); they share
            their stage's boundary links."""
            par = self.parallelism
            return par.data_parallel_replicate_degree * max(par.data_parallel_shard_degree, 1)

        @property
        def world_size(self) -> int:
            """Processes the run needs: pipeline stages x data-parallel ranks x tensor-parallel."""
            par = self.parallelism
            return par.pipeline_parallel_degree * self.replicas * par.tensor_parallel_degree

    def __init__(self, config: Config):
        self.wire = Wire.from_config(config)
        config.model_spec = build_model_spec(
            config.model,
            config.protocol,
            config.layout_stages,
            pipelining_fn=partial(pipeline_protocol, wire=self.wire),
            parallelize_fn=partial(
                parallelize_protocol,
                wire=self.wire,
                n_stages=config.layout_stages,
                microbatch=config.parallelism.pipeline_parallel_microbatch_size,
            ),
            post_optimizer_build_fn=partial(
                after_optimizers_built,
                protocol=config.protocol,
                meter=self.wire.meter,
                timeout=init_timeout(config),
            ),
        )
        if config.model.loss_chunk_tokens:
            config.loss = ModelLoss.Config()
        self.progress = Progress(config.training.steps)
        super().__init__(config)
        run_record.write(config)  # what export needs to read the checkpoints
        self.metrics_processor.wire = self.wire  # as TorchTitan hands it optimizers, model_parts
        self.check_stages_agree()
        self.table_digest = self.model_parts[0].table_sha256
        self.basis_digest = self.model_parts[0].initial_basis_sha256
        self.norm_exchange = None
        self._step_losses: list[torch.Tensor] = []
        """This step's losses, one per gradient-accumulation step (``forward_backward_step``)."""
        dims = self.parallel_dims
        if dims.pp_enabled and not dims.ep_enabled and config.transport.exchange_grad_norm:
            group = self.parallel_dims.get_mesh("pp").get_group()
            ranks = dist.get_process_group_ranks(group)
            asynchronous = config.parallelism.pipeline_parallel_schedule == ASYNC_SCHEDULE
            self.norm_exchange = NormExchange(ranks, self.device, self.wire.meter, self.wire.link,
                                              timeout=init_timeout(config),
                                              nccl=follows_nccl(group),
                                              asynchronous=asynchronous)  # fmt: skip
        self._steps_run = 0
        """Steps this process has trained (a resumed run starts again at 0)."""
        self.delayed = self._delayed_updates()
        self.stall_watch = self._stall_watch()

    def _stall_watch(self) -> StallWatch | None:
        """The bound on a training step of a multi-process run (``training.stall_watch``;
        None: ``[transport] stall_bound_steps = 0`` or one process)."""
        transport = self.config.transport
        if transport.stall_bound_steps <= 0 or self.parallel_dims.world_size == 1:
            return None
        places = self.places

        def where(rank: int) -> str:
            place = places[rank]
            return f"rank {rank}, node {place.node}, host {place.host}"

        def pending() -> list[Waiting]:
            norm = self.norm_exchange.waiting() if self.norm_exchange is not None else []
            return [w for stage in self.wire.stages for w in stage.waiting()] + norm

        return StallWatch(transport.stall_bound_steps, transport.stall_bound_floor_seconds,
                          pending, where)  # fmt: skip

    def _delayed_updates(self) -> DelayedUpdates | None:
        """The delayed update rule of an ``Async1F1B`` run (None: synchronous), given to the
        optimizer container and, pipelined, fed by the schedule's ``gradients_ready``."""
        if self.config.parallelism.pipeline_parallel_schedule != ASYNC_SCHEDULE:
            return None
        params = [p for m in self.model_parts for p in m.parameters()]
        predict = self.config.optimizer.weight_prediction
        if self.parallel_dims.pp_enabled:
            (stage,) = self.wire.stages
            delayed = DelayedUpdates(params, versions=stage.versions, exchange=self.norm_exchange,
                                     predict=predict)  # fmt: skip
            self.pp_schedule.gradients_ready = delayed.gradients_ready
            schedule = self.pp_schedule
            logger.info(
                f"Async1F1B: hop depth {schedule.hop}, this stage's backwards trail its forwards "
                f"by {schedule.depth} microbatches; each step applies the previous step's gradient"
            )
        else:
            keep = self.config.optimizer.delay_compensation > 0
            delayed = DelayedUpdates(params, keep_weights=keep, predict=predict)
            logger.info(
                "Async1F1B emulated in one process: each step applies the previous step's gradient"
            )
        self.optimizers.delayed = delayed
        return delayed

    @property
    def subspace_tracker(self) -> SubspaceTracker | None:
        """The optimizer container's subspace updates (None: U stays fixed)."""
        return self.optimizers.subspace

    def check_stages_agree(self) -> None:
        """Every rank, every pipeline stage and every data-parallel replica of one, must hold
        the same subspace (U, F and their seed, or the same ``basis_file`` contents) and layout;
        a mismatch (e.g. two nodes launched with different [protocol] settings or basis files)
        would decode silently wrong activations, or average the gradients of different models,
        so it stops the run before step 1 (one gather over the world, at start-up)."""
        dims = self.parallel_dims
        if not dims.pp_enabled:
            return
        mine = (protocol_identity(self.config), subspace_digest(self.model_parts[0]))
        everyone = gather.all_gather_json((dims.get_mesh("pp").get_local_rank(), *mine))
        holders: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for rank, (stage, *held) in enumerate(everyone):
            holders.setdefault(tuple(held), []).append((rank, stage))
        if len(holders) > 1:
            views = "; ".join(
                f"stage(s) {sorted({s for _, s in who})} on rank(s) {[r for r, _ in who]}: "
                f"{identity}, U/F sha256 {h[:12]}"
                for (identity, h), who in holders.items()
            )
            raise StartupError(
                f"pipeline stages disagree on the subspace ({views}); every node must run "
                "the same [model] and [protocol] settings, with the same protocol.basis_file "
                "contents"
            )

    def init_distributed(self) -> ParallelDims:
        """TorchTitan's process group and parallel dims, every mesh group given the init
        timeout, then ``check_placement`` (before any model is built).

        TorchTitan creates the world group with ``[comm] init_timeout_seconds`` but the mesh's
        groups with the backend's default (NCCL: 10 min), and sets every group to
        ``train_timeout_seconds`` only after this process's first step. That first step holds
        the pipeline's metadata inference, which runs the stages one after another -- each
        one's cold compile (flex attention at max-autotune: minutes) while the others wait in a
        receive -- so until it ends every group, the plugin's own included
        (``plugin_groups``), gets the init timeout; then the train timeout (``train_step``)."""
        if nccl_rules.enabled():  # the CPU test of the NCCL path: its backend, not gloo
            nccl_rules.init_process_group(init_timeout(self.config))
        parallel_dims = super().init_distributed()
        if dist.is_initialized():
            for mesh in parallel_dims.get_all_one_dimensional_meshes().values():
                dist.set_timeout(init_timeout(self.config), mesh.get_group())
        self.check_placement(parallel_dims)
        return parallel_dims

    def plugin_groups(self) -> list[dist.ProcessGroup]:
        """The process groups the plugin creates (the gradient-norm exchange's, MAPL's boundary
        sync's, the stages' boundary groups on NCCL): TorchTitan's timeout changes do not reach
        them."""
        groups = self.norm_exchange.groups if self.norm_exchange is not None else []
        for stage in self.wire.stages:
            if stage.boundary_groups is not None:
                groups = groups + stage.boundary_groups.all()
        sync = self.optimizers.boundary_sync
        return groups + ([sync.group] if sync is not None and sync.group is not None else [])

    def check_placement(self, dims: ParallelDims) -> None:
        """Every rank logs where it runs; a stage whose data-parallel group (the ranks that hold
        the same pipeline stage: FSDP, replicate and any other non-pipeline mesh axis) spans two
        regions would send its all-gathers and reduce-scatters over a slow link every step, so it
        stops the run at start-up. A rank's region is ``$REGION``, else its host name. Node 0's
        last local rank (the one ``scripts/train.sh`` shows by default) prints the placement.
        (Called by TorchTitan's ``__init__`` through ``init_distributed``.)"""
        if not dist.is_initialized():
            return
        mine = RankPlace(
            region=os.environ.get("REGION") or socket.gethostname(),
            labelled=bool(os.environ.get("REGION")),
            host=socket.gethostname(),
            node=int(os.environ.get("GROUP_RANK", "0")),
            stage=dims.get_mesh("pp").get_local_rank() if dims.pp_enabled else 0,
        )
        everyone = [RankPlace(*place) for place in gather.all_gather_json(mine)]
        self.places: list[RankPlace] = everyone
        rank = dist.get_rank()
        where = f"REGION={mine.region}" if mine.labelled else "REGION unset"
        logger.info(
            f"rank {rank}/{len(everyone)} on node {mine.node} (host {mine.host}, {where}) holds "
            f"pipeline stage {mine.stage} of {dims.pp}"
        )
        if rank == int(os.environ.get("LOCAL_WORLD_SIZE", "1")) - 1:
            logger.info(f"placement: {describe_placement(everyone)}")
            interleaved = interleaved_regions(everyone)
            if interleaved is not None:
                logger.warning(f"placement: {interleaved}")
        problem = placement_problem(everyone)
        if problem:
            raise StartupError(problem)

    def state_dict(self) -> dict[str, Any]:
        """TorchTitan's train state plus the subspace's: a sha256 of F (regenerated from the
        seed, verified on load), one of U as the run started (seeded or from ``basis_file``:
        a resume from another one is refused) and, with updates on, the update count and this
        rank's window sum of ``dL/dU`` (U itself is a model buffer)."""
        state = super().state_dict()
        if self.table_digest:
            state["subspace_table_sha256"] = torch.frombuffer(
                bytearray(self.table_digest), dtype=torch.uint8
            )
            state["subspace_initial_basis_sha256"] = torch.frombuffer(
                bytearray(self.basis_digest), dtype=torch.uint8
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
        initial = state_dict.get("subspace_initial_basis_sha256")
        if initial is not None and bytes(initial.tolist()) != self.basis_digest:
            source = self.config.protocol.basis_file or "'' (the seeded U)"
            stored = bytes(initial.tolist()).hex()[:12]
            raise StartupError(
                f"checkpoint in {self.config.checkpoint.folder!r} was trained from another U than "
                f"protocol.basis_file = {source} gives (sha256 {stored} vs "
                f"{self.basis_digest.hex()[:12]}); resume with the basis the run started from"
            )
        if self.subspace_tracker is not None:
            self.subspace_tracker.load_state_dict(state_dict, dist.get_rank())

    def post_dataloading_process(self, input_dict, labels):
        inputs, labels, extra = super().post_dataloading_process(input_dict, labels)
        self.metrics_processor.ids_checksum.add(inputs)
        return inputs, labels, add_protocol_kwargs(inputs, labels, extra, self.model_config)

    def forward_backward_step(self, **kwargs) -> torch.Tensor:
        loss = super().forward_backward_step(**kwargs)
        self._step_losses.append(loss.detach().clone())  # a CUDA graph's replay reuses it
        return loss

    def train_step(self, data_iterator):
        if self.stall_watch is not None:
            self.stall_watch.step_begins(self.step)
        self.progress.begin(self.step)
        self.optimizers.current_step = self.step
        self.wire.meter.reset()
        if self.wire.link is not None:
            self.wire.link.reset_counters()
        measure = self.metrics_processor.should_log(self.step)
        for part in self.model_parts:
            part.start_leak_window(measure)
        self._step_losses = []
        flush = True
        if self.delayed is not None:
            flush = self.flush_after_step()
            self.delayed.begin(self.step, flush)
            if self.parallel_dims.pp_enabled:  # TorchTitan waits for the device after step 1
                self.pp_schedule.begin(self.step, flush, drain=flush or self._steps_run == 0)
        # Async1F1B: a log step between flushes gathers its rows without stopping the pipeline
        self.metrics_processor.gather_later = not flush and self.parallel_dims.pp_enabled
        rows = measure and self._rows_travel_with_norm()
        clip = StepClipping(
            optimizers=self.optimizers,
            exchange=self.norm_exchange,
            wire=self.wire,
            metrics=self.metrics_processor,
            delayed=self.delayed,
            schedule_done=self._post_next_step if self._training_step_follows() else None,
            metrics_row=self._metrics_row if rows else None,
        )
        clip.begin()
        try:
            optimizer_step(self, data_iterator, clip)
        except RuntimeError as e:  # a send, a collective: a peer's connection closed or broke
            fault = as_link_fault(e, f"step {self.step}: a message to or from another rank")
            if fault is None:
                raise
            raise fault from e
        finally:
            clip.end()
        if flush:  # every record written before a validation's, a checkpoint, the end
            self.metrics_processor.finish_record()
        if self.stall_watch is not None:
            self.stall_watch.step_ends()
        self._steps_run += 1
        if self._steps_run == 1:  # as TorchTitan does for its groups after this step
            train = timedelta(seconds=self.config.comm.train_timeout_seconds)
            for group in self.plugin_groups():
                dist.set_timeout(train, group)
        if measure:
            logger.info(self.progress.line(self.step))

    def close(self) -> None:
        if self.stall_watch is not None:
            self.stall_watch.close()
        super().close()

    def flush_after_step(self) -> bool:
        """Whether the asynchronous pipeline drains in this step and applies every pending
        gradient: a checkpoint is saved after it (``[checkpoint]``, as TorchTitan decides), or no
        training step surely follows (the last step, a validation)."""
        ckpt, step = self.config.checkpoint, self.step
        saves = ckpt.enable and not ckpt.load_only and (
            step % ckpt.interval == 0 or (step == 1 and ckpt.enable_first_step_checkpoint)
        )
        return saves or not self._training_step_follows()

    def _training_step_follows(self) -> bool:
        """Whether the next schedule step of this run is surely another training step: not the
        last step, no validation after this one, and data that cannot run out (a step that
        finds none is cancelled before its forward)."""
        validator = self.config.validator
        return (
            self.step < self.config.training.steps
            and not (validator.enable and self.validator.should_validate(self.step))
            and self.config.dataloader.infinite
        )

    def _post_next_step(self) -> None:
        """This step's schedule is done: every stage posts the next step's forward receives now,
        so that each is posted before its sender sends (``WirePipelineStage.post_next_forward``)."""
        for stage in self.wire.stages:
            stage.post_next_forward()

    def _rows_travel_with_norm(self) -> bool:
        """Whether a log step's metrics rows ride on the gradient-norm exchange: it runs, the
        logged loss is the last stage's own (no data-parallel or context-parallel reduction),
        and nothing the row counts happens after it (MAPL's boundary sync, in the optimizer
        step, meters its bytes)."""
        return (
            self.norm_exchange is not None
            and self.delayed is None
            and not self.parallel_dims.dp_cp_enabled
            and self.optimizers.boundary_sync is None
        )

    def _metrics_row(self) -> torch.Tensor:
        """This stage's metrics row for the exchange, with the step's loss as TorchTitan logs it
        without data parallelism: the sum of its gradient-accumulation steps' losses, in order
        (only the last stage's is read)."""
        loss = self._step_losses[0].clone()
        for more in self._step_losses[1:]:
            loss.add_(more)
        return self.metrics_processor.stage_row(loss, loss)


def init_timeout(config: ProtocolTrainer.Config) -> timedelta:
    """``[comm] init_timeout_seconds``: what every group waits until the first step is done."""
    return timedelta(seconds=config.comm.init_timeout_seconds)
