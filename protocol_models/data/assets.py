"""Fetch a tokenizer from the Hugging Face Hub into a directory TorchTitan loads.

    python -m protocol_models.assets REPO_ID [--dest DIR] [--token TOKEN] [--revision REV]

It downloads the repository's ``tokenizer.json`` (required) and, when the repository has them,
``tokenizer_config.json`` and ``special_tokens_map.json``: what TorchTitan's
``HuggingFaceTokenizer(tokenizer_path=DIR)`` reads. ``DIR`` defaults to ``assets/hf/<name>``,
``<name>`` being the part of REPO_ID after the slash (TorchTitan's own convention); a config's
``hf_assets_path`` names it.

The token is ``--token``, else huggingface_hub's own: the ``HF_TOKEN`` environment variable or
the one stored by ``hf auth login``. Public repositories need none.

The files are downloaded into a temporary directory next to DIR and moved into DIR only once
``tokenizer.json`` loads, so a failed fetch leaves DIR as it was. DIR ends up with the files
the repository has: an optional file left there by an earlier fetch, which this repository
lacks, is removed. Every failure is one ``error: ...`` line and exit code 2; an unreachable Hub
is reported after huggingface_hub's own retries (about 25 s). ``HF_ENDPOINT`` (a mirror) and
``HF_HUB_OFFLINE`` work as in huggingface_hub.

    # public: into assets/hf/gpt2
    python -m protocol_models.assets openai-community/gpt2
    # gated: accept Meta's license at https://huggingface.co/meta-llama/Llama-3.1-8B first;
    # into assets/hf/Llama-3.1-8B, with HF_TOKEN, `hf auth login`'s token, or --token hf_...
    python -m protocol_models.assets meta-llama/Llama-3.1-8B
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

import httpx
from huggingface_hub import constants, hf_hub_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import disable_progress_bars
from tokenizers import Tokenizer

from protocol_models.tools.errors import UserError

USAGE = "python -m protocol_models.assets REPO_ID [--dest DIR] [--token TOKEN] [--revision REV]"
REQUIRED = "tokenizer.json"
OPTIONAL = ("tokenizer_config.json", "special_tokens_map.json")


def default_dest(repo_id: str) -> Path:
    """``assets/hf/<name>`` for ``<org>/<name>``, where TorchTitan's own download script puts it."""
    return Path("assets", "hf", repo_id.split("/")[-1])


