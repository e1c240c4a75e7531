"""Gather small Python values over a process group without pickles: JSON in a byte tensor.

torch's object collectives (``all_gather_object``, ``broadcast_object_list``, ...) unpickle what
the other ranks send, so anyone who reaches the job's ports could run code in it. The plugin's
own exchanges of small values (where each rank runs, what each node's checkpoint folder holds,
the FSDP probe's rows) go through ``all_gather_json`` instead: the value as JSON (numbers,
strings, booleans, None, lists and string-keyed dicts; a tuple comes back as a list), its UTF-8
bytes in a uint8 tensor on the group's device. (torch's own pickles -- DCP's save and load plans
-- and TorchTitan's remain; the private overlay is what protects those, docs/multinode.md.)
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.distributed as dist


def all_gather_json(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Every rank's ``value`` of ``group``, by group rank: two all-gathers, of the encodings'
    lengths ``[1]`` int64 and of the encodings padded to the longest ``[n]`` uint8."""
    device = collective_device(group)
    encoded = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    length = torch.tensor([encoded.numel()], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(dist.get_world_size(group))]
    dist.all_gather(lengths, length, group=group)
    sizes = [int(n) for n in lengths]
    padded = torch.zeros(max(sizes), dtype=torch.uint8, device=device)
    padded[: encoded.numel()] = encoded
    gathered = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(t[:n].tolist())) for t, n in zip(gathered, sizes, strict=True)]


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s collectives take their tensors: the current CUDA device for an NCCL
    group (NCCL moves device memory only), else the CPU (gloo, and the CPU emulation of NCCL)."""
    if "nccl" in str(dist.get_backend(group)) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
