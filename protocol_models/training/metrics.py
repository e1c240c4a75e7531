"""Metrics: TorchTitan's processor plus the wire and subspace figures, and a JSONL sink.

``MetricsProcessor.log`` runs on every rank at log steps, so the pipeline group can agree on the
figures there: the loss is broadcast from the last stage (the only one that computes it), the wire
counters are summed over stages (each stage counts what it sends) and the leak is the max over
boundaries. They reach every logger TorchTitan builds (console, TensorBoard, wandb) and a JSONL
file ``<dump_folder>/metrics.jsonl`` with one object per log step (validation results go to
``<dump_folder>/validation.jsonl``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
from dataclasses import dataclass, field
from math import isnan, nan
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torchtitan.components.metrics import (
    BaseLogger,
    LoggerContainer,
    MetricsProcessor,
    TensorBoardLogger,
    WandBLogger,
)
from torchtitan.tools.logging import logger
from torchtitan.tools.utils import device_module, get_local_device

from protocol_models.tools.errors import DataError
from protocol_models.tools.ranges import AT_LEAST_1, Ranges
from protocol_models.training.hardware import mfu_peak
from protocol_models.wire import Wire
from protocol_models.wire.meter import ring_rounds

_CANONICAL = {"loss_metrics/global_avg_loss": "loss", "throughput(tps)": "tps"}


class JsonlLogger(BaseLogger):
    """Appends one JSON object per ``log`` call: ``step`` first, then every metric.

    TorchTitan's long metric names for loss and throughput are also written as ``loss``/``tps``.
    Validation calls (metrics prefixed ``validation_metrics/``) go to a separate file.
    """

    def __init__(self, train_path: str, validation_path: str, samples_path: str):
        os.makedirs(os.path.dirname(train_path) or ".", exist_ok=True)
        self.train_path, self.validation_path = train_path, validation_path
        self.samples_path = samples_path
        self._opened: set[str] = set()

    def log(self, metrics: dict[str, Any], step: int) -> None:
        is_validation = any(k.startswith("validation_metrics/") for k in metrics)
        record = {"step": step}
        record.update({_CANONICAL[k]: v for k, v in metrics.items() if k in _CANONICAL})
        record.update(metrics)
        path = self.validation_path if is_validation else self.train_path
        self._append(path, [record], step)

    def log_text(self, samples: list[dict[str, str]], step: int) -> None:
        """Sampled continuations (``prompt``, ``continuation``) go to their own file."""
        self._append(self.samples_path, [{"step": step, **sample} for sample in samples], step)

    def _append(self, path: str, records: list[dict], step: int) -> None:
        if path not in self._opened:
            _drop_records_from(path, step)
            self._opened.add(path)
        with open(path, "a") as f:
            f.writelines(json.dumps(record) + "\n" for record in records)


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL file this sink wrote (``[]`` when it does not exist); safe to
    call while the run still appends to it."""
    return [json.loads(line) for line in _whole_lines(path)]


def _whole_lines(path: str | Path) -> list[str]:
    """The file's non-blank lines that were written whole, each with its newline. A record
    is one ``write`` ending in a newline, so a last line without one is still being written
    or was cut off by a kill: it is not a record (yet)."""
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        return [line for line in f if line.endswith("\n") and line.strip()]


def _drop_records_from(path: str, step: int) -> None:
    """Keep only records before ``step``: a fresh run starts the file anew, a resumed run
    continues it without duplicating the steps it replays (nor a record its kill cut off)."""
    if not os.path.exists(path):
        return
    kept = [line for line in _whole_lines(path) if json.loads(line)["step"] < step]
    with open(path, "w") as f:
        f.writelines(kept)


