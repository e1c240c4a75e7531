"""What a ``[dataloader]`` table reads, as HF ``datasets`` loads it.

A corpus is either

* ``files``: paths, globs or URLs (``hf://datasets/...``, ``https://...``, any fsspec protocol)
  of one format -- ``.jsonl``/``.json``, ``.parquet`` or ``.txt``, optionally compressed
  (``.gz``, ``.bz2``, ``.xz``, ``.zst``); a local directory stands for every corpus file under
  it (all of one format); or
* ``hf_dataset``: a dataset on the Hugging Face Hub (``allenai/c4``), with ``hf_config`` (its
  configuration name, c4's ``en``) and ``hf_split``.

Its validation part is ``validation_files``, ``validation_split`` (a Hub dataset's split) or
``validation_fraction``: the documents whose text hashes (blake2b) below that fraction. The hash
rule puts a document on the same side in every run, layout, order and sharding, and duplicates of a
validation document never reach training.

Every function here is pure bookkeeping over paths and HF calls; ``protocol_models.data.loader``
turns a :class:`Part` into token ids.
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from protocol_models.tools.errors import ConfigError, require

FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text"}
"""File suffix -> HF ``datasets`` builder."""
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
"""Suffixes HF ``datasets`` decompresses on the fly (json and text only)."""
Side = Literal["train", "validation"]


@dataclass(frozen=True)
class Part:
    """One side of a corpus, as HF ``load_dataset`` reads it."""

    key: str
    """The TOML key that names it, for error messages (``dataloader.files``)."""
    builder: str
    """``json`` / ``parquet`` / ``text`` for files, else the Hub dataset id."""
    data_files: tuple[str, ...] | None
    """Resolved local files (sorted) or remote URLs/globs; None for a Hub dataset."""
    hf_config: str | None
    split: str
    text_field: str
    sample_by: str
    keep: Literal["all", "train", "validation"]
    """Which documents of the source this part keeps (by the hash rule)."""
    fraction: float
    """The validation fraction the hash rule uses (0 with ``keep = "all"``)."""

    @property
    def from_hub(self) -> bool:
        return self.data_files is None

    def keeps(self, text: str) -> bool:
        """Whether this part holds a document with this text."""
        if self.keep == "all":
            return True
        return in_validation(text, self.fraction) == (self.keep == "validation")

    def identity(self) -> dict[str, Any]:
        """What the token ids of this part depend on (a cache key): the sources -- local files
        with their size and modification time --, the split and the document rule."""
        sources: list[Any] = []
        for path in self.data_files or ():
            if is_remote(path):
                sources.append(path)
            else:
                stat = os.stat(path)
                sources.append([os.path.abspath(path), stat.st_size, stat.st_mtime_ns])
        return {
            "builder": self.builder,
            "sources": sources,
            "hf_config": self.hf_config,
            "split": self.split,
            "text_field": self.text_field,
            "sample_by": self.sample_by,
            "keep": self.keep,
            "fraction": self.fraction,
        }


def in_validation(text: str, fraction: float) -> bool:
    """The hash rule: a document is validation data iff the first 8 bytes of the blake2b of
    its UTF-8 text, read as a fraction of 2**64, are below ``fraction``."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64


def as_list(value: str | list[str]) -> list[str]:
    """A TOML value that is one path or a list of paths, as a list (``""`` -> ``[]``)."""
    if isinstance(value, str):
        return [value] if value else []
    return list(value)


def is_remote(path: str) -> bool:
    return "://" in path


def part_of(loader, side: Side) -> Part:
    """The ``side`` part of the corpus a ``TextDataLoader.Config`` names, with its local files
    resolved (raises ``ConfigError`` naming the key for a bad path or format)."""
    validation_files = as_list(loader.validation_files)
    fraction = loader.validation_fraction
    if side == "validation" and not loader.has_validation:
        raise ConfigError("[dataloader] names no validation data")
    keep: Literal["all", "train", "validation"] = "all"
    if side == "validation" and validation_files:
        key, patterns, split = "dataloader.validation_files", validation_files, "train"
    elif side == "validation" and loader.validation_split:
        key, patterns, split = "dataloader.validation_split", None, loader.validation_split
    else:
        key = "dataloader.files" if loader.files else "dataloader.hf_dataset"
        patterns = as_list(loader.files) or None
        split = "train" if patterns else loader.hf_split
        keep = side if fraction > 0 else "all"
    if patterns is None:
        builder, data_files, text_field = loader.hf_dataset, None, loader.text_field
    else:
        data_files = tuple(resolve_files(patterns, key))
        builder = file_format(data_files, key)
        text_field = "text" if builder == "text" else loader.text_field
    return Part(
        key=key,
        builder=builder,
        data_files=data_files,
        hf_config=loader.hf_config if patterns is None else None,
        split=split,
        text_field=text_field,
        sample_by=loader.sample_by,
        keep=keep,
        fraction=fraction if keep != "all" else 0.0,
    )


