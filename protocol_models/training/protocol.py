"""The ``[protocol]`` table: which boundary method a run trains and the subspace it is built on.

``mode`` is one of ``protocol_models.wire.modes()``: the exact subspace wire, the dense twin, or a
registered lossy codec. The model (``protocol_models.model.model``) reads the subspace settings; the
wire (``protocol_models.wire``) the mode's codec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from protocol_models.model.boundary import BOUNDARIES, anchored
from protocol_models.tools.errors import require
from protocol_models.tools.ranges import AT_LEAST_1, POSITIVE, SEED, OneOf, Range, Ranges
from protocol_models.wire import modes
from protocol_models.wire.rvq import CODEBOOK_SIZES

Parametrization = Literal["factor", "full"]
"""How the constrained writers are stored (``protocol_models.model.model``): ``factor`` (W = U A) or
``full`` (full-width W kept in span(U) by the optimizer)."""


@dataclass(kw_only=True, slots=True)
class ProtocolSettings:
    """The compressed-boundary method (TOML table ``[protocol]``)."""

    mode: str = "subspace"
    """``subspace``: boundaries carry k coordinates; ``projected``: the same k coordinates,
    with full-width writers and the projection at the boundary only; ``dense``: the
    unconstrained d-wide twin;
    ``resbm``/``mapl``: a learned boundary (``protocol_models.model.boundary``);
    a codec's name (``topk``, ``quant``, ``lowrank``, ``svd``, ...: ``wire.codecs.CODECS``): the
    dense twin with that lossy boundary codec (parameters in ``[codec]``)."""
    k: int = 8
    """Subspace rank: coordinates per token per boundary."""
    seed: int = 1234
    """Seed of U and F; identical on every stage and node (never the training seed)."""
    stages: int | None = None
    """Pipeline layout the constraint is built for (default: parallelism.pipeline_parallel_degree).
    Set it on a 1-process run to build the exact model an S-stage run trains."""
    basis_file: str = ""
    """A safetensors file whose tensor ``basis`` ``[model.dim, k]`` (fp32, orthonormal columns)
    is U, read by every stage (the same file on every node: the stages compare U's digest at
    start-up), e.g. the principal subspace of a dense pilot's boundary stream
    (``python -m protocol_models.pilot_basis``). "" (the default): U drawn from ``seed``. F is
    drawn from ``seed`` either way; subspace updates start from the file's U."""
    table_dtype: Literal["float32", "bfloat16"] = "float32"
    """Storage dtype of F on every stage (V x d: 2.1 GB fp32 at LLaMA-3 8B sizes, half in bf16).
    The codec always computes in fp32; bf16 storage rounds F once, identically on every stage."""
    update_every: int = 0
    """Rotate U on the Grassmann manifold every N optimizer steps (0: U stays the seeded basis).
    See ``protocol_models.training.grassmann``."""
    update_angle_deg: float = 5.0
    """Largest principal angle between U and U' at each update (a normalized geodesic step)."""
    parametrization: Parametrization = "factor"
    """Set from ``[optimizer] name`` (not a TOML key): ``full`` for adamw_rowwise/adamw_project."""
    anchor_rank: int = 8
    """``mapl`` mode: m, the inner width of each boundary's anchor embeddings ``P [V, m] Q [m, d]``
    (``protocol_models.model.mapl``)."""
    projection_lr: float = 0.01
    """``mapl`` mode: the step of the learned projections U on the Stiefel manifold
    (``optimizers.StiefelMuon``: about the largest rotation, in radians, per step)."""
    rvq_stages: int = 0
    """``mapl`` mode: L, residual vector quantizer stages on the coordinates (0: the wire carries
    ``c`` in the compute dtype; see ``protocol_models.wire.rvq``)."""
    rvq_codebook: int = 256
    """``mapl`` with RVQ: K, codes per codebook (4, 16 or 256: 2, 4 or 8 bits per index)."""
    rvq_decay: float = 0.99
    """``mapl`` with RVQ: the EMA decay of the codebooks' k-means statistics."""
    stage_tables: bool = False
    """``projected`` mode: every stage after the first adds its own learned token table
    ``[V, d]`` (zero at the start) to the stream it rebuilds, as the first stage adds its
    embedding: zero bytes on the wire (no stage needs another's table), ``V d`` parameters per
    stage. ``dense`` mode: the same tables, added to the stream each stage receives (the fair
    twin of a projected run with tables: the same parameters, no projection)."""
    layers_per_stage: list[int] | None = None
    """Blocks per pipeline stage, in stage order (default: near-equal, earlier stages take the
    remainder). One entry per stage of the layout, each >= 1, summing to ``model.n_layers``.
    The last stage also holds the final norm and the LM head, so a balanced split usually gives
    it fewer blocks (``python -m protocol_models.plan --propose-split``)."""

    RANGES: ClassVar[Ranges] = {
        "mode": OneOf(modes),
        "k": AT_LEAST_1,
        "seed": SEED,
        "stages": AT_LEAST_1,
        "update_every": Range(low=0, note="0 = no updates"),
        "update_angle_deg": Range(low=0, high=90, low_open=True),
        "anchor_rank": AT_LEAST_1,
        "projection_lr": POSITIVE,
        "rvq_stages": Range(low=0, note="0 = no quantizer"),
        "rvq_codebook": OneOf(CODEBOOK_SIZES),
        "rvq_decay": Range(low=0, high=1, high_open=True),
        "layers_per_stage": Range(low=1, note="every stage needs at least one block"),
    }

    def __post_init__(self) -> None:
        every = self.update_every
        require(
            every == 0 or self.mode == "subspace",
            f"protocol.update_every = {every}: subspace updates need protocol.mode = 'subspace' "
            f"(got {self.mode!r})",
        )
        require(
            not self.basis_file or anchored(self.mode),
            f"protocol.basis_file = {self.basis_file!r}: a basis file needs protocol.mode = "
            f"{' or '.join(repr(m) for m, b in BOUNDARIES.items() if b.anchored)} "
            f"(got {self.mode!r})",
        )
        require(
            not self.stage_tables or self.mode in ("projected", "dense"),
            f"protocol.stage_tables = true: needs protocol.mode = 'projected' or 'dense' (got "
            f"{self.mode!r})",
        )
        if self.rvq_stages:
            self._check_rvq()

    def _check_rvq(self) -> None:
        require(
            self.mode == "mapl",
            f"protocol.rvq_stages = {self.rvq_stages}: needs protocol.mode = 'mapl' "
            f"(got {self.mode!r}); 0 = no quantizer",
        )
        per_byte = 8 // int(math.log2(self.rvq_codebook))
        require(
            self.rvq_stages % per_byte == 0,
            f"protocol.rvq_stages = {self.rvq_stages}: must be 0 or a positive multiple of "
            f"{per_byte} (protocol.rvq_codebook = {self.rvq_codebook}: {8 // per_byte}-bit "
            "indices, bit-packed)",
        )


__all__ = ["Parametrization", "ProtocolSettings"]