class ConfiguredWandbLogger(WandBLogger):
    """TorchTitan's wandb logger, initialized from ``[metrics]`` keys instead of environment
    variables (which still apply where a key is unset, e.g. ``WANDB_MODE=offline``).

    One wandb run per training run: the run id lives in ``<log_dir>/run_id`` (the dump folder's
    ``wandb/``), written by the first launch (``WANDB_RUN_ID`` if set, else a fresh id) and read
    by every restart and resubmission, which resume that run (``resume="allow"``). An offline
    run lands in ``<log_dir>/wandb/offline-run-<time>-<id>`` on the node holding the logging
    rank (the first rank of the last pipeline stage), one folder per launch, all with the same
    id: ``wandb sync`` uploads them into the one run."""

    RUN_ID_FILE = "run_id"

    def __init__(self, log_dir: str, config: ProtocolMetricsProcessor.Config, config_dict=None):
        import wandb

        self.wandb, self.tag = wandb, None
        os.makedirs(log_dir, exist_ok=True)
        wandb.init(
            id=self.run_id(log_dir),
            resume="allow",
            project=config.wandb_project or os.getenv("WANDB_PROJECT", "protocol-models"),
            entity=config.wandb_entity or os.getenv("WANDB_ENTITY"),
            name=config.wandb_run_name or os.getenv("WANDB_RUN_NAME"),
            group=config.wandb_group or os.getenv("WANDB_RUN_GROUP"),
            tags=config.wandb_tags or None,
            dir=log_dir,
            config=config_dict,
        )

    @classmethod
    def run_id(cls, log_dir: str) -> str:
        """This training run's wandb id: the one ``log_dir`` holds, else a new one (8 random
        lowercase hex digits, as wandb's own ids are short lowercase strings), kept there
        (written whole: a temporary file renamed over it)."""
        path = os.path.join(log_dir, cls.RUN_ID_FILE)
        if os.path.isfile(path):
            with open(path) as f:
                return f.read().strip()
        run_id = os.getenv("WANDB_RUN_ID") or secrets.token_hex(4)
        with open(path + ".partial", "w") as f:
            f.write(run_id + "\n")
        os.replace(path + ".partial", path)
        return run_id

    def log_text(self, samples: list[dict[str, str]], step: int) -> None:
        columns = ["prompt", "continuation"]
        table = self.wandb.Table(columns=columns, data=[[s[c] for c in columns] for s in samples])
        self.wandb.log({"samples": table}, step=step)


class IdsChecksum:
    """An order-sensitive checksum of the token ids a rank trained on since the last log step,
    kept on the training device (int64 arithmetic wraps; no host read until it is popped)."""

    MIX = 1_000_003
    """Multiplies the running value before each microbatch is added (order matters)."""

    def __init__(self) -> None:
        self._total: torch.Tensor | None = None
        self._weights: dict[tuple[int, torch.device], torch.Tensor] = {}

    def add(self, ids: torch.Tensor) -> None:
        """Fold in one microbatch ``[mb, seq]`` of token ids."""
        weights = self._weights_for(ids.shape[-1], ids.device)
        value = (ids.to(torch.int64) * weights).sum()
        self._total = value if self._total is None else self._total * self.MIX + value

    def pop(self) -> torch.Tensor | None:
        """The checksum since the last pop (a 0-dim int64 device tensor), or None."""
        total, self._total = self._total, None
        return total

    def _weights_for(self, seq: int, device: torch.device) -> torch.Tensor:
        """Distinct odd weights per position ``[seq]`` (a position-sensitive sum)."""
        key = (seq, device)
        if key not in self._weights:
            positions = torch.arange(1, seq + 1, dtype=torch.int64, device=device)
            self._weights[key] = (positions * 2_654_435_761) % (2**31 - 1) * 2 + 1
        return self._weights[key]


