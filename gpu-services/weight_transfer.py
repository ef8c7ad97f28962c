"""Moving weights from the actor to engines over a one-off torch.distributed group.

The actor is rank 0 and every engine a rank >= 1 of a group made from a TCPStore (gloo on CPU, NCCL
on GPU), apart from the actor's own training group. Weights travel in buckets: each bucket is one
flat uint8 tensor holding its tensors back to back in spec order, broadcast from rank 0.
"""
import os
import socket
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from contract import TensorSpec


def plan_buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors in order into buckets of at most bucket_bytes (a larger tensor gets its own)."""
    buckets: list[list[TensorSpec]] = [[]]
    size = 0
    for name, t in named:
        n = t.numel() * t.element_size()
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(TensorSpec(name=name, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape)))
        size += n
    return [b for b in buckets if b]


# A peer that dies mid-push leaves the others blocked in a collective until this runs out, and the
# refit waits for them; one bucket (<= 512 MiB at ~1 GB/s on gloo, far faster on NCCL) takes seconds.
TIMEOUT_S = float(os.environ.get("MOLT_TRANSFER_TIMEOUT_S", "30"))


def listen(host: str) -> socket.socket:
    """Rank 0's store socket on a free port of `host`: a TCPStore given no socket listens on every interface."""
    return socket.create_server((host, 0))


def open_group(master_addr: str, master_port: int, world_size: int, rank: int, backend: str,
               timeout_s: float = TIMEOUT_S, server: socket.socket | None = None) -> dist.ProcessGroup:
    """Returns once every rank has joined (or raises after timeout_s): the whole rendezvous happens here,
    so a caller can wait for it without holding anything. NCCL would otherwise connect lazily, inside
    the first broadcast; the store barrier below makes both backends rendezvous here. Rank 0 passes
    `server` (from listen()), the socket its store serves on; the store owns it from then on."""
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=(rank == 0),
                          timeout=timedelta(seconds=timeout_s),
                          master_listen_fd=server.detach() if server is not None else None)
    store.set(f"joined/{rank}", "1")
    store.wait([f"joined/{r}" for r in range(world_size)])
    if backend == "nccl":
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


def _nbytes(spec: TensorSpec) -> int:
    dtype = getattr(torch, spec.dtype)
    n = 1
    for d in spec.shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def send_bucket(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> int:
    """Rank 0: pack and broadcast one bucket. Returns the bytes sent."""
    flat = torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])
    group.broadcast(flat, 0).wait()
    return flat.numel()


def recv_bucket(group: dist.ProcessGroup, specs: list[TensorSpec], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank >= 1: receive one bucket and yield its tensors by name."""
    flat = torch.empty(sum(_nbytes(s) for s in specs), dtype=torch.uint8, device=device)
    group.broadcast(flat, 0).wait()
    offset = 0
    for s in specs:
        n = _nbytes(s)
        yield s.name, flat[offset:offset + n].view(getattr(torch, s.dtype)).reshape(s.shape)
        offset += n
