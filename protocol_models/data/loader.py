"""The dataloader: any text corpus (``protocol_models.data.corpus``) -> packed token-id samples.

Every document becomes ``[BOS] tokens [EOS]``; inputs and labels are shifted inside a document
and packed into rows of ``seq_len`` tokens with per-document positions, as TorchTitan's text
dataset packs them. Data order is fixed by the corpus: documents in file order (map-style
corpora are reshuffled from their second pass on, with a fixed seed per pass).

* **Pipeline stages.** Every stage of a data-parallel replica builds the same loader with the
  same ``dp_rank`` and reads the same ids in the same order -- token ids never cross the wire.
  The trainer checks this at every log step (``data/ids_checksum``).
* **Data parallelism.** Replicas read disjoint shards (HF ``split_dataset_by_node``: contiguous
  blocks of a map-style corpus; whole files of a stream when the file count divides, else every
  n-th document).
* **Map-style corpora** (``streaming = false``) are tokenized once into
  ``<cache_dir>/<key>/`` (``.arrow`` files of int32 ids, memory-mapped, plus ``meta.json``); the
  key is a sha256 of the sources (paths, sizes, modification times), the split rule and the
  tokenizer. ``python -m protocol_models.prepare --toml CONFIG`` builds it before any worker starts
  (``scripts/train.sh`` runs it); a worker that finds no cache builds it under a file lock, so
  the ranks of one node tokenize once.
* **Streams** (``streaming = true``) are read and tokenized as training goes, by every rank:
  nothing but HF's own download cache touches the disk.
* **Resume.** The loader's state (read position, epoch, the partial row) is part of TorchTitan's
  checkpoint; a resumed run continues with the exact next sample, for streams too.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import IterableDataset
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.tokenizer import BaseTokenizer

from protocol_models.data import corpus, shakespeare
from protocol_models.tools.errors import ConfigError, DataError
from protocol_models.tools.ranges import AT_LEAST_1, OneOf, Range, Ranges

CACHE_FORMAT = 1
"""Bumped whenever the cached ids' meaning changes (invalidates every cache)."""
RESHUFFLE_SEED = 42
"""Pass ``e`` >= 1 over a map-style corpus reads it in ``shuffle(seed=RESHUFFLE_SEED + e)``
order (TorchTitan's rule)."""


