"""One message per microbatch and direction: every tensor a stage sends over a boundary for one
microbatch (a codec's codes and scales, the link simulator's clock stamp) packed into one buffer.

On a slow link every message costs at least one latency, and under gloo's receiver-driven TCP
transport a message whose receive is posted late costs two; sending a codec's payload as one
message instead of one per tensor keeps that cost at one message per microbatch.

A ``MessageLayout`` is known to both sides before anything is sent (the receiver builds it from
the codec's ``spec`` and its receive buffer), so the message carries no header: its parts lie
in the buffer ordered by descending element size, which puts every part at an offset its own
element size divides (sizes are powers of two), so each part is a typed view of the received
bytes, with no padding and no copy. The stamp, when there is one, is a float64 first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Part = tuple[torch.Size, torch.dtype]
"""The shape and dtype of one tensor in a message."""


@dataclass(frozen=True)
class MessageLayout:
    """The parts of one message, in the order the codec produces and consumes them, and whether
    a float64 clock stamp travels with them.

    A layout of one part without a stamp is ``direct``: that tensor itself is sent and received
    (no packing); any other is packed into one ``uint8`` buffer of ``nbytes`` bytes."""

    parts: tuple[Part, ...]
    stamped: bool = False

    @property
    def direct(self) -> bool:
        return len(self.parts) == 1 and not self.stamped

    @property
    def payload_bytes(self) -> int:
        """Bytes of the parts (the stamp excluded: it exists only under the simulator)."""
        return sum(shape.numel() * dtype.itemsize for shape, dtype in self.parts)

    @property
    def nbytes(self) -> int:
        return self.payload_bytes + (STAMP_DTYPE.itemsize if self.stamped else 0)

    def _wire_order(self) -> list[int]:
        """Part indices in buffer order: descending element size, then as given."""
        return sorted(range(len(self.parts)), key=lambda i: -self.parts[i][1].itemsize)

    def pack(self, parts: list[torch.Tensor], stamp: torch.Tensor | None = None) -> torch.Tensor:
        """The one buffer to send: ``stamp`` (float64 ``[1]``, iff ``stamped``) then ``parts``
        in wire order, as bytes on the parts' device. A ``direct`` layout sends its part."""
        if self.direct:
            return parts[0]
        pieces = [stamp] if self.stamped else []
        pieces += [parts[i] for i in self._wire_order()]
        return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in pieces])

    def empty(self, device: torch.device) -> torch.Tensor:
        """A receive buffer for one message (a ``direct`` layout: a tensor of its one part)."""
        if self.direct:
            shape, dtype = self.parts[0]
            return torch.empty(shape, dtype=dtype, device=device)
        return torch.empty(self.nbytes, dtype=torch.uint8, device=device)

    def unpack(self, buffer: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """Views of ``buffer`` (from ``empty``, filled by the wire): the parts in codec order
        and the stamp (None unless ``stamped``)."""
        if self.direct:
            return [buffer], None
        offset, stamp = 0, None
        if self.stamped:
            stamp = buffer[: STAMP_DTYPE.itemsize].view(STAMP_DTYPE)
            offset = STAMP_DTYPE.itemsize
        views: list[torch.Tensor | None] = [None] * len(self.parts)
        for i in self._wire_order():
            shape, dtype = self.parts[i]
            n = shape.numel() * dtype.itemsize
            views[i] = buffer[offset : offset + n].view(dtype).view(shape)
            offset += n
        return views, stamp  # type: ignore[return-value]


STAMP_DTYPE = torch.float64
"""The simulator's sender clock (``time.time()``) travels as one float64."""
