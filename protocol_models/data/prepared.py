"""A text corpus prepared once: documents packed from whole units of text, the training
documents shuffled into one fixed order, both splits written as JSONL and a byte-level BPE
tokenizer of ``VOCAB_SIZE`` tokens trained on the training split with HF ``tokenizers``. The
bundled Shakespeare data (``shakespeare``) is prepared with it."""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

DOC_CHARS = 4000
SHUFFLE_SEED = 0
VOCAB_SIZE = 8192
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def pack(units: list[str], source: str, separator: str) -> list[dict[str, str]]:
    """Whole units (paragraphs, sentences) joined by ``separator`` and packed greedily into
    documents of about ``DOC_CHARS`` characters (a unit longer than that is one document)."""
    docs, current = [], ""
    for unit in units:
        if current and len(current) + len(unit) > DOC_CHARS:
            docs.append(current)
            current = ""
        current = f"{current}{separator}{unit}" if current else unit
    if current:
        docs.append(current)
    return [{"text": d, "source": source} for d in docs]


def write_splits(cache: Path, train: list[dict], validation: list[dict]) -> None:
    """Shuffle the training documents with ``SHUFFLE_SEED`` (one token order for every run),
    write both splits as JSONL under ``cache`` and train the tokenizer on the training split;
    the tokenizer is written last, so its presence marks a finished preparation."""
    cache.mkdir(parents=True, exist_ok=True)
    random.Random(SHUFFLE_SEED).shuffle(train)
    _write_jsonl(cache / "train.jsonl", train)
    _write_jsonl(cache / "validation.jsonl", validation)
    _train_tokenizer([d["text"] for d in train], cache / "tokenizer")


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def _train_tokenizer(texts: list[str], out: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "model_max_length": 1 << 20}, indent=2)
    )


def main(prepare: Callable[[Path], Path], default_cache: Path, doc: str) -> None:
    """The command line of a corpus's ``prepare``: ``[--cache DIR]``, described by the first
    paragraph of its module's ``doc``."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=default_cache)
    print(f"prepared {prepare(parser.parse_args().cache)}")
