"""Tokenization cost: how long a first start takes per GB of text, and what a stream costs a rank.

    python -m recipes.data_throughput            # a 256 MB corpus (~5 min on a 2-core CPU)
    python -m recipes.data_throughput --quick    # 16 MB, to exercise the harness

The corpus is the bundled Shakespeare training text repeated (each copy's documents prefixed with
the copy number, so every document is distinct) into jsonl files of 16 MB; the tokenizer is the
bundled 8,192-token byte-level BPE. Measured with ``protocol_models.data.loader``, as a run uses it:

* **first start** (``streaming = false``): HF's Arrow conversion of the text plus tokenization
  into ``cache_dir``, with ``tokenize_processes`` = 1 and 2, and the validation hash split on;
* **later starts**: opening the cached ids (what every worker of every later run does);
* **streaming** (``streaming = true``): rows of 1,024 tokens a single rank produces per second
  while reading and tokenizing the stream itself.

Writes ``results/data/{results.json,throughput.png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from recipes.common import REPO, repo_relative

OUT = REPO / "results" / "data"
FILE_MB = 16
SEQ_LEN = 1024


def write_corpus(folder: Path, megabytes: int) -> int:
    """``megabytes`` of jsonl in ``FILE_MB`` files; returns the text bytes written."""
    from protocol_models.data import shakespeare

    with open(REPO / shakespeare.DEFAULT_CACHE / "train.jsonl") as f:
        documents = [json.loads(line)["text"] for line in f]
    folder.mkdir(parents=True)
    written, copy, shard = 0, 0, 0
    out = open(folder / f"part-{shard:04d}.jsonl", "w")
    while written < megabytes * 2**20:
        for text in documents:
            line = json.dumps({"text": f"[{copy}] {text}"}) + "\n"
            out.write(line)
            written += len(line.encode())
            if out.tell() >= FILE_MB * 2**20:
                out.close()
                shard += 1
                out = open(folder / f"part-{shard:04d}.jsonl", "w")
        copy += 1
    out.close()
    return written


def first_start(loader_config, tokenizer, processes: int) -> dict:
    """Tokenize the train part into a fresh cache (HF's Arrow copy of the text included)."""
    from protocol_models.data import corpus
    from protocol_models.data import loader as data

    config = replace(loader_config, tokenize_processes=processes)
    part = corpus.part_of(config, "train")
    start = time.perf_counter()
    data.tokenized(part, tokenizer, config)
    seconds = time.perf_counter() - start
    meta = data.cache_summary(data.cache_folder(part, tokenizer, config.cache_dir))
    start = time.perf_counter()
    data.tokenized(part, tokenizer, config)
    return {
        "processes": processes,
        "seconds": seconds,
        "documents": meta["documents"],
        "tokens": meta["tokens"],
        "later_start_seconds": time.perf_counter() - start,
    }


def streaming_rate(loader_config, tokenizer, rows: int) -> dict:
    """Rows of ``SEQ_LEN`` tokens per second one rank reads and tokenizes from the stream."""
    from protocol_models.data.loader import TextDataLoader

    loader = TextDataLoader(
        replace(loader_config, streaming=True),
        dp_world_size=1, dp_rank=0, tokenizer=tokenizer, seq_len=SEQ_LEN, local_batch_size=1,
    )  # fmt: skip
    iterator = iter(loader)
    next(iterator)  # opening the stream is not part of the rate
    start = time.perf_counter()
    for _ in range(rows):
        next(iterator)
    seconds = time.perf_counter() - start
    return {"rows": rows, "seconds": seconds, "tokens_per_s": rows * SEQ_LEN / seconds}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    runs = results["first_start"]
    left.bar([f"{r['processes']} proc." for r in runs], [r["seconds_per_gb"] for r in runs])
    left.set_ylabel("first start: seconds per GB of text")
    left.set_title("tokenize once into cache_dir")
    stream = results["streaming"]
    right.bar(["one rank"], [stream["tokens_per_s"]])
    right.set_ylabel("tokens / s")
    right.set_title(f"streaming, rows of {SEQ_LEN} tokens")
    fig.suptitle(f"{results['corpus_mb']:.0f} MB corpus, {results['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    megabytes = 16 if args.quick else 256
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from protocol_models.data import shakespeare
    from protocol_models.data.loader import TextDataLoader

    shakespeare.prepare(REPO / shakespeare.DEFAULT_CACHE)
    tokenizer = HuggingFaceTokenizer(
        tokenizer_path=str(REPO / shakespeare.DEFAULT_CACHE / "tokenizer")
    )
    work = Path(tempfile.mkdtemp(prefix="data_throughput-"))
    hf_cache = work / "hf"
    os.environ["HF_DATASETS_CACHE"] = str(hf_cache)  # a cold HF cache for every measurement
    try:
        text_bytes = write_corpus(work / "corpus", megabytes)
        runs = []
        for processes in (1, 2):
            shutil.rmtree(hf_cache, ignore_errors=True)
            config = TextDataLoader.Config(
                files=str(work / "corpus" / "*.jsonl"), validation_files="",
                validation_fraction=0.01, cache_dir=str(work / f"tokens{processes}"),
            )  # fmt: skip
            run = first_start(config, tokenizer, processes)
            run["seconds_per_gb"] = run["seconds"] / (text_bytes / 1e9)
            runs.append(run)
            print(
                f"first start, {processes} process(es): {run['seconds']:.1f} s "
                f"({run['seconds_per_gb']:.0f} s/GB), later: {run['later_start_seconds']:.2f} s"
            )
        stream = streaming_rate(config, tokenizer, rows=50 if args.quick else 400)
        print(f"streaming: {stream['tokens_per_s']:,.0f} tokens/s on one rank")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = {
        "command": "python -m recipes.data_throughput" + (" --quick" if args.quick else ""),
        "machine": f"{os.cpu_count()}-core {platform.machine()} CPU",
        "corpus_mb": text_bytes / 2**20,
        "text_bytes": text_bytes,
        "tokenizer": repo_relative(REPO / shakespeare.DEFAULT_CACHE / "tokenizer"),
        "first_start": runs,
        "streaming": stream,
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    plot(results, OUT / "throughput.png")
    print(f"wrote {repo_relative(OUT / 'results.json')} and throughput.png")


if __name__ == "__main__":
    main()