class ProtocolMetricsProcessor(MetricsProcessor):
    """Adds ``wire/*``, ``wan/*`` and ``subspace/leak`` to every log step, a JSONL sink, and
    wandb settings from TOML."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl: bool = True
        """Write ``metrics.jsonl`` / ``validation.jsonl`` into the dump folder."""
        wandb_project: str | None = None
        wandb_entity: str | None = None
        wandb_run_name: str | None = None
        wandb_group: str | None = None
        wandb_tags: list[str] = field(default_factory=list)
        sample_prompts: list[str] = field(default_factory=list)
        """At every validation, log a greedy continuation of each prompt (at most
        ``training.local_batch_size`` prompts; ``protocol_models.training.samples``). Empty: off."""
        sample_tokens: int = 32
        """Tokens each sampled continuation gets (fewer where the row ends at ``seq_len``)."""

        RANGES: ClassVar[Ranges] = {"log_freq": AT_LEAST_1, "sample_tokens": AT_LEAST_1}

    wire: Wire | None = None
    """The trainer's wire, handed over after construction as TorchTitan hands over
    ``optimizers`` and ``model_parts``: its meter is summed over the pipeline group at every log
    step, its link (``[wan]`` on) gives ``wan/wait_s``, ``wan/wire_s``, ``wan/collective_s`` and
    ``wan/loss_s`` (what ``packet_loss`` added) per step."""

    def __init__(self, *args, config_dict: dict[str, Any] | None = None, **kwargs):
        super().__init__(*args, config_dict=config_dict, **kwargs)
        hardware = (config_dict or {}).get("hardware", {})
        self.gpu_peak_flops, source = mfu_peak(hardware.get("peak_tflops"),
                                               self.device_memory_monitor.device_name)  # fmt: skip
        """What MFU is measured against: ``[hardware] peak_tflops`` (read from the run's config,
        which TorchTitan passes at construction), else TorchTitan's detection
        (``hardware.mfu_peak``)."""
        logger.info(f"MFU is measured against {self.gpu_peak_flops / 1e12:g} TFLOP/s ({source})")
        self.ids_checksum = IdsChecksum()
        """Fed every training microbatch's token ids by the trainer; checked across the
        pipeline group and logged as ``data/ids_checksum`` at every log step."""
        self.exchanged_rows: torch.Tensor | None = None
        """``[stages, width]``: every stage's ``stage_row`` of this log step, handed over by the
        trainer when they travelled with the gradient-norm exchange (the log then needs no
        collective); None: ``log`` gathers them."""
        self.gather_later = False
        """Set by the trainer each step: a log step gathers the rows without waiting for them
        and its record is written at the next log step or ``finish_record`` (``Async1F1B``
        between flushes: a blocking gather would stop the pipeline running ahead)."""
        self._unfinished: tuple[int, torch.Tensor, dist.Work, dict[str, Any]] | None = None
        """``(step, rows, gather, record)`` of a log step whose rows are still on their way."""

    def _build_metric_logger(self, *, config: Config, parallel_dims, dump_folder: str, **kwargs):
        base = super()._build_metric_logger(
            config=dataclasses.replace(config, enable_wandb=False),
            parallel_dims=parallel_dims,
            dump_folder=dump_folder,
            **kwargs,
        )
        if dist.get_rank() != metrics_rank(parallel_dims):
            return base
        container = LoggerContainer()
        container.add_logger(base)
        if config.enable_wandb:
            container.add_logger(
                ConfiguredWandbLogger(
                    os.path.join(dump_folder, "wandb"), config, kwargs.get("config_dict")
                )
            )
        if not config.jsonl:
            return container
        container.add_logger(
            JsonlLogger(
                os.path.join(dump_folder, "metrics.jsonl"),
                os.path.join(dump_folder, "validation.jsonl"),
                os.path.join(dump_folder, "samples.jsonl"),
            )
        )
        return container

    def log_samples(self, step: int, prompts: list[str], continuations: list[str]) -> None:
        """Sampled continuations as text (the metrics rank): ``samples.jsonl``, a wandb table,
        TensorBoard text ``samples/<i>``."""
        if dist.get_rank() != metrics_rank(self.parallel_dims):
            return
        samples = [
            {"prompt": p, "continuation": c} for p, c in zip(prompts, continuations, strict=True)
        ]
        for sink in _leaf_loggers(self.logger):
            if isinstance(sink, TensorBoardLogger):
                for i, sample in enumerate(samples):
                    sink.writer.add_text(
                        f"samples/{i}", sample["prompt"] + sample["continuation"], step
                    )
            elif hasattr(sink, "log_text"):
                sink.log_text(samples, step)

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.finish_record()
        later = self.gather_later and self._pp_group() is not None and self.exchanged_rows is None
        if later:
            rows, gather = self._gather_rows(global_avg_loss, global_max_loss, wait=False)
        else:
            agreed = self._agree_over_pipeline(global_avg_loss, global_max_loss, step)
        metrics = dict(extra_metrics or {})
        subspace = getattr(self.optimizers, "subspace", None)
        if subspace is not None:  # subspace updates on: angle of the latest, count, U's health
            metrics.update(subspace.metrics())
        sync = getattr(self.optimizers, "boundary_sync", None)
        if sync is not None:  # mapl: the learned projections' and the codebooks' health
            metrics.update(sync.metrics())
        if later:
            record = _Record()
            self.logger, sinks = record, self.logger
            try:  # TorchTitan's figures of this step, taken now (its console line included)
                super().log(step, global_avg_loss, global_max_loss, grad_norm, metrics)
            finally:
                self.logger = sinks
            self._unfinished = (step, rows, gather, record.metrics)
            return
        loss, max_loss = agreed.pop("loss"), agreed.pop("max_loss")
        super().log(step, loss, max_loss, grad_norm, extra_metrics={**metrics, **agreed})

    def finish_record(self) -> None:
        """Write the record of a log step whose rows were gathered without waiting, once they
        are here (``gather_later``): the loss and the pipeline's figures from them."""
        if self._unfinished is None:
            return
        step, rows, gather, metrics = self._unfinished
        self._unfinished = None
        gather.wait()
        agreed = self._row_layout().agree(rows, step, has_link=self.wire.link is not None)
        metrics["loss_metrics/global_avg_loss"] = agreed.pop("loss")
        metrics["loss_metrics/global_max_loss"] = agreed.pop("max_loss")
        self.logger.log({**metrics, **agreed}, step)

    def close(self) -> None:
        self.finish_record()
        super().close()

    def log_validation(self, loss, step, extra_metrics=None):
        (loss,) = self._from_last_stage([loss])
        super().log_validation(loss, step, extra_metrics=extra_metrics)

    def _pp_group(self):
        if not self.parallel_dims.pp_enabled:
            return None
        return self.parallel_dims.get_mesh("pp").get_group()

    def _from_last_stage(self, values: list[float]) -> list[float]:
        group = self._pp_group()
        if group is None:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=get_local_device())
        dist.broadcast(t, group=group, group_src=dist.get_world_size(group) - 1)
        return t.tolist()

    def _agree_over_pipeline(self, loss: float, max_loss: float, step: int) -> dict[str, float]:
        """The log step's figures agreed over the pipeline group from one float64 row per stage
        (on the training device; the ids checksum travels as its int64 bits): the loss from the
        last stage (the only one that computes it), the wire counters summed over stages (each
        stage counts what it sends, and what it waited for), the max leak over boundaries and
        each stage's peak memory; the stages' token-id checksums must agree (``_check_ids``).
        The rows came with the step's gradient-norm exchange (``exchanged_rows``), else they
        are gathered here in **one** all-gather. Returns ``loss``, ``max_loss`` and the
        ``wire/*``, ``wan/*``, ``subspace/leak``, ``memory/*`` and ``data/*`` metrics."""
        group = self._pp_group()
        rows, self.exchanged_rows = self.exchanged_rows, None
        if group is None:
            checksum = self.ids_checksum.pop()
            metrics = {"loss": loss, "max_loss": max_loss}
            if checksum is not None:
                metrics["data/ids_checksum"] = int(checksum) % 2**24
            return metrics
        if rows is None:
            rows, _ = self._gather_rows(loss, max_loss, wait=True)
        return self._row_layout().agree(rows, step, has_link=self.wire.link is not None)

    def _gather_rows(self, loss, max_loss, *, wait: bool) -> tuple[torch.Tensor, dist.Work | None]:
        """Every stage's ``stage_row`` (``[stages, width]``) in **one** all-gather over the
        pipeline group, counted in the row; ``wait=False``: started, with its work to wait on
        (the link simulator charges no collective the stage does not wait for)."""
        group = self._pp_group()
        stages = dist.get_world_size(group)
        self.wire.meter.collective("metrics", ring_rounds("all_gather", stages))
        mine = self.stage_row(loss, max_loss)
        rows = torch.empty(stages * mine.numel(), dtype=mine.dtype, device=mine.device)
        gather = dist.all_gather_single(rows, mine, group=group, async_op=not wait)
        if wait and self.wire.link is not None:
            self.wire.link.collective(ring_rounds("all_gather", stages))
        return rows.view(stages, mine.numel()), gather

    def stage_row(self, loss: float | torch.Tensor, max_loss: float | torch.Tensor) -> torch.Tensor:
        """This stage's row ``[width]`` float64 on the training device, from its counters now
        (its ids checksum and leak window are taken): what the log step agrees over."""
        meter, link = self.wire.meter, self.wire.link
        return self._row_layout().pack(meter, link, loss, max_loss, self._leak(),
                                       _peak_memory_bytes(), self.ids_checksum.pop(),
                                       get_local_device())  # fmt: skip

    def stage_row_width(self) -> int:
        """How many values ``stage_row`` returns."""
        return self._row_layout().width

    def _row_layout(self) -> _StageRow:
        return _StageRow(dist.get_world_size(self._pp_group()) - 1)

    def _leak(self) -> torch.Tensor | None:
        """The largest leak this stage measured over its boundaries (a device scalar), or None."""
        leaks = [m.pop_boundary_leak() for m in self.model_parts or []]
        leaks = [v.detach().reshape(()).to(torch.float64) for v in leaks if v is not None]
        return torch.stack(leaks).max() if leaks else None


