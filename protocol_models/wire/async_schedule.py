"""``Async1F1B``: a 1F1B pipeline schedule that does not flush between training steps.

A synchronous step (GPipe, 1F1B) starts with an empty pipeline and ends with one: every step
pays the fill and the drain, ``2 (P - 1)`` one-way latencies over slow links, on its critical
path. ``Async1F1B`` keeps the pipeline full across steps. Microbatch ``j`` of training step
(batch) ``t`` has the global index ``i = t M + j`` (``M`` microbatches per step); in its slot
``i`` stage ``s`` runs the forward of ``i``, then the backward of ``i - w_s``::

    w_s = (S - 1 - s) d        (S stages; the last stage runs each backward in its own slot)

so a stage's last ``w_s`` backwards of batch ``t`` run in the next step's call, before that
call's forwards of batch ``t + 1`` reach the same microbatch ids. The hop depth ``d`` is how many
slots a stage's backward may trail the next stage's: the gradient of microbatch ``i`` reaches
stage ``s`` one round trip after the activation left, ``2 (L + x) + f + b`` (latency ``L``, a
message's transfer ``x``, the next stage's forward ``f`` and backward ``b`` of it) plus the
``w_{s+1}`` slots the next stage trails by itself, so with ``T`` the bottleneck stage's time per
microbatch (``f + b``) no stage waits when ``d >= ceil((2 (L + x) + f + b) / T)`` (``hop_depth``).
Microbatch ids are reused step after step, which is safe while ``w_0 <= M - 1``: the backward
of ``(t, j)`` then runs before the forward of ``(t + 1, j)`` on every stage.

Because batch ``t``'s last backwards run after the update that follows step ``t`` (the
delayed rule of ``protocol_models.training.delayed``: batch ``t - 1``'s gradient is applied at
the end of step ``t``), each stage forwards batch ``t`` with weight version ``t % 2``
(``weight_versions``) and its backwards differentiate that version. A stage calls
``gradients_ready(t)`` right after its last backward of batch ``t`` (its local gradient norm
can travel then).

``drain`` (set by the trainer before each training step through ``begin``): the call runs the
stage's trailing backwards of its own batch too, posts nothing for the next call and waits for
all its sends, so that no pipeline message is outstanding after it (the batch's gradient norms
may be: every stage sent its own in the call). The trainer drains at every ``flush`` (a
checkpoint, a validation, a subspace update or the last step: every pending gradient is applied
then, and the next call starts both weight versions afresh) and at the first step of every
process: TorchTitan waits for the whole device after that step, and on NCCL a send whose
receive is not posted yet is a kernel that wait would wait for, while its receiver waits in the
same place before it posts it -- a deadlock. A drain without a flush changes no number: batch
``t``'s gradient
is the same whether its last backwards run in its own call or the next (each differentiates the
weight version its forward used), and it is applied at the end of step ``t + 1`` either way. The
first call, and every call after a drain, has no backwards of an earlier batch to run.
Forward-only calls (``eval``) run the forwards in order and need an empty pipeline.

Receives: all of a training call's receives (its batch's activations and gradients) are posted
at its start (on NCCL each just in time instead, ``WirePipelineStage.enable_async``), into the
wire's own buffers, and each is waited right before its compute; sends are fired at once, one
single ``isend`` each on its
boundary's group (on NCCL: a group per boundary and direction, each one sender's messages to one
receiver, so a pending receive never holds a send and a send meets its receive on the same
communicator), and waited two calls later (under gloo's receiver-driven transport a send
completes only when its receive was posted), all of them at a drain.

The schedule overrides ``PipelineScheduleSingle._step_microbatches``, the method torch's own
single-stage schedules implement, and uses the base class's private helpers as they do:
``_check_inputs``, ``_initialize_stage`` (metadata inference), ``_maybe_compute_loss``,
``_maybe_get_loss``, ``_update_losses`` and the attributes ``_stage``, ``_n_microbatches``,
``_has_backward``; of the stage, the public ``forward_one_chunk``, ``backward_one_chunk``,
``get_fwd_send_ops``/``get_bwd_send_ops`` and ``output_chunks`` (the stage keeps a trailing
batch's forward caches through ``WirePipelineStage.clear_runtime_states``). All are pinned by
``protocol_models.tools.private_api``.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.pipelining.schedules import PipelineScheduleSingle

ASYNC_SCHEDULE = "Async1F1B"


def hop_depth(latency_s: float, transfer_s: float, forward_s: float, backward_s: float,
              slot_s: float) -> int:  # fmt: skip
    """The smallest hop depth ``d`` at which no stage waits for a gradient (module docstring):
    ``ceil((2 (latency + transfer) + forward + backward) / slot)``, at least 1. ``slot_s``: the
    bottleneck stage's forward + backward of one microbatch."""
    return max(1, math.ceil((2 * (latency_s + transfer_s) + forward_s + backward_s) / slot_s))


def stage_depths(n_stages: int, hop: int) -> list[int]:
    """``w_s`` for every stage: how many slots its backwards trail its forwards."""
    return [(n_stages - 1 - s) * hop for s in range(n_stages)]


def max_hop_depth(n_stages: int, n_microbatches: int) -> int:
    """The largest hop depth whose first-stage depth ``(S - 1) d`` stays ``<= M - 1`` (0: none,
    ``M < S``)."""
    return (n_microbatches - 1) // max(n_stages - 1, 1)