def fetch_tokenizer(
    repo_id: str, dest: Path, token: str | None = None, revision: str | None = None
) -> Path:
    """Download ``repo_id``'s tokenizer files into ``dest`` (created) and return ``dest``.

    Raises UserError with a one-line message on any failure; ``dest`` is then unchanged.
    """
    dest = Path(dest)
    check_writable(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    except OSError as e:
        raise UserError(f"cannot write {dest} ({reason(e)}); pass --dest DIR") from e
    try:
        files = download(repo_id, staging, dest, token, revision)
        verify(staging / REQUIRED, repo_id, dest)
        if name_separator(staging) and OPTIONAL[0] not in files:
            files.append(OPTIONAL[0])
        install(staging, files, dest)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return dest


def name_separator(folder: Path) -> str | None:
    """When ``tokenizer_config.json`` names no EOS token but the tokenizer has exactly one
    special token (GPT-2's ``<|endoftext|>``, which transformers' GPT-2 class uses for BOS and
    EOS without the repository saying so), name it as ``bos_token`` and ``eos_token`` there, so
    that TorchTitan separates documents with it. Returns the token it named, else None."""
    config_path = folder / OPTIONAL[0]
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    if config.get("eos_token"):
        return None
    added = Tokenizer.from_file(str(folder / REQUIRED)).get_added_tokens_decoder().values()
    special = [t.content for t in added if t.special]
    if len(special) != 1:
        return None
    config.setdefault("bos_token", special[0])
    config["eos_token"] = special[0]
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return special[0]


def check_writable(dest: Path) -> None:
    """Fail before downloading when ``dest`` is a file or a directory we can't write."""
    if dest.exists() and not dest.is_dir():
        raise UserError(f"{dest} is a file, not a directory; pass --dest DIR")
    if dest.is_dir() and not os.access(dest, os.W_OK | os.X_OK):
        raise UserError(f"cannot write {dest} (permission denied); pass --dest DIR")


def download(
    repo_id: str, staging: Path, dest: Path, token: str | None, revision: str | None
) -> list[str]:
    """Download the tokenizer files into ``staging``; return the names the repository had."""
    files = []
    for name in (REQUIRED, *OPTIONAL):
        try:
            hf_hub_download(repo_id, name, revision=revision, token=token, local_dir=staging)
        except RemoteEntryNotFoundError as e:
            if name == REQUIRED:
                raise UserError(
                    f"{repo_id} has no {REQUIRED} (at revision {revision or 'main'}): it holds no "
                    "Hugging Face tokenizer; pass the repository of the model itself"
                ) from e
            continue
        except (OSError, HFValidationError, httpx.HTTPError) as e:
            raise explain(e, repo_id, dest, revision) from e
        files.append(name)
    return files


def explain(error: Exception, repo_id: str, dest: Path, revision: str | None) -> UserError:
    """The one-line message, saying what to do, for an error of ``hf_hub_download``.

    Its offline and connection failures are a LocalEntryNotFoundError caused by
    OfflineModeIsEnabled or an httpx error (after huggingface_hub's own retries).
    """
    by_hand = f"copy {REQUIRED} (and {OPTIONAL[0]}) into {dest} by hand"
    if isinstance(error, GatedRepoError):
        return UserError(
            f"{repo_id} is gated: accept its license at https://huggingface.co/{repo_id} with your "
            "account, then pass --token or set HF_TOKEN"
        )
    if isinstance(error, RepositoryNotFoundError):
        return UserError(
            f"no repository {repo_id} on the Hub (or it is private: pass --token or set HF_TOKEN)"
        )
    if isinstance(error, RevisionNotFoundError):
        return UserError(
            f"{repo_id} has no revision {revision}: pass an existing branch, tag or commit to "
            "--revision, or leave it out for main"
        )
    if isinstance(error, HfHubHTTPError) and error.response.status_code == 401:
        return UserError(
            f"the Hub refused the token for {repo_id} (HTTP 401): pass a valid --token or "
            "HF_TOKEN, or none for a public repository"
        )
    if isinstance(error, HfHubHTTPError):
        return UserError(
            f"the Hub answered HTTP {error.response.status_code} for {repo_id} ({reason(error)}); "
            f"retry later, or {by_hand}"
        )
    if isinstance(error, HFValidationError):
        return UserError(f"{repo_id!r} is not a Hub repository id ({reason(error)})")
    if isinstance(error, OfflineModeIsEnabled) or isinstance(error.__cause__, OfflineModeIsEnabled):
        return UserError(
            f"HF_HUB_OFFLINE is set, so {repo_id} cannot be fetched: unset it, or {by_hand}"
        )
    if isinstance(error, (LocalEntryNotFoundError, httpx.HTTPError)):
        return UserError(
            f"cannot reach the Hugging Face Hub at {constants.ENDPOINT} to fetch {repo_id} "
            f"({reason(error.__cause__ or error)}); check the network, or {by_hand}"
        )
    return UserError(f"cannot write {dest} ({reason(error)}); pass --dest DIR")


def verify(path: Path, repo_id: str, dest: Path) -> None:
    """Raise a UserError unless the tokenizers library loads ``path``."""
    try:
        Tokenizer.from_file(str(path))
    except Exception as e:
        raise UserError(
            f"{repo_id}'s {REQUIRED} does not load with tokenizers ({reason(e)}); "
            f"{dest} was left unchanged"
        ) from e


def install(staging: Path, files: list[str], dest: Path) -> None:
    """Move ``files`` from ``staging`` into ``dest``, removing optional files it no longer has.

    Each move is a rename on one file system, so a file in ``dest`` is always whole.
    """
    try:
        dest.mkdir(exist_ok=True)
        for name in OPTIONAL:
            if name not in files:
                (dest / name).unlink(missing_ok=True)
        for name in files:
            os.replace(staging / name, dest / name)
    except OSError as e:
        raise UserError(f"cannot write {dest} ({reason(e)}); pass --dest DIR") from e


def reason(error: BaseException) -> str:
    """A short, one-line reason: the error's first line, else its type."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (a UserError), not usage + error."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message}; usage: {USAGE}")


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 fetched, 2 any failure (one ``error:`` line on stderr)."""
    parser = Parser(usage=USAGE, description=__doc__.splitlines()[0])
    parser.add_argument("repo_id", metavar="REPO_ID", help="e.g. openai-community/gpt2")
    parser.add_argument(
        "--dest", type=Path, metavar="DIR", help="default: assets/hf/<name after the slash>"
    )
    parser.add_argument("--token", help="default: HF_TOKEN, else the `hf auth login` token")
    parser.add_argument("--revision", metavar="REV", help="a branch, tag or commit (default: main)")
    disable_progress_bars()
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)  # no retry warnings: one line
    try:
        args = parser.parse_args(argv)
        dest = args.dest or default_dest(args.repo_id)
        fetch_tokenizer(args.repo_id, dest, args.token, args.revision)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = Tokenizer.from_file(str(dest / REQUIRED)).get_vocab_size(with_added_tokens=True)
    config = dest / OPTIONAL[0]
    eos = json.loads(config.read_text()).get("eos_token") if config.is_file() else None
    ends = (
        f"documents end with {eos!r}"
        if eos
        else "it names no EOS token: add eos_token (and bos_token) to its tokenizer_config.json"
    )
    print(f"fetched {args.repo_id} tokenizer ({n} tokens, with added tokens) into {dest}; {ends}")
    return 0
