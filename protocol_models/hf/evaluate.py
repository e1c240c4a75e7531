"""Held-out loss and perplexity of an exported model, on the tokens training validation reads.

    python -m protocol_models.evaluate --hf DIR | --checkpoint DIR [--step N] [--toml FILE]
        [--text FILE] [--seq-len N] [--batch-size N] [--steps N]

The rows come from the project's own loader (``protocol_models.data.loader``: ``[BOS] doc [EOS]``
documents packed into rows of ``seq_len``, labels shifted inside each document) over the run's
validation data -- the ``[dataloader]`` of the run record an export carries -- or over ``--text
FILE`` (any file format ``[dataloader] files`` reads). The loss is TorchTitan's validation loss:
the cross-entropy summed over every label, divided by the number of labels, over ``--steps``
batches of ``--batch-size`` rows (defaults: the run's ``[validator] steps`` and
``[training] local_batch_size``; -1 reads the whole file). On the run's validation data it
equals the ``validation_metrics/loss`` the run logged at the checkpoint's step.

With the causal ``sdpa`` attention the rows' positions are ``0..seq_len-1``, as in training; a run
with per-document masks (``flex``/``varlen``) passes each document's positions as
``position_ids``.
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from protocol_models.hf import cli
from protocol_models.hf.hf_model import (
    add_source_arguments,
    folder_record,
    load_causal_lm,
    model_folder,
)
from protocol_models.tools.errors import UserError
from protocol_models.training.run_record import RunRecord

USAGE = (
    "python -m protocol_models.evaluate (--hf DIR | --checkpoint DIR [--step N] [--toml FILE]) "
    "[--text FILE] [--seq-len N] [--batch-size N] [--steps N]"
)
IGNORE_INDEX = -100


@dataclass(frozen=True, slots=True)
class Evaluation:
    loss: float
    """Mean cross-entropy per label (nats)."""
    tokens: int
    rows: int

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


@torch.no_grad()
def evaluate(model, batches: Iterator, per_document_positions: bool) -> Evaluation:
    """The token-mean cross-entropy of ``model`` (a causal LM returning ``.logits``
    ``[batch, seq, V]``) over ``batches`` of ``({"input", "positions"} [batch, seq], labels
    [batch, seq])``, summed in fp32 as TorchTitan's loss does."""
    total, tokens, rows = torch.zeros((), dtype=torch.float64), 0, 0
    for inputs, labels in batches:
        positions = inputs["positions"] if per_document_positions else None
        logits = model(input_ids=inputs["input"], position_ids=positions).logits
        loss = F.cross_entropy(
            logits.flatten(0, 1).float(),
            labels.flatten(0, 1),
            reduction="sum",
            ignore_index=IGNORE_INDEX,
        )
        total += loss.double()
        tokens += int((labels != IGNORE_INDEX).sum())
        rows += labels.shape[0]
    if not tokens:
        raise UserError(
            "no full row of tokens to evaluate: use a longer text or a shorter --seq-len"
        )
    return Evaluation(loss=float(total / tokens), tokens=tokens, rows=rows)


def batches(
    folder: Path, record: RunRecord | None, args: argparse.Namespace
) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """The rows ``args`` name, from ``protocol_models.data.loader``'s loader, tokenized with the
    export's tokenizer (the run's)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from protocol_models.data.loader import TextDataLoader

    if args.text:
        loader = TextDataLoader.Config(
            files=args.text, validation_files="", streaming=True, infinite=False
        )
    elif record is None:
        raise UserError(f"{folder} carries no run record (run.json): pass --text FILE")
    else:
        loader = TextDataLoader.Config(
            **{**record.dataloader, "split": "validation", "infinite": False}
        )
        if not loader.has_validation:
            raise UserError("the run names no validation data ([dataloader]): pass --text FILE")
    seq_len = args.seq_len or (record.seq_len if record else None)
    if seq_len is None:
        raise UserError(f"{folder} carries no run record (run.json): pass --seq-len N")
    batch_size = args.batch_size or (record.local_batch_size if record else 1)
    steps = args.steps if args.steps is not None else _default_steps(record, args)
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(folder))
    data = TextDataLoader(
        loader,
        dp_world_size=1,
        dp_rank=0,
        tokenizer=tokenizer,
        seq_len=seq_len,
        local_batch_size=batch_size,
    )
    for step, batch in enumerate(data):
        if steps != -1 and step >= steps:
            return
        yield batch


def per_document_positions(record: RunRecord | None) -> bool:
    """Whether the run's rows carry per-document positions to pass as ``position_ids``: with
    per-document masks (``flex``/``varlen``); causal ``sdpa`` rows see ``0..seq_len-1``."""
    return record is not None and record.model.attention != "sdpa"


def add_row_arguments(parser: cli.Parser) -> None:
    """Which rows ``batches`` reads: ``--text FILE``, ``--seq-len``, ``--batch-size``,
    ``--steps``."""
    parser.add_argument("--text", metavar="FILE", help="default: the run's validation data")
    parser.add_argument("--seq-len", type=int, metavar="N", help="default: the run's")
    parser.add_argument("--batch-size", type=int, metavar="N", help="default: the run's")
    parser.add_argument("--steps", type=int, metavar="N", help="batches (-1: all)")


def _default_steps(record: RunRecord | None, args: argparse.Namespace) -> int:
    """The run's ``[validator] steps`` on its validation data, else the whole text."""
    return record.validation_steps if record and not args.text else -1


def _main(args: argparse.Namespace) -> None:
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")  # torchdata's
    with model_folder(args) as folder:
        record = folder_record(folder)
        model = load_causal_lm(folder)
        result = evaluate(model, batches(folder, record, args), per_document_positions(record))
    source = args.text or "the run's validation data"
    print(
        f"loss {result.loss:.6f}  perplexity {result.perplexity:.4f}  "
        f"({result.tokens} tokens in {result.rows} rows, {source})"
    )


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m protocol_models.evaluate", usage=USAGE)
    add_source_arguments(p)
    add_row_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 evaluated, 2 bad input (one ``error:`` line on stderr)."""
    return cli.run(_main, parser(), argv)