def resolve_files(patterns: list[str], key: str) -> list[str]:
    """Local globs and directories -> the sorted files they name (each must be a readable,
    non-empty file); remote paths are kept as given (HF resolves them when it loads)."""
    files: list[str] = []
    for pattern in patterns:
        if is_remote(pattern):
            files.append(pattern)
            continue
        path = Path(pattern).expanduser()
        if path.is_dir():
            found = sorted(
                str(p)
                for p in path.rglob("*")
                if p.is_file() and _suffix(p.name) in FORMATS and not p.name.startswith(".")
            )
            require(found, f"{key} = {pattern!r}: no {'/'.join(FORMATS)} files in that directory")
        elif glob.has_magic(str(path)):
            found = sorted(p for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
            require(found, f"{key} = {pattern!r}: the glob matches no files")
        else:
            require(path.exists(), f"{key} = {pattern!r}: no such file")
            found = [str(path)]
        for file in found:
            require(os.access(file, os.R_OK), f"{key}: {file} is not readable (permission denied)")
            require(os.path.getsize(file) > 0, f"{key}: {file} is empty")
        files.extend(found)
    return files


def file_format(files: tuple[str, ...], key: str) -> str:
    """The one HF builder that reads all ``files`` (by suffix)."""
    builders = set()
    for file in files:
        suffix = _suffix(file)
        if suffix not in FORMATS:
            raise ConfigError(
                f"{key}: {file} is not a corpus file (expected {', '.join(FORMATS)}, "
                f"optionally compressed {', '.join(COMPRESSIONS)})"
            )
        builders.add(FORMATS[suffix])
    require(len(builders) == 1, f"{key}: mixes formats {sorted(builders)}; use one per list")
    return builders.pop()


def _suffix(name: str) -> str:
    """``a.jsonl.gz`` -> ``.jsonl`` (``.parquet`` files are never compressed as a whole)."""
    path = Path(name.split("?")[0])
    if path.suffix in COMPRESSIONS and Path(path.stem).suffix != ".parquet":
        path = Path(path.stem)
    return path.suffix.lower()


def load(part: Part, *, streaming: bool, first_file_only: bool = False, processes: int = 1):
    """The part's documents through HF ``load_dataset`` (map-style: an Arrow copy of the text
    in HF's cache, ``HF_DATASETS_CACHE``, made by ``processes`` processes; streaming: read as
    iterated). The hash rule is not applied here."""
    from datasets import load_dataset

    kwargs: dict[str, Any] = {"split": part.split, "streaming": streaming}
    if not streaming and processes > 1:
        kwargs["num_proc"] = processes
    if part.from_hub:
        return load_dataset(part.builder, name=part.hf_config, **kwargs)
    files = list(part.data_files[:1] if first_file_only else part.data_files)
    if part.builder == "text":
        kwargs["sample_by"] = part.sample_by
    return load_dataset(part.builder, data_files=files, **kwargs)


def check_readable(part: Part) -> None:
    """Read the first document of a part's first local file: the file parses and holds the text
    field as a string (one ``ConfigError`` line otherwise). Hub datasets and remote files are
    checked when a worker opens them."""
    if part.from_hub or is_remote(part.data_files[0]):
        return
    first = part.data_files[0]
    logging.disable(logging.ERROR)  # HF logs a parser's failure before raising it
    try:
        record = next(iter(load(part, streaming=True, first_file_only=True)), None)
    except Exception as e:  # any parser's error: the message is what the user needs
        reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{part.key}: cannot read {first} as {part.builder}: {reason}") from None
    finally:
        logging.disable(logging.NOTSET)
    require(record is not None, f"{part.key}: {first} holds no documents")
    fields = sorted(record)
    require(
        part.text_field in record,
        f"dataloader.text_field = {part.text_field!r}: {first} has no such field "
        f"(its fields: {fields})",
    )
    require(
        isinstance(record[part.text_field], str),
        f"dataloader.text_field = {part.text_field!r}: in {first} it holds "
        f"{type(record[part.text_field]).__name__}, not text",
    )


def check_disjoint(train: Part, validation: Part) -> None:
    """No file named by ``validation_files`` is training data too (e.g. a directory that holds
    both). A fraction split reads the same files on purpose: the hash rule keeps them apart."""
    if validation.key != "dataloader.validation_files":
        return
    shared = sorted(set(train.data_files or ()) & set(validation.data_files or ()))
    require(
        not shared,
        f"{validation.key}: {len(shared)} file(s) are also in {train.key} (e.g. {shared[:1]}); "
        "training would see the validation data",
    )


def check_hub_dataset(repo_id: str) -> None:
    """A Hub dataset exists and this node may read it (one ``ConfigError`` line otherwise): a
    streamed corpus is read from the Hub by every worker, so a node that cannot reach it would
    only fail once its workers start."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return
    try:
        HfApi().dataset_info(repo_id, timeout=10)
    except GatedRepoError:
        raise ConfigError(
            f"dataloader.hf_dataset = {repo_id!r} is gated: accept its terms at "
            f"https://huggingface.co/datasets/{repo_id}, then set HF_TOKEN"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"dataloader.hf_dataset = {repo_id!r}: no such dataset on the Hub (or it is "
            "private: set HF_TOKEN)"
        ) from None
    except Exception as e:  # no route, DNS, a proxy, a rate limit
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        fix = (
            "set HF_TOKEN (the Hub rate-limits anonymous requests)"
            if "429" in reason
            else "let every node reach huggingface.co (or a mirror: HF_ENDPOINT), or train "
            "from local copies (dataloader.files)"
        )
        raise ConfigError(
            f"dataloader.hf_dataset = {repo_id!r}: the Hugging Face Hub is unreachable from "
            f"this node ({reason}); every node streams the corpus from it: {fix}"
        ) from None