class _Record(BaseLogger):
    """Holds the one record TorchTitan's ``log`` writes, for ``finish_record``."""

    metrics: dict[str, Any]

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self.metrics = dict(metrics)


class _StageRow:
    """The layout of the one float64 row each stage contributes to a log step (carried by the
    gradient-norm exchange, or all-gathered), for a pipeline of ``n_boundaries + 1`` stages:
    what ``pack`` writes and ``agree`` reads."""

    COUNTERS = ("fwd", "bwd", "dense", "sync")
    """Per-boundary byte counters of ``WireMeter``, summed over stages."""

    def __init__(self, n_boundaries: int):
        self.boundaries = range(n_boundaries)
        self.keys = [(d, b) for d in ("fwd", "bwd") for b in self.boundaries]

    @property
    def width(self) -> int:
        """Values per row: 5 scalars, 4 byte counters and, per direction, messages and waits
        per boundary, 4 link sums, the leak and the ids checksum."""
        return 5 + len(self.COUNTERS) * len(self.boundaries) + 2 * len(self.keys) + 4 + 2

    def pack(self, meter, link, loss, max_loss, leak, peak, checksum, device) -> torch.Tensor:
        """The row; ``loss``/``max_loss`` floats or device scalars (the last stage's)."""
        losses = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device).reshape(())
                              for v in (loss, max_loss)])  # fmt: skip
        values = [peak, float(sum(meter.collectives.values())), float(meter.collective_rounds)]
        values += [float(getattr(meter, c)[b]) for c in self.COUNTERS for b in self.boundaries]
        values += [float(meter.messages[key]) for key in self.keys]
        values += [meter.wait_seconds(key) for key in self.keys]
        values += [link.wait_s, link.wire_s, link.collective_s, link.loss_s] if link else [0.0] * 4
        head = torch.tensor(values, dtype=torch.float64, device=device)
        no_leak = torch.full((1,), -1.0, dtype=torch.float64, device=device)
        ids = torch.zeros((), dtype=torch.int64, device=device) if checksum is None else checksum
        return torch.cat([losses, head, no_leak if leak is None else leak.to(device).reshape(1),
                          ids.reshape(1).view(torch.float64)])  # fmt: skip

    def agree(self, rows: torch.Tensor, step: int, *, has_link: bool) -> dict:
        """The metrics from every stage's row (``rows``: ``[stages, width]``; one host read)."""
        ids = rows[:, -1].contiguous().view(torch.int64).tolist()
        table = rows[:, :-1].tolist()
        last = table[-1]
        columns = iter(range(5, len(last)))

        def total() -> float:  # the next column, summed over stages
            column = next(columns)
            return sum(r[column] for r in table)

        counters = {c: [total() for _ in self.boundaries] for c in self.COUNTERS}
        messages = {key: total() for key in self.keys}
        waits = {key: total() for key in self.keys}
        link_sums = [total() for _ in range(4)]
        fwd, bwd, dense = (sum(counters[c]) for c in ("fwd", "bwd", "dense"))
        metrics = {
            "loss": last[0],
            "max_loss": last[1],
            "wire/fwd_bytes": fwd,
            "wire/bwd_bytes": bwd,
            "wire/dense_bytes": dense,
            "wire/compression_ratio": dense / (fwd + bwd) if fwd + bwd else 0.0,
            "wire/messages": sum(messages.values()),
            "wire/collectives": max(r[3] for r in table),
            "wire/collective_rounds": max(r[4] for r in table),
        }
        for b in self.boundaries:
            metrics[f"wire/fwd_bytes/b{b}"] = counters["fwd"][b]
            metrics[f"wire/bwd_bytes/b{b}"] = counters["bwd"][b]
            sent = counters["fwd"][b] + counters["bwd"][b]
            metrics[f"wire/compression_ratio/b{b}"] = counters["dense"][b] / sent if sent else 0.0
            for d in ("fwd", "bwd"):
                metrics[f"wire/messages/{d}/b{b}"] = messages[(d, b)]
                metrics[f"wire/recv_wait_s/{d}/b{b}"] = waits[(d, b)]
        if any(counters["sync"]):
            metrics["wire/sync_bytes"] = sum(counters["sync"])
        leaks = [r[-1] for r in table if not r[-1] < 0]  # -1: no boundary measured; NaN kept
        if leaks:
            metrics["subspace/leak"] = nan if any(isnan(v) for v in leaks) else max(leaks)
        for s, r in enumerate(table):
            metrics[f"memory/peak_gib/s{s}"] = r[2] / 1024**3
        if has_link:
            for name, value in zip(("wait_s", "wire_s", "collective_s", "loss_s"), link_sums,
                                   strict=True):  # fmt: skip
                metrics[f"wan/{name}"] = value
        _check_ids(ids, step)
        metrics["data/ids_checksum"] = ids[0] % 2**24
        return metrics


