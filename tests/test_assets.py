"""``python -m protocol_models.assets``: a tokenizer fetched from the Hub, or one ``error:`` line.

No test touches the network: the Hub is a fake ``hf_hub_download``, a closed local port, or
offline mode.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import httpx
import huggingface_hub
import pytest
from huggingface_hub import constants
from huggingface_hub.errors import GatedRepoError, RemoteEntryNotFoundError, RepositoryNotFoundError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torchtitan.components.tokenizer import HuggingFaceTokenizer

from protocol_models.data import assets

REPO_ID = "acme/tiny-lm"
UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused
SENTENCES = [
    "To be, or not to be, that is the question.",
    "All the world's a stage, and all the men and women merely players.",
    "Now is the winter of our discontent made glorious summer.",
]


@pytest.fixture(autouse=True)
def hub_globals():
    """``main`` silences huggingface_hub's logger and progress bars; undo it after each test."""
    logger = logging.getLogger("huggingface_hub")
    level, bars_were_off = logger.level, huggingface_hub.utils.are_progress_bars_disabled()
    yield
    logger.setLevel(level)
    if not bars_were_off:
        huggingface_hub.utils.enable_progress_bars()


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    """A real ``tokenizer.json``: a tiny byte-level BPE trained on three sentences."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    path = tmp_path / "hub" / "tokenizer.json"
    path.parent.mkdir()
    tokenizer.save(str(path))
    return path


def response(status: int, filename: str) -> httpx.Response:
    """The minimal HTTP response huggingface_hub's HTTP errors are built from."""
    url = f"https://huggingface.co/{REPO_ID}/resolve/main/{filename}"
    return httpx.Response(status, request=httpx.Request("HEAD", url))


def fake_hub(monkeypatch, files: dict[str, Path], staging_next_to: Path | None = None) -> None:
    """Serve ``files`` (repo name -> local file) as ``hf_hub_download`` does; others are 404."""

    def hf_hub_download(repo_id, filename, *, local_dir, revision=None, token=None):
        assert repo_id == REPO_ID
        if staging_next_to is not None:  # downloads land next to DEST: same file system
            assert Path(local_dir).parent == staging_next_to.parent
        if filename not in files:
            raise RemoteEntryNotFoundError("404 Entry Not Found", response=response(404, filename))
        return shutil.copy(files[filename], Path(local_dir) / filename)

    monkeypatch.setattr(assets, "hf_hub_download", hf_hub_download)


def fail_with(monkeypatch, error: Exception) -> None:
    """A Hub whose every download raises ``error``."""

    def hf_hub_download(*args, **kwargs):
        raise error

    monkeypatch.setattr(assets, "hf_hub_download", hf_hub_download)


def run_main(capsys, *args: str) -> tuple[int, str, list[str]]:
    """``main(args)``: its exit code, stdout and stderr lines."""
    code = assets.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def test_fetch_installs_what_torchtitan_loads(monkeypatch, capsys, tmp_path, tokenizer_json):
    dest = tmp_path / "assets" / "hf" / "tiny-lm"
    config = tmp_path / "hub" / "tokenizer_config.json"
    config.write_text('{"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}')
    dest.mkdir(parents=True)
    (dest / "special_tokens_map.json").write_text("{}")  # from an earlier fetch of another repo
    fake_hub(monkeypatch, {"tokenizer.json": tokenizer_json, "tokenizer_config.json": config}, dest)

    code, out, err = run_main(capsys, REPO_ID, "--dest", str(dest))

    assert (code, err) == (0, [])
    n = Tokenizer.from_file(str(tokenizer_json)).get_vocab_size(with_added_tokens=True)
    assert out == (
        f"fetched {REPO_ID} tokenizer ({n} tokens, with added tokens) into {dest}; "
        "documents end with '<|endoftext|>'\n"
    )
    assert sorted(p.name for p in dest.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert os.listdir(dest.parent) == ["tiny-lm"]  # the staging directory is gone
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(dest))
    assert tokenizer.get_vocab_size() == n
    assert tokenizer.bos_token == "<|endoftext|>"  # from tokenizer_config.json
    ids = tokenizer.encode(SENTENCES[0], add_bos=False, add_eos=False)
    assert tokenizer.decode(ids) == SENTENCES[0]


def test_default_dest_is_torchtitans(monkeypatch, capsys, tmp_path, tokenizer_json):
    """A repository like GPT-2's (no BOS/EOS in its files, one special token): the fetch names
    that token as BOS and EOS, so TorchTitan separates documents with it."""
    monkeypatch.chdir(tmp_path)
    fake_hub(monkeypatch, {"tokenizer.json": tokenizer_json})
    code, out, _ = run_main(capsys, REPO_ID)
    assert code == 0 and out.endswith("documents end with '<|endoftext|>'\n")
    dest = tmp_path / "assets" / "hf" / "tiny-lm"
    assert sorted(os.listdir(dest)) == ["tokenizer.json", "tokenizer_config.json"]
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(dest))
    assert (
        tokenizer.eos_id
        == tokenizer.bos_id
        == Tokenizer.from_file(str(tokenizer_json)).token_to_id("<|endoftext|>")
    )


