"""Bounded detection of a silent peer: a training step that runs far longer than the run's own
steps ends this worker with one line naming what it waits for, so that the launcher restarts the
run from its last complete checkpoint (``--max-restarts``) instead of every stage idling until
``[comm] train_timeout_seconds`` (an hour in the production configs).

A step's deadline, from its start::

    bound = stall_bound_steps x median(step) + stall_bound_floor_seconds + 2 x gap

``median(step)``: this process's last ``WINDOW`` training steps' wall times (its first step, with
the compile and the pipeline's metadata inference, is not counted; the watch arms once
``ARM_AFTER`` are measured). ``gap``: the time this process spent since its previous step ended (a
checkpoint save, a validation, a log step's work): a peer may spend about as long in the same
work before it sends again. Between steps nothing is watched (``[comm]``'s timeouts apply).

A stall shorter than the bound is ridden through: nothing is cancelled, TCP retransmits, the
step ends late with the same numbers. Past the bound the watch thread prints one ``error:``
line -- the oldest receive this rank still waits for (a pre-posted pipeline message: boundary,
direction, microbatch; or the gradient norm; with the peer's stage, rank, node and host), or
that none is outstanding (a collective, the stage's own compute, or on NCCL a pipeline message,
posted just in time) -- records it in torchelastic's error file and ends the process with
``EXIT_CODE``. Its peers see the connection close (or hit their own bound, across a partition)
and end the same way; torchelastic's agents then restart every node's workers, which resume
from the last checkpoint every node has completed once all nodes are back in the rendezvous.

The watch only reads clocks and ``Work.is_completed()`` (no device synchronization), so it costs
the step nothing and behaves the same under gloo and NCCL.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

from torch.distributed.elastic.multiprocessing.errors import get_error_handler

from protocol_models.tools.errors import LinkFault
from protocol_models.wire.stage import Waiting

WINDOW = 20
"""Steps whose median sets the bound."""
ARM_AFTER = 3
"""Measured steps (after this process's first) before the watch arms."""
POLL_SECONDS = 0.5
EXIT_CODE = 3
"""A worker that detected a silent peer (not a user error: ``protocol_models.launch`` restarts)."""


def describe_waiting(waiting: Waiting, now: float, where: Callable[[int], str]) -> str:
    """``stage 1 has waited 74 s for the fwd message of microbatch 3 over boundary 0 from stage 0
    (rank 0, node 0, host a)``; ``where(rank)`` names a rank's place."""
    return (
        f"stage {waiting.stage} has waited {now - waiting.posted_at:.0f} s for "
        f"{waiting.message} from stage {waiting.peer_stage} ({where(waiting.peer_rank)})"
    )


class StallWatch:
    """The deadline of each training step (module docstring) and the thread that enforces it.

    ``pending()`` lists the receives this rank's stages wait for; ``where(rank)`` describes a
    rank's place (``"rank 1, node 1, host b"``). ``step_begins``/``step_ends`` bracket every
    training step (main thread); ``close`` stops the thread."""

    def __init__(self, steps_multiple: float, floor_s: float,
                 pending: Callable[[], list[Waiting]], where: Callable[[int], str]):  # fmt: skip
        self.steps_multiple = steps_multiple
        self.floor_s = floor_s
        self._pending = pending
        self._where = where
        self._durations: deque[float] = deque(maxlen=WINDOW)
        self._steps_seen = 0
        self._ended_at: float | None = None
        self._lock = threading.Lock()
        self._deadline: tuple[int, float, float, float] | None = None
        """(step, started at, bound s, gap s) of the step running now, if armed."""
        self._began = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
        self._thread.start()

    def bound(self, gap_s: float = 0.0) -> float | None:
        """The deadline of a step that follows ``gap_s`` seconds of other work (None: unarmed)."""
        if len(self._durations) < ARM_AFTER:
            return None
        step = statistics.median(self._durations)
        return self.steps_multiple * step + self.floor_s + 2 * gap_s

    def step_begins(self, step: int) -> None:
        now = time.monotonic()
        gap = 0.0 if self._ended_at is None else now - self._ended_at
        bound = self.bound(gap)
        self._began = now
        with self._lock:
            self._deadline = None if bound is None else (step, now, bound, gap)

    def step_ends(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._deadline = None
        self._steps_seen += 1
        if self._steps_seen > 1:  # the first one compiles and infers the pipeline's metadata
            self._durations.append(now - self._began)
        self._ended_at = now

    def describe(self, step: int, elapsed: float, bound: float, gap: float) -> str:
        """The line a step past its bound ends the worker with."""
        waiting = sorted(self._pending(), key=lambda w: w.posted_at)
        median = statistics.median(self._durations)
        rule = (f"bound {self.steps_multiple:g} x {median:.2f} s median step + "
                f"{self.floor_s:g} s" + (f" + 2 x {gap:.1f} s since the previous step"
                                         if gap >= 0.05 else ""))  # fmt: skip
        if waiting:
            what = describe_waiting(waiting[0], time.time(), self._where)
        else:
            what = "no pipeline message is outstanding (a collective or this stage's compute hangs)"
        return (
            f"step {step} has run {elapsed:.0f} s, past its stall bound of {bound:.0f} s "
            f"({rule}): {what}; restarting from the last complete checkpoint "
            "(needs --max-restarts; see [transport] stall_bound_steps)"
        )

    def _run(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            with self._lock:
                deadline = self._deadline
            if deadline is None:
                continue
            step, began, bound, gap = deadline
            elapsed = time.monotonic() - began
            if elapsed > bound:
                end_worker(LinkFault(self.describe(step, elapsed, bound, gap)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def end_worker(fault: LinkFault) -> None:
    """From any thread: print the fault's line, record it for the launcher and end the process
    at once with ``EXIT_CODE`` (the main thread may be blocked in a receive that never ends)."""
    print(f"error: {fault}", file=sys.stderr, flush=True)
    get_error_handler().record_exception(fault)  # a no-op outside torchelastic
    sys.stdout.flush()
    os._exit(EXIT_CODE)