def _check_ids(checksums: list[int], step: int) -> None:
    """The pipeline stages of a replica must have trained on the same token ids -- ids never
    cross the wire, so each stage reads its own copy of the data -- or the run stops with
    ``DataError``."""
    if len(set(checksums)) > 1:
        raise DataError(
            f"the pipeline stages of a replica trained on different token ids before step "
            f"{step} (checksums {min(checksums)} .. {max(checksums)}); every node must read the "
            "same [dataloader] files in the same order with the same tokenizer (hf_assets_path)"
        )


def _leaf_loggers(logger: BaseLogger) -> list[BaseLogger]:
    """The loggers inside (nested) ``LoggerContainer``s, which keep them in ``_loggers``."""
    if not isinstance(logger, LoggerContainer):
        return [logger]
    return [leaf for inner in logger._loggers for leaf in _leaf_loggers(inner)]


def _peak_memory_bytes() -> float:
    """This rank's peak reserved device memory since TorchTitan's last reset (at each log)."""
    return float(device_module.memory_stats().get("reserved_bytes.all.peak", 0))


def metrics_rank(parallel_dims) -> int:
    """First rank of the last pipeline stage: where TorchTitan logs (and loss lives)."""
    if not parallel_dims.pp_enabled:
        return 0
    return (parallel_dims.world_size // parallel_dims.pp) * (parallel_dims.pp - 1)