@pytest.mark.parametrize(
    "error, message",
    [
        (
            GatedRepoError("403 gated", response=response(403, "tokenizer.json")),
            f"error: {REPO_ID} is gated: accept its license at https://huggingface.co/{REPO_ID} with your account, then pass --token or set HF_TOKEN",
        ),
        (
            RepositoryNotFoundError("404 repo", response=response(404, "tokenizer.json")),
            f"error: no repository {REPO_ID} on the Hub (or it is private: pass --token or set HF_TOKEN)",
        ),
        (
            RemoteEntryNotFoundError("404 entry", response=response(404, "tokenizer.json")),
            f"error: {REPO_ID} has no tokenizer.json (at revision main): it holds no Hugging Face tokenizer; pass the repository of the model itself",
        ),
    ],
    ids=["gated", "not-found", "no-tokenizer-json"],
)
def test_hub_refusal_is_one_line(monkeypatch, capsys, tmp_path, error, message):
    dest = tmp_path / "tok"
    fail_with(monkeypatch, error)
    assert run_main(capsys, REPO_ID, "--dest", str(dest)) == (2, "", [message])
    assert os.listdir(tmp_path) == []  # neither DEST nor a staging directory


def test_unreachable_hub_is_one_line(monkeypatch, capsys, caplog, tmp_path):
    # huggingface_hub reads HF_ENDPOINT at import: set it, and the constants made from it
    monkeypatch.setenv("HF_ENDPOINT", UNREACHABLE)
    monkeypatch.setattr(constants, "ENDPOINT", UNREACHABLE)
    url_template = UNREACHABLE + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url_template)
    # skip the ~23 s of back-off sleeps between huggingface_hub's retries (the retries still run)
    monkeypatch.setattr(huggingface_hub.utils._http, "time", SimpleNamespace(sleep=lambda s: None))
    dest = tmp_path / "tok"

    code, out, err = run_main(capsys, REPO_ID, "--dest", str(dest))

    assert (code, out) == (2, "")
    assert err == [
        f"error: cannot reach the Hugging Face Hub at {UNREACHABLE} to fetch {REPO_ID} "
        f"([Errno 111] Connection refused); check the network, or copy tokenizer.json "
        f"(and tokenizer_config.json) into {dest} by hand"
    ]
    assert not [r for r in caplog.records if r.name.startswith("huggingface_hub")]  # no retry log
    assert os.listdir(tmp_path) == []


def test_broken_tokenizer_json_leaves_no_dest(monkeypatch, capsys, tmp_path):
    broken = tmp_path / "hub" / "tokenizer.json"
    broken.parent.mkdir()
    broken.write_text('{"model": "truncated')
    dest = tmp_path / "assets" / "tok"
    fake_hub(monkeypatch, {"tokenizer.json": broken}, dest)

    code, out, err = run_main(capsys, REPO_ID, "--dest", str(dest))

    assert (code, out, len(err)) == (2, "", 1)
    assert err[0].startswith(f"error: {REPO_ID}'s tokenizer.json does not load with tokenizers (")
    assert err[0].endswith(f"); {dest} was left unchanged")
    assert os.listdir(dest.parent) == []


def test_dest_that_is_a_file_is_one_line(monkeypatch, capsys, tmp_path, tokenizer_json):
    dest = tmp_path / "tok"
    dest.write_text("not a directory")
    fake_hub(monkeypatch, {"tokenizer.json": tokenizer_json})
    assert run_main(capsys, REPO_ID, "--dest", str(dest)) == (
        2,
        "",
        [f"error: {dest} is a file, not a directory; pass --dest DIR"],
    )
    assert dest.read_text() == "not a directory"


def test_usage_error_is_one_line(capsys):
    assert run_main(capsys) == (
        2,
        "",
        [f"error: the following arguments are required: REPO_ID; usage: {assets.USAGE}"],
    )


def test_command_offline_prints_one_line(tmp_path):
    """The real command, in offline mode (and a closed port, should it try the network anyway)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": UNREACHABLE}
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.assets", REPO_ID],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert (result.returncode, result.stdout) == (2, ""), result.stderr
    assert result.stderr.splitlines() == [
        f"error: HF_HUB_OFFLINE is set, so {REPO_ID} cannot be fetched: unset it, or copy "
        f"tokenizer.json (and tokenizer_config.json) into assets/hf/tiny-lm by hand"
    ]
    assert not (tmp_path / "assets" / "hf" / "tiny-lm").exists()
