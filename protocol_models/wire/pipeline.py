"""The plugin's ``ModelSpec.pipelining_fn`` and ``parallelize_fn``.

``pipeline_protocol`` builds one ``WirePipelineStage`` per pipeline rank. It mirrors TorchTitan's
``pipeline_llm`` contract -- returns ``(schedule, model_parts, has_first_stage,
has_last_stage)`` -- but splits the model with ``stage_layer_ranges`` (the same
split the model used to decide which blocks are constrained) and builds our stage subclass.
Only single-stage-per-rank schedules (GPipe, 1F1B, and the plugin's asynchronous ``Async1F1B``:
``wire.async_schedule``) are supported; the config layer refuses others.

``parallelize_protocol`` is llama3's parallelize, then (lossy modes, quantized subspace
coordinates) the in-graph codec at every stage boundary inside the module it got: all of them in
a single-process run with ``protocol.stages = S``, none in a pipeline stage's chunk (its
boundaries are on the wire). A stage of the asynchronous schedule is not wrapped by FSDP (llama3's
parallelize always wraps, for its mixed-precision policy, even on one rank): its forwards swap
in weight versions, which FSDP's own parameter management would override, so it only compiles
its blocks (``[compile]``) and runs its forwards under autocast at
``training.mixed_precision_param`` (``WirePipelineStage.compute_dtype``).
"""

from __future__ import annotations

import copy
from functools import partial

import torch
from torch import nn
from torch.distributed.pipelining.microbatch import sum_reducer
from torch.distributed.pipelining.schedules import get_schedule_class
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed.compile import apply_compile
from torchtitan.models.llama3 import parallelize_llama

from protocol_models.model.layout import stage_layer_ranges
from protocol_models.tools.cpu_shim import bound_device, gloo_fsdp_reductions
from protocol_models.wire import Wire
from protocol_models.wire.async_schedule import ASYNC_SCHEDULE, ScheduleAsync1F1B
from protocol_models.wire.codecs import install_in_graph
from protocol_models.wire.stage import WirePipelineStage

SCHEDULES = ("GPipe", "1F1B", ASYNC_SCHEDULE)


def split_stage(model: nn.Module, stage: int, n_stages: int) -> nn.Module:
    """A deep copy of ``model`` holding only what ``stage`` runs; everything else set to None.

    The blocks are the ones ``stage_layer_ranges`` gives ``stage`` under the split the model was
    built for (``model.config.layers_per_stage``), so they are the ones the model constrained.
    Root buffers (``basis``, ``token_table``) are kept on every stage. Layer keys keep their
    global ids, so checkpoints of any layout share parameter names.
    """
    chunk = copy.deepcopy(model)
    ranges = stage_layer_ranges(len(chunk.layers), n_stages, chunk.config.layers_per_stage)
    keep = {str(i) for i in ranges[stage]}
    for name in [n for n in chunk.layers.keys() if n not in keep]:
        del chunk.layers[name]
    if stage != 0:
        chunk.tok_embeddings = None
    if stage != n_stages - 1:
        chunk.norm = None
        chunk.lm_head = None
    return chunk


def pipeline_protocol(
    model: nn.Module,
    *,
    parallel_dims,
    training,
    parallelism,
    compile_config,
    ac_config,
    dump_folder: str,
    device: torch.device,
    model_config,
    parallelize_fn,
    loss_fn,
    wire: Wire,
):
    """Split ``model`` for this pipeline rank, parallelize the chunk, and build the schedule
    (``wire``: the run's meter, lossy codec and link, used at the stage's send/recv hooks)."""
    pp_mesh = parallel_dims.get_mesh("pp")
    n_stages, stage_index = pp_mesh.size(), pp_mesh.get_local_rank()
    chunk = split_stage(model, stage_index, n_stages)
    if wire.codec is not None:  # a codec whose state lives in the boundary blocks (MAPL's RVQ)
        blocks = list(chunk.layers.values())
        last, first = stage_index == n_stages - 1, stage_index == 0
        wire.codec.attach(None if last else blocks[-1], None if first else blocks[0])
    chunk = parallelize_fn(
        chunk,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=compile_config,
        ac_config=ac_config,
        dump_folder=dump_folder,
    )
    stage = WirePipelineStage(
        chunk,
        stage_index,
        n_stages,
        device,
        group=pp_mesh.get_group("pp"),
        wire=wire,
    )
    stage.compute_dtype = TORCH_DTYPE_MAP[training.mixed_precision_param]

    def scalar_loss(*args, **kwargs) -> torch.Tensor:
        loss, _ = loss_fn(*args, **kwargs)
        return loss

    name = parallelism.pipeline_parallel_schedule
    if name == ASYNC_SCHEDULE:
        schedule_class = partial(ScheduleAsync1F1B, hop=wire.async_hop)
    else:
        schedule_class = get_schedule_class(name)
    schedule = schedule_class(
        stage,
        n_microbatches=training.local_batch_size // parallelism.pipeline_parallel_microbatch_size,
        loss_fn=scalar_loss,
        scale_grads=False,
        # with loss_chunk_tokens the last stage outputs each microbatch's summed loss (a scalar):
        # the outputs a schedule returns (the Validator's eval) are their sum, not a concatenation
        output_merge_spec=sum_reducer if model_config.loss_chunk_tokens else None,
    )
    return schedule, [chunk], stage.is_first, stage.is_last


def parallelize_protocol(model: nn.Module, *, wire: Wire, n_stages: int, microbatch: int,
                         **parallelize_kwargs) -> nn.Module:  # fmt: skip
    """llama3's parallelize, then ``wire.codec`` in-graph at the ``n_stages`` layout's
    boundaries inside ``model``, ``microbatch`` sequences at a time (module docstring)."""
    dims, parallelism = parallelize_kwargs["parallel_dims"], parallelize_kwargs["parallelism"]
    if dims.pp_enabled and parallelism.pipeline_parallel_schedule == ASYNC_SCHEDULE:
        compile_config = parallelize_kwargs["compile_config"]
        if compile_config.enable and "model" in compile_config.components:
            apply_compile(model, compile_config=compile_config, parallel_dims=dims)
        return model
    model = parallelize_llama(model, **parallelize_kwargs)
    if bound_device() == "cpu":
        gloo_fsdp_reductions(model)
    if wire.codec is not None:
        install_in_graph(model, wire.codec, n_stages, microbatch)
    return model