class TextDataLoader(ParallelAwareDataloader):
    """TorchTitan's stateful, data-parallel-aware loader over a :class:`TokenStream`."""

    @dataclass(kw_only=True, slots=True)
    class Config(ParallelAwareDataloader.Config):
        """TOML table ``[dataloader]``: what to train on, ``files`` or ``hf_dataset``. Unset,
        the bundled Shakespeare data (``python -m protocol_models.shakespeare``)."""

        files: str | list[str] = str(shakespeare.DEFAULT_CACHE / "train.jsonl")
        """Paths, globs or URLs of ``.jsonl``/``.json``/``.parquet``/``.txt`` files (optionally
        ``.gz``/``.bz2``/``.xz``/``.zst``), one format; a directory means the files under it."""
        hf_dataset: str = ""
        """A dataset on the Hugging Face Hub, e.g. ``allenai/c4``."""
        hf_config: str | None = None
        """The Hub dataset's configuration (c4: ``en``)."""
        hf_split: str = "train"
        """The Hub dataset's split to train on."""
        text_field: str = "text"
        """The field of a json/parquet record that holds the document's text."""
        sample_by: Literal["paragraph", "line", "document"] = "paragraph"
        """What one document of a ``.txt`` file is (HF's ``text`` builder)."""
        streaming: bool = False
        """Read and tokenize as training goes (corpora larger than the disk's cache, Hub
        datasets) instead of tokenizing once into ``cache_dir``."""
        validation_files: str | list[str] = str(shakespeare.DEFAULT_CACHE / "validation.jsonl")
        """Files of the validation data (same rules as ``files``)."""
        validation_split: str = ""
        """The Hub dataset's validation split, e.g. ``validation``."""
        validation_fraction: float = 0.0
        """Or: this fraction of the corpus's documents, chosen by a hash of their text."""
        cache_dir: str = ".cache/tokens"
        """Where map-style corpora are tokenized to (one folder per corpus and tokenizer)."""
        tokenize_processes: int = 1
        """Processes that tokenize a map-style corpus into ``cache_dir``."""
        infinite: bool = True
        """Start another pass when the data runs out (TorchTitan's validator sets it: one pass
        with ``validator.steps = -1``)."""
        split: corpus.Side = "train"
        """Which part this loader reads; the validator's copy reads ``validation``."""

        RANGES: ClassVar[Ranges] = {
            "num_workers": OneOf(
                (0,),
                note="each loader worker would read the whole shard; tokenize a corpus once "
                "with tokenize_processes",
            ),
            "validation_fraction": Range(low=0, high=1, high_open=True),
            "tokenize_processes": AT_LEAST_1,
        }

        def __post_init__(self) -> None:
            sources = [k for k in ("files", "hf_dataset") if getattr(self, k)]
            if len(sources) != 1:
                raise ValueError(
                    "set exactly one of dataloader.files (paths/globs) and dataloader.hf_dataset "
                    f"(a Hub dataset id); got {sources or 'neither'}"
                )
            validation = [
                k
                for k in ("validation_files", "validation_split", "validation_fraction")
                if getattr(self, k)
            ]
            if len(validation) > 1:
                raise ValueError(f"set at most one of dataloader.{', '.join(validation)}")
            if self.validation_split and not self.hf_dataset:
                raise ValueError(
                    f"dataloader.validation_split = {self.validation_split!r} names a split of "
                    "dataloader.hf_dataset; for files use validation_files or validation_fraction"
                )

        @property
        def has_validation(self) -> bool:
            return bool(self.validation_files or self.validation_split or self.validation_fraction)

        def describe(self) -> str:
            """The corpus in a few words, for logs: ``allenai/c4 (en, streamed)``."""
            what = self.hf_dataset or ", ".join(corpus.as_list(self.files))
            notes = [n for n in (self.hf_config, "streamed" if self.streaming else "") if n]
            return f"{what} ({', '.join(notes)})" if notes else what

    def __init__(
        self,
        config: Config,
        *,
        dp_world_size: int,
        dp_rank: int,
        tokenizer: BaseTokenizer,
        seq_len: int,
        local_batch_size: int,
        snapshot_every_n_steps: int | None = 1,
        **kwargs,
    ):
        from datasets.distributed import split_dataset_by_node

        part = corpus.part_of(config, config.split)
        if config.streaming:
            documents = corpus.load(part, streaming=True)
            encode = _encoder(part, tokenizer)
        else:
            documents = tokenized(part, tokenizer, config)
            encode = _cached_ids
        stream = TokenStream(
            split_dataset_by_node(documents, dp_rank, dp_world_size),
            encode,
            seq_len=seq_len,
            infinite=config.infinite,
            name=f"{part.key} (the {config.split} part, data-parallel rank {dp_rank} of "
            f"{dp_world_size})",
        )
        loader_kwargs: dict[str, Any] = {
            "num_workers": config.num_workers,
            "persistent_workers": config.persistent_workers,
            "pin_memory": config.pin_memory,
            "prefetch_factor": config.prefetch_factor,
            "snapshot_every_n_steps": snapshot_every_n_steps,
            "batch_size": local_batch_size,
        }
        super().__init__(stream, dp_rank=dp_rank, dp_world_size=dp_world_size, **loader_kwargs)


Sample = tuple[dict[str, torch.Tensor], torch.Tensor]


