"""A quick look at what a model learned: continue a prompt.

    python -m protocol_models.generate --hf DIR | --checkpoint DIR [--step N] [--toml FILE]
        --prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]

The prompt is tokenized as training tokenized documents (the run's tokenizer, with BOS) and
continued by ``transformers``' ``generate``: greedy with ``--temperature 0`` (the default), else
sampled at that temperature from the ``--top-k`` most likely tokens (0: all) within the top-p
nucleus, reproducibly for a given ``--seed``. A briefly trained model's greedy continuation is
often its most frequent token over and over (newlines after the quick start's 200 steps);
sampling shows what it learned.
Generation stops at the tokenizer's EOS or after ``--max-new-tokens``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from protocol_models.hf import cli
from protocol_models.hf.hf_model import add_source_arguments, load_causal_lm, model_folder
from protocol_models.tools.errors import UserError

USAGE = (
    "python -m protocol_models.generate (--hf DIR | --checkpoint DIR [--step N] [--toml FILE]) "
    "--prompt TEXT [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]"
)


@torch.no_grad()
def continue_text(
    model,
    folder: Path,
    prompt: str,
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    seed: int,
    top_k: int = 0,
) -> str:
    """The text ``model`` appends to ``prompt`` (tokenizer: the one in ``folder``); ``top_k``
    0 samples from the whole top-p nucleus."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(folder))
    ids = torch.tensor([tokenizer.encode(prompt, add_bos=True, add_eos=False)])
    torch.manual_seed(seed)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.eos_id,
        **(sampling if temperature > 0 else {"do_sample": False}),
    )
    new = out[0, ids.shape[1] :].tolist()
    return tokenizer.decode([t for t in new if t != tokenizer.eos_id])


def _check_sampling(args: argparse.Namespace) -> None:
    """One line naming the first out-of-range generation option and the value it got."""
    bounds = [
        ("--temperature", args.temperature, args.temperature >= 0, ">= 0 (0: greedy)"),
        ("--top-k", args.top_k, args.top_k >= 0, ">= 0 (0: no top-k cut)"),
        ("--top-p", args.top_p, 0 < args.top_p <= 1, "in (0, 1]"),
        ("--max-new-tokens", args.max_new_tokens, args.max_new_tokens >= 1, ">= 1"),
    ]
    for name, value, ok, allowed in bounds:
        if not ok:
            raise UserError(f"{name} must be {allowed}; got {value}")


def _main(args: argparse.Namespace) -> None:
    _check_sampling(args)
    with model_folder(args) as folder:
        model = load_causal_lm(folder)
        text = continue_text(
            model,
            folder,
            args.prompt,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            top_k=args.top_k,
        )
    print(args.prompt + text)


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m protocol_models.generate", usage=USAGE)
    add_source_arguments(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0: no top-k cut")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 generated, 2 bad input (one ``error:`` line on stderr)."""
    return cli.run(_main, parser(), argv)