class ScheduleAsync1F1B(PipelineScheduleSingle):
    """The ``Async1F1B`` schedule of one ``WirePipelineStage`` (module docstring)."""

    def __init__(self, stage, n_microbatches: int, *, hop: int, loss_fn=None,
                 output_merge_spec=None, scale_grads: bool = False):  # fmt: skip
        super().__init__(stage, n_microbatches, loss_fn=loss_fn,
                         output_merge_spec=output_merge_spec, scale_grads=scale_grads)  # fmt: skip
        limit = max_hop_depth(stage.num_stages, n_microbatches)
        if not 1 <= hop <= limit:
            raise ValueError(
                f"hop depth {hop}: {stage.num_stages} stages with {n_microbatches} microbatches "
                f"allow 1 to {limit}"
            )
        self.hop = hop
        self.depth = stage_depths(stage.num_stages, hop)[stage.stage_index]
        self.batch = 0
        """The training step whose batch the next training call runs (``begin``)."""
        self.flush = True
        """Whether the next training call is a flush: every pending gradient is applied after
        it (``begin``)."""
        self.drain = True
        """Whether the next training call empties the wire (``begin``; every flush does)."""
        self.trailing: int | None = None
        """The batch whose last ``depth`` backwards the next call runs first (None: none)."""
        self.drained = True
        """Whether no gradient is pending: the first call, or the last one flushed (the next
        training call sets both weight versions to the updated parameters)."""
        self.gradients_ready: Callable[[int], None] | None = None
        """Called with a batch's step right after this stage's last backward of it."""
        self._sends: deque[tuple[int, list[dist.Work]]] = deque()
        stage.enable_async()

    def begin(self, step: int, flush: bool, drain: bool) -> None:
        """The next training call runs step ``step``'s batch; ``drain``: it empties the wire;
        ``flush``: every pending gradient is applied after it (a flush drains)."""
        if flush and not drain:
            raise ValueError(f"step {step}: a flush drains the pipeline")
        self.batch, self.flush, self.drain = step, flush, drain

    def _step_microbatches(self, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                           return_outputs=True, loss_kwargs=None):  # fmt: skip
        """One call (``PipelineScheduleSingle.step`` runs it after its checks, the stage's
        ``clear_runtime_states`` and the microbatch split): a training step's batch, or with
        backward disabled (``eval``) a forward-only pass over an empty pipeline."""
        if not self._has_backward and self.trailing is not None:
            raise RuntimeError(
                f"evaluation with batch {self.trailing}'s backwards still in the pipeline: "
                "the training step before an evaluation must flush"
            )
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        first_target = target_mbs[0] if target_mbs is not None else None
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], first_target, loss_kwargs)
        stage, n = self._stage, self._n_microbatches
        stage.post_batch_receives(next_forward=self._has_backward and not self.drain)
        if not self._has_backward:
            stage.forward_version = None
            for j in range(n):
                self._forward(j, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs)
            self._wait_sends(keep=0)
            self._update_losses(stage, losses)
            return
        batch, previous, w = self.batch, self.trailing, self.depth
        if self.drained:
            stage.versions.reset()
            self.drained = False
        stage.forward_version = batch % 2
        self._wait_sends(keep=1)
        for j in range(n):
            self._forward(j, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs)
            if j >= w:
                self._backward(j - w, batch)
            elif previous is not None:
                self._backward(n + j - w, previous)
        if self.drain:
            for j in range(n - w, n):
                self._backward(j, batch)
            self._trail(None)
            self.drained = self.flush
            self._wait_sends(keep=0)
            stage.check_drained()
        else:
            self._trail(batch if w else None)
        self._update_losses(stage, losses)

    def _trail(self, batch: int | None) -> None:
        """``batch``'s last backwards run in the next call (None: none); the stage keeps their
        forward caches across the call's start."""
        self.trailing = batch
        self._stage.keep_forward_caches = batch is not None

    def _forward(self, j, arg_mbs, kwarg_mbs, target_mbs, loss_kwargs, return_outputs) -> None:
        stage = self._stage
        output = stage.forward_one_chunk(j, arg_mbs[j], kwarg_mbs[j],
                                         save_forward_output=return_outputs)  # fmt: skip
        self._fire(stage.get_fwd_send_ops(j))
        self._maybe_compute_loss(stage, output, target_mbs, j, loss_kwargs)

    def _backward(self, j: int, batch: int) -> None:
        """The backward of microbatch ``j`` of ``batch`` (this call's or the trailing one)."""
        stage, last = self._stage, j == self._n_microbatches - 1
        stage.backward_one_chunk(j, loss=self._maybe_get_loss(stage, j), last_backward=last)
        self._fire(stage.get_bwd_send_ops(j))
        if last and self.gradients_ready is not None:
            self.gradients_ready(batch)

    def _fire(self, ops: list[dist.P2POp]) -> None:
        """Send ``ops`` now, each a single ``isend`` on its own group (module docstring)."""
        if not ops:
            return
        works = [op.op(op.tensor, group=op.group, tag=op.tag, group_dst=op.group_peer)
                 for op in ops]  # fmt: skip
        if self._sends and self._sends[-1][0] == self.batch:
            self._sends[-1][1].extend(works)
        else:
            self._sends.append((self.batch, works))

    def _wait_sends(self, keep: int) -> None:
        """Wait for the sends of all but the last ``keep`` calls that sent something."""
        while len(self._sends) > keep:
            for work in self._sends.popleft()[1]:
                work.wait()