class TokenStream(IterableDataset, Stateful):
    """Documents -> rows of ``seq_len`` tokens: ``({"input": [seq], "positions": [seq]},
    labels [seq])``, labels shifted by one inside each document.

    ``encode(record)`` gives a document's ids with BOS and EOS, or None for a record this part
    skips. ``documents`` is a map-style ``datasets.Dataset`` (state: records read) or a streamed
    ``IterableDataset`` (state: HF's own ``state_dict``). A pass that yields no document raises
    ``DataError`` (an empty shard would otherwise loop forever).
    """

    def __init__(
        self,
        documents,
        encode: Callable[[dict], list[int] | None],
        *,
        seq_len: int,
        infinite: bool,
        name: str,
    ):
        from datasets import Dataset

        self._original = documents
        self._documents = documents
        self._map_style = isinstance(documents, Dataset)
        self._encode = encode
        self.seq_len = seq_len
        self.infinite = infinite
        self.name = name
        self._read = 0
        self._epoch = 0
        self._resumed = False
        """Whether the next pass continues one a checkpoint interrupted."""
        self._inputs: list[int] = []
        self._labels: list[int] = []
        self._positions: list[int] = []

    def __iter__(self) -> Iterator[Sample]:
        from torchtitan.tools.logging import logger

        while True:
            documents, whole_pass = 0, not self._resumed
            self._resumed = False
            for record in self._records():
                ids = self._encode(record)
                self._read += 1
                if ids is None:
                    continue
                documents += 1
                self._inputs.extend(ids[:-1])
                self._labels.extend(ids[1:])
                self._positions.extend(range(len(ids) - 1))
                while len(self._inputs) >= self.seq_len:
                    yield self._take_row()
            if not documents and whole_pass:
                raise DataError(f"{self.name}: no documents to read")
            if not self.infinite:
                return
            self._next_epoch()
            logger.info(f"{self.name}: pass {self._epoch + 1} over the data")

    def _records(self) -> Iterator[dict]:
        if self._map_style:
            return iter(self._documents.skip(self._read))
        return iter(self._documents)

    def _take_row(self) -> Sample:
        n = self.seq_len
        inputs, labels, positions = self._inputs[:n], self._labels[:n], self._positions[:n]
        del self._inputs[:n], self._labels[:n], self._positions[:n]
        offset = positions[0]  # a document continued from the previous row starts at 0 here
        for i in range(n if offset else 0):
            if positions[i] == 0:
                break
            positions[i] -= offset
        return (
            {"input": torch.tensor(inputs), "positions": torch.tensor(positions)},
            torch.tensor(labels),
        )

    def _next_epoch(self) -> None:
        self._read = 0
        self._epoch += 1
        if self._map_style:
            self._documents = self._reshuffled()
        else:
            self._documents.set_epoch(self._epoch)

    def _reshuffled(self):
        return self._original.shuffle(seed=RESHUFFLE_SEED + self._epoch, keep_in_memory=True)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "inputs": self._inputs,
            "labels": self._labels,
            "positions": self._positions,
            "epoch": self._epoch,
        }
        if self._map_style:
            state["read"] = self._read
        else:
            state["data"] = self._documents.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._resumed = True
        self._inputs, self._labels = state["inputs"], state["labels"]
        self._positions, self._epoch = state["positions"], state["epoch"]
        if self._map_style:
            self._read = state["read"]
            if self._epoch > 0:
                self._documents = self._reshuffled()
        else:
            self._documents.set_epoch(self._epoch)
            self._documents.load_state_dict(state["data"])


def _cached_ids(record: dict) -> list[int]:
    return record["ids"]


def _encoder(part: corpus.Part, tokenizer: BaseTokenizer) -> Callable[[dict], list[int] | None]:
    """A streamed record -> its ids with BOS and EOS, or None when the part skips it (another
    part's document, or no text)."""

    def encode(record: dict) -> list[int] | None:
        if part.text_field not in record:
            raise DataError(
                f"dataloader.text_field = {part.text_field!r}: a record of {part.key} has no "
                f"such field (its fields: {sorted(record)})"
            )
        text = document_text(record[part.text_field])
        if text is None or not part.keeps(text):
            return None
        return tokenizer.encode(text, add_bos=True, add_eos=True)

    return encode


def document_text(value) -> str | None:
    """A record's text field as a document, or None when there is nothing to train on (null,
    empty or whitespace only: such a record would add only a BOS -> EOS pair)."""
    if not isinstance(value, str) or not value.strip():
        return None
    return value


def tokenized(part: corpus.Part, tokenizer: BaseTokenizer, config: TextDataLoader.Config):
    """The part's documents as token ids (a map-style ``Dataset`` with one column ``ids``),
    from ``<cache_dir>/<key>/`` -- built there first if missing, by one process at a time."""
    from datasets.exceptions import DatasetGenerationError
    from filelock import FileLock

    folder = cache_folder(part, tokenizer, config.cache_dir)
    if not (folder / "meta.json").is_file():
        folder.parent.mkdir(parents=True, exist_ok=True)
        with FileLock(f"{folder}.lock"):
            if not (folder / "meta.json").is_file():
                try:
                    _build_cache(part, tokenizer, folder, config.tokenize_processes)
                except (DatasetGenerationError, KeyError, TypeError, ValueError, OSError) as e:
                    reason = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
                    raise ConfigError(
                        f"{part.key}: cannot tokenize it ({type(e).__name__}: {reason}); "
                        f"text_field = {part.text_field!r}"
                    ) from None
    return _load_cache(folder)


def cache_folder(part: corpus.Part, tokenizer: BaseTokenizer, cache_dir: str) -> Path:
    """``<cache_dir>/<sha256 of the part's identity and the tokenizer, 16 hex digits>``."""
    key = {
        "format": CACHE_FORMAT,
        "part": part.identity(),
        "tokenizer": _tokenizer_digest(tokenizer),
    }
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return Path(cache_dir) / digest[:16]


def _tokenizer_digest(tokenizer: BaseTokenizer) -> str:
    """What fixes a document's ids: the tokenizer's own JSON and its BOS/EOS ids."""
    probe = tokenizer.encode("", add_bos=True, add_eos=True)
    return hashlib.sha256(f"{probe}\n{tokenizer.tokenizer.to_str()}".encode()).hexdigest()


