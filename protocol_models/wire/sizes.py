"""The one size model of a boundary message, for every boundary method.

A message carries one microbatch ``[mb, seq, d]`` across one boundary in one direction:

* a boundary method (``protocol_models.model.boundary``): the stage output in the compute dtype,
  ``BoundaryMethod.width`` features per token (``subspace``: the k coordinates ``c``, or with
  ``[codec] bits`` their quantized payload; ``dense``: the stream ``x``, d wide; ``resbm``: the
  bottleneck ``b``, h wide);
* a lossy codec: its packed payload, ``Codec.payload_bytes`` (equal to the tensors it sends).

The planner, the wire meter's dense reference and the recipes' byte tables all call this.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from protocol_models.model.boundary import BOUNDARIES
from protocol_models.wire.codecs import Codec


def message_bytes(
    mode: str,
    shape: Sequence[int],
    dtype: torch.dtype,
    direction: str,
    *,
    k: int,
    codec: Codec | None = None,
) -> int:
    """Bytes of one ``direction`` (``fwd``/``bwd``) message of a ``shape`` ``[mb, seq, d]``
    boundary in ``dtype`` under ``mode`` (``codec``: the mode's codec, ``wire.codecs.build_codec``;
    in ``subspace`` mode it acts on ``[mb, seq, k]``)."""
    if mode in BOUNDARIES:
        shape = (*shape[:-1], BOUNDARIES[mode].width(shape[-1], k))
    if codec is not None:
        return codec.payload_bytes(torch.Size(shape), dtype, direction)
    return math.prod(shape) * dtype.itemsize
