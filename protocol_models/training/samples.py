"""A few greedy continuations of fixed prompts at every validation (``[metrics] sample_prompts``).

Off by default. Each prompt is tokenized as training documents start (with BOS) into its own row
of a validation-sized batch ``[local_batch_size, seq_len]`` (the rest of the row is EOS padding,
which a causal model never reads before it is overwritten). Every new token costs one forward of
that batch through the same path validation takes: ``post_dataloading_process`` (token ids to
every stage, attention masks) and, pipelined, the schedule's ``eval``; the last stage takes the
argmax at each row's end and broadcasts the chosen ids to the other stages, which need them as
input (first stage) and as ``token_ids`` (every stage). Greedy decoding draws no random numbers,
so sampling never changes the training run. The metrics rank logs the texts
(``ProtocolMetricsProcessor.log_samples``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def sample_at_validation(validator, model_parts: list[torch.nn.Module], step: int) -> None:
    """Continue ``[metrics] sample_prompts`` by ``sample_tokens`` greedy tokens each and log
    them (a no-op without prompts). Called by the validator after each validation."""
    settings = validator.metrics_processor.config
    if not settings.sample_prompts:
        return
    tokenizer, seq_len = validator.tokenizer, validator.seq_len
    prompts = [tokenizer.encode(p, add_bos=True, add_eos=False)[: seq_len - 1] for p in
               settings.sample_prompts]  # fmt: skip
    rows = torch.full((validator.local_batch_size, seq_len), tokenizer.eos_id, dtype=torch.long)
    ends = torch.zeros(validator.local_batch_size, dtype=torch.long)
    for i, ids in enumerate(prompts):
        rows[i, : len(ids)], ends[i] = torch.tensor(ids), len(ids)
    device = next(model_parts[0].parameters()).device
    rows, ends = rows.to(device), ends.to(device)
    active = torch.arange(len(prompts), device=device)
    for model in model_parts:
        model.eval()
    with validator.validation_context():
        for _ in range(settings.sample_tokens):
            active = active[ends[active] < seq_len]
            if not len(active):
                break
            logits = _forward(validator, model_parts, rows)
            chosen = torch.zeros(len(rows), dtype=torch.long, device=device)
            if logits is not None:
                chosen = logits[torch.arange(len(rows), device=device), ends - 1].argmax(-1)
            chosen = _from_last_stage(validator, chosen)
            rows[active, ends[active]] = chosen[active]
            ends[active] += 1
    for model in model_parts:
        model.train()
    continuations = [
        tokenizer.decode(rows[i, len(ids) : ends[i]].tolist()) for i, ids in enumerate(prompts)
    ]
    validator.metrics_processor.log_samples(step, settings.sample_prompts, continuations)


def _forward(validator, model_parts, rows: torch.Tensor) -> torch.Tensor | None:
    """Logits ``[rows, seq, V]`` of ``rows`` on the last stage (None on other stages)."""
    positions = torch.arange(rows.shape[1], device=rows.device).expand_as(rows)
    if not validator.parallel_dims.pp_enabled:
        inputs, _, extra = validator.post_dataloading_process(
            {"input": rows, "positions": positions}, rows, model_parts
        )
        return model_parts[0](inputs, **extra)
    mb = validator.parallelism.pipeline_parallel_microbatch_size
    args, kwargs, targets = [], [], []
    for part, where in zip(rows.split(mb), positions.split(mb), strict=True):
        inputs, labels, extra = validator.post_dataloading_process(
            {"input": part, "positions": where}, part, model_parts
        )
        args.append((inputs,))
        kwargs.append(extra)
        targets.append(labels)
    last = validator.pp_has_last_stage
    return validator.pp_schedule.eval(
        arg_mbs=args if validator.pp_has_first_stage else None,
        kwarg_mbs=kwargs,
        target_mbs=targets if last else None,
        losses=[] if last else None,
    )


def _from_last_stage(validator, chosen: torch.Tensor) -> torch.Tensor:
    """The last pipeline stage's ``chosen`` ids on every stage of the pipeline group."""
    dims = validator.parallel_dims
    if not dims.pp_enabled:
        return chosen
    group = dims.get_mesh("pp").get_group()
    dist.broadcast(chosen, group=group, group_src=dims.pp - 1)
    return chosen
