"""After training: the exported Hugging Face LLaMA computes what the plugin's model computes.

In-process (no training): checkpoints of perturbed tiny models in every mode, U rotated away from
the seeded basis as subspace updates leave it, with GQA (2 kv heads), are exported and loaded with
``transformers``; the logits must equal the plugin's forward (max relative difference <= 1e-4),
and the same comparison must fail when the export skips the rotary permutation, drops F or reads
the seeded U instead of the checkpoint's. Bad input is one ``error:`` line and writes nothing.

Trained: the 1-process and 4-stage GPipe runs of ``seeded_runs(4)`` (shared with the exactness
tests), and a ``full`` (adamw_rowwise) and a dense run, each checkpointed and validated after its
last step: exported logits equal the plugin's forward on the checkpoint, ``evaluate`` reproduces
the logged validation loss, and the 4-stage export equals the 1-process one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO, SAMPLE_PROMPTS, TINY, VALIDATE_AT_END, torchrun
from safetensors.torch import load_file
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

from protocol_models.config.run_config import load_config
from protocol_models.hf import evaluate, export, fold, generate
from protocol_models.hf.checkpoint_files import TABLE_SHA256, CheckpointTensors
from protocol_models.hf.hf_model import load_causal_lm
from protocol_models.model import subspace
from protocol_models.training import run_record
from protocol_models.training.metrics import read_jsonl
from protocol_models.training.run_record import RunRecord

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
MODES = {
    "factor": [],
    "full": ["--optimizer.name", "adamw_rowwise"],
    "factor, bf16 F": ["--protocol.table_dtype", "bfloat16"],
    "dense": ["--protocol.mode", "dense"],
    "lowrank": ["--protocol.mode", "lowrank"],
}


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, 64), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def _relative_difference(model, hf_folder) -> float:
    """max |HF logits - plugin logits| / max |plugin logits| on two rows of 64 random ids."""
    ids = _ids(model.config.vocab_size)
    ref = model.eval()(ids, token_ids=ids)
    got = load_causal_lm(hf_folder)(ids).logits
    return float((got - ref).abs().max() / ref.abs().max())


def _synthetic(folder, overrides: list[str], basis_in_checkpoint: str = "trained"):
    """A checkpoint (``folder/checkpoint/step-5`` + run.json) of a tiny model with perturbed
    weights and a rotated U; returns the model (lossy modes: the dense model, whose codec lives
    on the wire and is not part of the export) and the checkpoint folder."""
    config = load_config(
        str(TINY), ["--model.n_kv_heads", "2", *overrides], check_environment=False
    )
    record = RunRecord.from_config(config)
    torch.manual_seed(0)
    model = record.model_config().build()
    model.init_states()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
        if model.subspace:
            seeded = model.basis.clone()
            model.basis.copy_(subspace.orthonormalize(seeded + 0.5 * torch.randn_like(seeded)))
        state = model.state_dict()
        if basis_in_checkpoint == "seeded":
            state["basis"] = seeded
        if model.subspace:  # as ProtocolTrainer.state_dict stores it
            state[TABLE_SHA256] = torch.frombuffer(bytearray(model.table_sha256), dtype=torch.uint8)
    dcp.save(state, checkpoint_id=str(folder / "checkpoint" / "step-5"), no_dist=True)
    (folder / "checkpoint" / run_record.RECORD_NAME).write_text(record.to_json())
    return model, folder / "checkpoint"


@pytest.mark.parametrize("mode", list(MODES))
def test_export_of_every_mode_equals_the_plugin_forward(tmp_path, mode):
    model, checkpoint = _synthetic(tmp_path, MODES[mode])
    assert export.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]) == 0
    assert _relative_difference(model, tmp_path / "hf") <= 1e-4


def test_a_checkpoint_without_record_exports_with_the_runs_toml(tmp_path):
    model, checkpoint = _synthetic(tmp_path, [])
    (checkpoint / run_record.RECORD_NAME).unlink()
    args = ["--checkpoint", str(checkpoint / "step-5"), "--out", str(tmp_path / "hf")]
    assert export.main([*args, "--toml", str(TINY), "--model.n_kv_heads", "2"]) == 0
    assert _relative_difference(model, tmp_path / "hf") <= 1e-4


def test_a_sharded_export_loads(tmp_path):
    model, checkpoint = _synthetic(tmp_path, MODES["full"])
    args = ["--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]
    assert export.main([*args, "--max-shard-bytes", "1000000"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert _relative_difference(model, tmp_path / "hf") <= 1e-4


def test_the_export_keeps_the_checkpoint_dtype_unless_told(tmp_path):
    model, checkpoint = _synthetic(tmp_path, [])
    state = {n: t.bfloat16() if n != "basis" else t for n, t in model.state_dict().items()}
    dcp.save(state, checkpoint_id=str(checkpoint / "step-6"), no_dist=True)
    assert export.main(["--checkpoint", str(checkpoint), "--out", str(tmp_path / "bf16")]) == 0
    args = ["--checkpoint", str(checkpoint), "--step", "5", "--dtype", "bfloat16"]
    assert export.main([*args, "--out", str(tmp_path / "told")]) == 0
    for out in ("bf16", "told"):
        assert json.loads((tmp_path / out / "config.json").read_text())["torch_dtype"] == "bfloat16"
        weights = load_file(tmp_path / out / "model.safetensors")
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}


def _no_permutation(monkeypatch):
    monkeypatch.setattr(Llama3StateDictAdapter, "_permute", lambda self, w, *args: w)


def _no_token_table(monkeypatch):
    real = subspace.generate

    def without_table(*args, **kwargs):
        basis, table, digest = real(*args, **kwargs)
        return basis, torch.zeros_like(table), digest

    monkeypatch.setattr(subspace, "generate", without_table)


@pytest.mark.parametrize(
    ("broken", "mode"),
    [
        ("rotary permutation skipped", "dense"),
        ("F not added", "factor"),
        ("seeded U, not the trained one", "factor"),
    ],
)
def test_the_comparison_fails_when_the_export_is_wrong(tmp_path, monkeypatch, broken, mode):
    """The equality above is not vacuous: each way of getting the fold or the layout wrong
    moves the logits far outside its tolerance."""
    basis = "seeded" if broken.startswith("seeded U") else "trained"
    model, checkpoint = _synthetic(tmp_path, MODES[mode], basis_in_checkpoint=basis)
    if broken == "rotary permutation skipped":
        _no_permutation(monkeypatch)
    if broken == "F not added":
        _no_token_table(monkeypatch)
    export.export(checkpoint / "step-5", run_record.read(checkpoint), tmp_path / "hf")
    assert _relative_difference(model, tmp_path / "hf") > 1e-2


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """One synthetic factor checkpoint folder for the bad-input cases."""
    return _synthetic(tmp_path_factory.mktemp("bad"), [])[1]


def _bad_record(checkpoint, tmp_path, change: dict):
    """A copy of ``checkpoint`` whose run.json is changed by ``change``."""
    copy = tmp_path / "copy"
    shutil.copytree(checkpoint, copy)
    record = json.loads((copy / run_record.RECORD_NAME).read_text())
    for key, value in change.items():
        section, _, field = key.partition(".")
        if field:
            record[section][field] = value
        else:
            record[section] = value
    (copy / run_record.RECORD_NAME).write_text(json.dumps(record))
    return copy


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing checkpoint", "no such folder"),
        ("missing step", "--step 7: "),
        ("out not empty", "exists and is not an empty folder"),
        ("other layout", "records checkpoint layout 0"),
        ("another model's record", "'basis' has shape [64, 4], the run record's model has [64, 8]"),
        ("no run record", "pass --toml"),
        ("another seed's record", "protocol.seed = 8 (table_dtype float32) generates is not"),
        ("bad dtype", "argument --dtype: invalid choice"),
        ("out under a file", "cannot write it"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(checkpoint, tmp_path, capsys, case, expected):
    out = tmp_path / "out" / "hf"
    args = ["--checkpoint", str(checkpoint), "--out", str(out)]
    if case == "missing checkpoint":
        args[1] = str(tmp_path / "nowhere")
    elif case == "missing step":
        args += ["--step", "7"]
    elif case == "out not empty":
        out.mkdir(parents=True)
        (out / "keep.txt").write_text("mine")
    elif case == "other layout":
        args[1] = str(_bad_record(checkpoint, tmp_path, {"layout": 0}))
    elif case == "another model's record":
        args[1] = str(_bad_record(checkpoint, tmp_path, {"protocol.k": 8}))
    elif case == "another seed's record":
        args[1] = str(_bad_record(checkpoint, tmp_path, {"protocol.seed": 8}))
    elif case == "no run record":
        copy = _bad_record(checkpoint, tmp_path, {})
        (copy / run_record.RECORD_NAME).unlink()
        args[1] = str(copy)
    elif case == "bad dtype":
        args += ["--dtype", "float16"]
    elif case == "out under a file":
        out.parent.mkdir()
        (out.parent / "a-file").write_text("mine")
        args[3] = str(out.parent / "a-file" / "hf")
    before = sorted(p.name for p in (tmp_path / "out").iterdir()) if out.parent.exists() else None

    assert export.main(args) == 2
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert captured.out == ""
    after = sorted(p.name for p in (tmp_path / "out").iterdir()) if out.parent.exists() else None
    assert after == before  # no output folder, no temporary folder left behind
    if case == "out not empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize("mode", ["resbm", "mapl", "projected"])
def test_a_learned_boundary_checkpoint_is_refused_with_one_line(tmp_path, capsys, mode):
    """ResBM's encoder and decoder, MAPL's projections and anchors, the projection onto
    F + span(U) have no place in a LLaMA: export and generate (through its temporary export)
    answer one line and write nothing."""
    _, checkpoint = _synthetic(tmp_path, ["--protocol.mode", mode])
    for main, extra in ((export.main, ["--out", str(tmp_path / "hf")]),
                        (generate.main, ["--prompt", "x"])):  # fmt: skip
        assert main(["--checkpoint", str(checkpoint), *extra]) == 2
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == 1 and f"error: protocol.mode = {mode!r}" in lines[0], lines
    assert not (tmp_path / "hf").exists()


def test_the_command_line_answers_bad_input_with_one_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "protocol_models.export", "--checkpoint", str(tmp_path / "x"),
         "--out", str(tmp_path / "out")],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith("error: --checkpoint") and not (tmp_path / "out").exists()


# --- trained runs ---------------------------------------------------------------------------


@pytest.fixture(scope="session")
def trained(tmp_path_factory, seeded_runs):
    """Dump folders of tiny runs, each checkpointed and validated after its 3rd step."""
    single, piped = seeded_runs(4)
    root = tmp_path_factory.mktemp("trained")
    common = ["--protocol.stages", "2", "--checkpoint.enable", *VALIDATE_AT_END]
    torchrun(1, root / "full", *common, *MODES["full"], "--model.n_kv_heads", "2")
    torchrun(1, root / "dense", *common, *MODES["dense"])
    return {"factor, 1 process": single, "factor, 4 stages": piped, "full": root / "full",
            "dense": root / "dense"}  # fmt: skip


def _plugin_model(checkpoint_folder):
    """The plugin's own model, loaded from the run's latest checkpoint (DCP gathers stages)."""
    record = run_record.read(checkpoint_folder)
    model_config = record.model_config()
    model = model_config.build()
    model.init_states()  # U, F from the seed; then every stored tensor, U included
    step = max(checkpoint_folder.glob("step-*"))
    model.load_state_dict(CheckpointTensors(step).load(list(fold.expected_shapes(model_config))))
    return model


@pytest.mark.parametrize("run", ["factor, 4 stages", "full", "dense"])
def test_trained_export_equals_plugin_and_validation_loss(trained, tmp_path, capsys, run):
    dump = trained[run]
    out = tmp_path / "hf"
    assert export.main(["--checkpoint", str(dump / "checkpoint"), "--out", str(out)]) == 0
    assert _relative_difference(_plugin_model(dump / "checkpoint"), out) <= 1e-4

    config = json.loads((out / "config.json").read_text())
    kv_heads = 2 if run == "full" else 4
    assert {k: config[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "intermediate_size", "vocab_size", "rms_norm_eps",
            "rope_theta", "rope_scaling", "tie_word_embeddings", "max_position_embeddings")} == {
        "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": kv_heads, "intermediate_size": 256, "vocab_size": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": None,
        "tie_word_embeddings": False, "max_position_embeddings": 64,
    }  # fmt: skip

    capsys.readouterr()
    source = ["--checkpoint", str(dump / "checkpoint")] if run == "dense" else ["--hf", str(out)]
    assert evaluate.main(source) == 0
    loss = float(capsys.readouterr().out.split()[1])
    logged = read_jsonl(dump / "validation.jsonl")[-1]
    assert logged["step"] == 3
    assert loss == pytest.approx(logged["validation_metrics/loss"], rel=1e-5, abs=1e-6)


def test_four_stage_export_equals_in_process_export(trained, tmp_path):
    """The same model trained by 4 GPipe processes and in one process (``protocol.stages = 4``)
    from one seed checkpoint exports to the same files. The weights agree to 1e-5 absolute
    (they are O(1e-2), and each of the 3 AdamW steps moves an entry by up to lr = 3e-3): the two
    layouts sum gradients in different orders (~1e-7 relative), and AdamW's normalized step
    turns that into up to ~3e-6 (measured) on entries with tiny second moments."""
    exports = {}
    for run in ("factor, 1 process", "factor, 4 stages"):
        checkpoint = trained[run] / "checkpoint"
        out = tmp_path / run.replace(", ", "-").replace(" ", "-")
        export.export(max(checkpoint.glob("step-*")), run_record.read(checkpoint), out)
        exports[run] = out
    single, piped = exports.values()
    assert (single / "config.json").read_text() == (piped / "config.json").read_text()
    a, b = load_file(single / "model.safetensors"), load_file(piped / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-5), name


def test_samples_at_validation_are_the_exported_models_greedy_continuations(
    trained, tmp_path, capsys
):
    """``[metrics] sample_prompts``: the continuations the 1-process and the 4-stage runs logged
    after step 3 are equal, and equal to ``generate``'s greedy continuation by the export."""
    logged = {
        run: [r for r in read_jsonl(trained[run] / "samples.jsonl") if r["step"] == 3]
        for run in ("factor, 1 process", "factor, 4 stages")
    }
    single, piped = logged.values()
    assert [r["prompt"] for r in piped] == SAMPLE_PROMPTS and single == piped
    checkpoint = trained["factor, 4 stages"] / "checkpoint"
    export.export(max(checkpoint.glob("step-*")), run_record.read(checkpoint), tmp_path / "hf")
    model = load_causal_lm(tmp_path / "hf")
    for record in piped:
        text = generate.continue_text(model, tmp_path / "hf", record["prompt"], max_new_tokens=8,
                                      temperature=0.0, top_p=1.0, seed=0)  # fmt: skip
        assert text == record["continuation"]
    capsys.readouterr()
    prompt = ["--hf", str(tmp_path / "hf"), "--prompt", piped[0]["prompt"], "--max-new-tokens", "8"]
    assert generate.main(prompt) == 0
    assert capsys.readouterr().out == piped[0]["prompt"] + piped[0]["continuation"] + "\n"
    sampled = [generate.main([*prompt, "--temperature", "0.8", "--top-p", "0.9"]) for _ in "ab"]
    first, second = capsys.readouterr().out.splitlines()
    assert sampled == [0, 0] and first == second  # the same --seed (default 0), the same text
    assert generate.main([*prompt, "--temperature", "-1"]) == 2
    assert capsys.readouterr().err.startswith("error: --temperature must be >= 0")


def test_generate_top_k(capsys):
    """``--top-k 1`` keeps only the most likely token, so sampling at any temperature is the
    greedy continuation (a tiny random LLaMA and the bundled tokenizer); a negative
    ``--top-k`` is one ``error:`` line naming it, before any model is loaded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = REPO / ".cache" / "shakespeare" / "tokenizer"
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2)).eval()  # fmt: skip
    common = {"max_new_tokens": 12, "top_p": 1.0, "seed": 3}
    greedy = generate.continue_text(model, folder, "ROMEO:", temperature=0.0, **common)
    top1 = generate.continue_text(model, folder, "ROMEO:", temperature=5.0, top_k=1, **common)
    assert top1 == greedy
    wide = [generate.continue_text(model, folder, "ROMEO:", temperature=5.0, top_k=40, **common)
            for _ in "ab"]  # fmt: skip
    assert wide[0] == wide[1] != greedy  # one seed, one text; 40 candidates, another text
    assert generate.main(["--hf", "nowhere", "--prompt", "x", "--top-k", "-1"]) == 2
    assert capsys.readouterr().err == "error: --top-k must be >= 0 (0: no top-k cut); got -1\n"
