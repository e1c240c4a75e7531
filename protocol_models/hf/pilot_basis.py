"""A data-driven U: the principal subspace of a trained (e.g. short dense pilot) run's boundary
stream, written as a basis file for ``[protocol] basis_file``.

    python -m protocol_models.pilot_basis (--hf DIR | --checkpoint DIR [--step N] [--toml FILE])
        --k K --out FILE.safetensors [--text FILE] [--seq-len N] [--batch-size N] [--steps N]

The model runs over the run's validation rows, or better over training text (``--text``: the
validation rows then stay unseen by the basis; the rows, ``--steps`` and batch size as
``protocol_models.evaluate`` reads them). At each pipeline boundary of the run's layout the
blocks' writes ``x - E[t]`` (``hf.streams``) are accumulated into one second moment, whose top-``k``
eigenspace (``model.spectrum.principal_basis``) is saved as the fp32 tensor ``basis`` ``[d, k]``,
with the source, the boundaries, the vectors used and the share of their energy the subspace
holds in the file's metadata. The file is written next to ``--out`` and renamed into place:
never half written. Every node of the run that reads it needs the same file.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from protocol_models.hf import cli
from protocol_models.hf.evaluate import add_row_arguments, batches, per_document_positions
from protocol_models.hf.hf_model import (
    add_source_arguments,
    folder_record,
    load_causal_lm,
    model_folder,
)
from protocol_models.hf.streams import boundary_blocks, boundary_moment
from protocol_models.model.spectrum import energy_share, principal_basis
from protocol_models.model.subspace import BASIS_KEY
from protocol_models.tools.errors import UserError

USAGE = (
    "python -m protocol_models.pilot_basis (--hf DIR | --checkpoint DIR [--step N] "
    "[--toml FILE]) --k K --out FILE.safetensors [--text FILE] [--seq-len N] [--batch-size N] "
    "[--steps N]"
)


def _main(args: argparse.Namespace) -> None:
    from safetensors.torch import save_file

    out = Path(args.out)
    if args.k < 1:
        raise UserError(f"--k {args.k}: must be >= 1")
    if not out.parent.is_dir():
        raise UserError(f"--out {out}: no folder {out.parent}")
    with model_folder(args) as folder:
        record = folder_record(folder)
        if record is None:
            raise UserError(f"{folder} carries no run record (run.json): no boundaries known")
        blocks = boundary_blocks(record)
        if not blocks:
            raise UserError(f"the run's layout has one stage ({record.stages}): no boundary")
        if args.k > record.model.dim:
            raise UserError(f"--k {args.k}: must be at most model.dim = {record.model.dim}")
        model = load_causal_lm(folder)
        rows = batches(folder, record, args)
        moment, vectors = boundary_moment(model, rows, blocks, per_document_positions(record))
    if vectors < args.k:
        raise UserError(f"{vectors} vectors cannot span k = {args.k} dimensions: read more rows")
    share = energy_share(moment, args.k)
    metadata = {
        "source": str(args.hf or args.checkpoint),
        "boundaries_after_blocks": str(blocks),
        "vectors": str(vectors),
        "energy_share": f"{share:.6f}",
    }
    staging = out.with_name(f".{out.name}.partial")
    save_file({BASIS_KEY: principal_basis(moment, args.k)}, str(staging), metadata=metadata)
    os.replace(staging, out)
    print(
        f"U [{record.model.dim}, {args.k}] from {vectors} vectors at the boundaries after "
        f"blocks {blocks}: the subspace holds {share:.1%} of their energy; wrote {out}"
    )


def parser() -> cli.Parser:
    p = cli.Parser(prog="python -m protocol_models.pilot_basis", usage=USAGE)
    add_source_arguments(p)
    p.add_argument("--k", type=int, required=True, help="the basis's columns: [protocol] k")
    p.add_argument("--out", required=True, metavar="FILE", help="the basis file to write")
    add_row_arguments(p)
    return p


def main(argv: list[str] | None = None) -> int:
    """Exit codes: 0 written, 2 bad input (one ``error:`` line on stderr)."""
    return cli.run(_main, parser(), argv)
