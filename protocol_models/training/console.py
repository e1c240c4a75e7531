"""What a run prints: TorchTitan's console without the lines that are wrong for this plugin, and
a progress line (step of total, elapsed, ETA) at every log step.

Dropped, each for a reason a user of this plugin would otherwise chase:

* "Pipeline Parallel loss is not visible. Please add rank N to LOG_RANK ... run_train.sh":
  ``scripts/train.sh`` shows the last stage (where the loss lives) by default;
* "Error running lspci", "Peak flops undefined for: ..., fallback to A100" and "Peak FLOPS used
  for computing MFU": the trainer states once which peak MFU is measured against and where it
  came from (``hardware.mfu_peak``: ``[hardware] peak_tflops``, TorchTitan's figure for the
  detected device, or its A100 fallback), where TorchTitan's own line would name its figure even
  when ``peak_tflops`` overrides it;
* "initial_load_model_only=True has no effect": a TorchTitan default no TOML sets;
* "Sleeping 2 seconds for other ranks to complete": rank 0 still sleeps, but the ranks meet
  in a barrier before the process group goes anyway (``protocol_models.train``);
* "torch.distributed is already initialized. Skipping init_distributed ... will not take
  effect": under the CPU emulation of NCCL (``tools.nccl_rules``) the trainer creates the world
  group first, on purpose, and does what TorchTitan's set-up would do on CPU;
* Python warnings "DTensor random operators may not have complete support on cpu device mesh"
  (no random op runs on a DTensor here) and torchdata's "'set_vital' is deprecated".
"""

from __future__ import annotations

import logging
import time
import warnings
from datetime import timedelta

MISLEADING_LOG_LINES = (
    "Pipeline Parallel loss is not visible",
    "Error running lspci",
    "Peak flops undefined for",
    "Peak FLOPS used for computing MFU",
    "initial_load_model_only=True has no effect",
    "Sleeping 2 seconds for other ranks to complete",
    "torch.distributed is already initialized. Skipping init_distributed",
)
MISLEADING_WARNINGS = (
    "DTensor random operators may not have complete support on cpu",
    "'set_vital' is deprecated",
)


class _DropMisleading(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(line in message for line in MISLEADING_LOG_LINES)


def quiet_misleading(logger: logging.Logger) -> None:
    """Install the filters on TorchTitan's logger and on Python's warnings (once per process)."""
    if not any(isinstance(f, _DropMisleading) for f in logger.filters):
        logger.addFilter(_DropMisleading())
    for message in MISLEADING_WARNINGS:
        warnings.filterwarnings("ignore", message=f".*{message}")


class Progress:
    """``step 40/300 (13%), 0:01:12 elapsed, ETA 0:07:48``: the ETA extrapolates this run's own
    pace since its first step (a resumed run counts from the step it resumed at)."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self._start: tuple[int, float] | None = None

    def begin(self, step: int) -> None:
        """Called as each step starts; the first call starts the clock."""
        if self._start is None:
            self._start = (step - 1, time.monotonic())

    def line(self, step: int) -> str:
        """The progress after ``step`` finished."""
        first, started = self._start or (step - 1, time.monotonic())
        elapsed = time.monotonic() - started
        done = step - first
        remaining = elapsed / done * (self.total - step) if done else 0.0
        return (
            f"step {step}/{self.total} ({100 * step // self.total}%), "
            f"{_clock(elapsed)} elapsed, ETA {_clock(remaining)}"
        )


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds)))