def _build_cache(part: corpus.Part, tokenizer: BaseTokenizer, folder: Path, processes: int):
    """Tokenize the part into a temporary folder, then rename it to ``folder`` (a cache is
    complete or absent; ``meta.json`` is written last)."""
    import pyarrow.compute as pc
    from datasets import Features, Sequence, Value
    from torchtitan.tools.logging import logger

    start = time.perf_counter()
    num_proc = processes if processes > 1 else None
    documents = corpus.load(part, streaming=False, processes=processes)
    arrow_bytes = documents.data.nbytes
    documents = documents.filter(
        lambda batch: [
            (text := document_text(value)) is not None and part.keeps(text)
            for value in batch[part.text_field]
        ],
        batched=True,
        num_proc=num_proc,
        desc=f"{part.key}: documents of this part",
    )

    def encode(batch: dict[str, list]) -> dict[str, list]:
        texts = batch[part.text_field]
        return {"ids": [tokenizer.encode(t, add_bos=True, add_eos=True) for t in texts]}

    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp-", dir=folder.parent))
    try:
        ids = documents.map(
            encode,
            batched=True,
            remove_columns=documents.column_names,
            features=Features({"ids": Sequence(Value("int32"))}),
            num_proc=num_proc,
            cache_file_name=str(tmp / "ids.arrow"),
            new_fingerprint=folder.name,
            desc=f"tokenizing {part.key}",
        )
        tokens = pc.sum(pc.list_value_length(ids.data.column("ids"))).as_py() or 0
        meta = {
            "part": part.identity(),
            "documents": len(ids),
            "tokens": tokens,
            "arrow_bytes": arrow_bytes,
            "seconds": round(time.perf_counter() - start, 3),
            "processes": processes,
        }
        del ids, documents
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(folder)
        except OSError:  # another node finished first (a shared cache_dir without flock)
            if not (folder / "meta.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; else a failed build
    logger.info(
        f"{part.key}: tokenized {meta['documents']} documents, {tokens} tokens in "
        f"{meta['seconds']} s into {folder}"
    )


def _load_cache(folder: Path):
    """The cached ids, memory-mapped (one ``.arrow`` file per tokenizing process, in order)."""
    from datasets import Dataset, concatenate_datasets

    files = sorted(folder.glob("ids*.arrow"))
    parts = [Dataset.from_file(str(f)) for f in files]
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def cache_summary(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "meta.json").read_text())


def prepare(config) -> list[str]:
    """Everything ``config`` reads, made ready before any worker starts: the bundled
    Shakespeare data when it is read, and the token-id cache of every map-style part. Returns
    one line per part saying what is where."""
    loader = config.dataloader
    sides: list[corpus.Side] = ["train"]
    if config.validator.enable and loader.has_validation:
        sides.append("validation")
    if reads_bundled_data(config):
        shakespeare.prepare(shakespeare.DEFAULT_CACHE)
    if loader.streaming:
        return [f"{loader.describe()}: tokenized while training"]
    tokenizer = config.tokenizer.build(tokenizer_path=config.hf_assets_path)
    lines = []
    for side in sides:
        part = corpus.part_of(loader, side)
        folder = cache_folder(part, tokenizer, loader.cache_dir)
        tokenized(part, tokenizer, loader)
        meta = cache_summary(folder)
        if not meta["documents"]:
            raise ConfigError(
                f"{part.key}: the {side} part holds no documents"
                + (" (validation_fraction too small?)" if part.keep != "all" else "")
            )
        lines.append(
            f"{side}: {meta['documents']} documents, {meta['tokens']} tokens in {folder} "
            f"(tokenized in {meta['seconds']} s)"
        )
    return lines


def reads_bundled_data(config) -> bool:
    """Whether the config's corpus or tokenizer is the bundled Shakespeare data."""
    loader = config.dataloader
    return is_bundled_path(config.hf_assets_path) or any(
        is_bundled(loader, side) for side in ("train", "validation")
    )


def is_bundled(loader: TextDataLoader.Config, side: corpus.Side) -> bool:
    """Whether the ``side`` part of the corpus is (among) the bundled files."""
    files = loader.validation_files if side == "validation" else loader.files
    return any(is_bundled_path(p) for p in corpus.as_list(files))


def is_bundled_path(path: str) -> bool:
    """Whether ``path`` lies in the bundled data's folder."""
    if corpus.is_remote(path):
        return False
    bundled = shakespeare.DEFAULT_CACHE.resolve()
    return bundled in (Path(path).resolve(), *Path(path).resolve().parents)


def bundled_data_pending(config) -> bool:
    """Whether the config reads the bundled data and it is not prepared yet."""
    prepared = (shakespeare.DEFAULT_CACHE / "tokenizer" / "tokenizer.json").is_file()
    return not prepared and reads_bundled_data(config)
