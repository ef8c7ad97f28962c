"""Moving weights from the actor to engines over a torch.distributed group that outlives a push.

The actor is rank 0 and every engine a rank >= 1 of a group made from a TCPStore (gloo on CPU, NCCL on GPU),
apart from the actor's own training group. The group is made at the first push to a set of engines and kept while
that set stays the same, so a refit costs no rendezvous. At each later push every engine checks in through the
store before anything is sent; one that does not hold the group (it restarted) answers NotInGroup instead, and the
actor makes a new group.

Weights travel in buckets, broadcast from rank 0, each one flat uint8 tensor: a lone tensor as it is (no copy, and
received straight into the engine's weight), several small ones packed back to back in spec order.
"""
import math
import os
import socket
from datetime import timedelta
from typing import Iterable, Iterator

import torch
import torch.distributed as dist

from contract import NotInGroup, TensorSpec, WeightReceiveRequest


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
# refit waits for them; one bucket (the largest tensor, at ~0.3 GB/s on gloo here, far faster on NCCL) takes seconds.
TIMEOUT_S = float(os.environ.get("MOLT_TRANSFER_TIMEOUT_S", "30"))


def listen(host: str) -> socket.socket:
    """Rank 0's store socket on a free port of `host`: a TCPStore given no socket listens on every interface."""
    return socket.create_server((host, 0))


def open_group(master_addr: str, master_port: int, world_size: int, rank: int, backend: str,
               timeout_s: float = TIMEOUT_S, server: socket.socket | None = None) -> tuple[dist.Store, dist.ProcessGroup]:
    """Returns (store, group) once every rank has joined (or raises after timeout_s): the whole rendezvous happens
    here, so a caller can wait for it without holding anything. NCCL would otherwise connect lazily, inside the
    first broadcast; the store barrier below makes both backends rendezvous here. Rank 0 passes `server` (from
    listen()), the socket its store serves on; the store owns it from then on."""
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=(rank == 0),
                          timeout=timedelta(seconds=timeout_s),
                          master_listen_fd=server.detach() if server is not None else None)
    store.set(f"joined/{rank}", "1")
    store.wait([f"joined/{r}" for r in range(world_size)])
    if backend == "nccl":
        return store, dist.ProcessGroupNCCL(store, rank, world_size)
    return store, dist.ProcessGroupGloo(store, rank, world_size, timedelta(seconds=timeout_s))


class Membership:
    """An engine's place in the actor's transfer group, kept from one push to the next."""

    def __init__(self):
        self.id, self.store, self.group = None, None, None

    def group_for(self, req: WeightReceiveRequest) -> dist.ProcessGroup:
        """The group to receive req's buckets in, ready for the broadcast: joined now when req.join (the rendezvous
        holds no lock: an actor that died before it must not hold up the next push), else the kept one, after
        checking in (push req.seq) and being told to go."""
        if req.join:
            store, group = open_group(req.master_addr, req.master_port, req.world_size, req.rank, req.backend)
            self.leave()
            self.id, self.store, self.group = req.group, store, group
            return group
        if self.group is None or req.group != self.id:
            raise NotInGroup(f"this engine does not hold transfer group {req.group!r} (it restarted or left it)")
        self.store.set(f"ready/{req.seq}/{req.rank}", "1")
        if self.store.get(f"go/{req.seq}") != b"1":
            raise NotInGroup(f"the actor called push {req.seq} off (another engine was not in the group)")
        return self.group

    def leave(self) -> None:
        """Drop the group (a failed push leaves it in an unknown state; weights loaded otherwise may differ from
        what the actor last sent): the actor's next push finds NotInGroup and makes a new one."""
        if self.group is not None:
            self.group.shutdown()  # frees its connections (NCCL communicators on GPU)
        self.id, self.store, self.group = None, None, None


def check_in(store: dist.Store, seq: int, world_size: int) -> bool:
    """Rank 0, kept group: whether every engine has checked in for push seq (see Membership.group_for)."""
    return store.check([f"ready/{seq}/{r}" for r in range(1, world_size)])


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * getattr(torch, spec.dtype).itemsize


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def send_bucket(group: dist.ProcessGroup, tensors: list[torch.Tensor]) -> tuple[dist.Work, torch.Tensor]:
    """Rank 0: start broadcasting one bucket; returns the work to wait for and the bytes on the wire (keep them
    until then). A lone tensor goes as it is; several are packed, which a caller can do while the previous
    bucket is still on the wire."""
    flat = _bytes(tensors[0]) if len(tensors) == 1 else torch.cat([_bytes(t) for t in tensors])
    return group.broadcast(flat, 0), flat


def recv_bucket(group: dist.ProcessGroup, specs: list[TensorSpec], device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank >= 1: receive one bucket and yield its tensors by name."""
    flat = torch.empty(sum(_nbytes(s) for s in specs), dtype=torch.uint8, device=device)
    group.broadcast(flat, 0).wait()
    offset = 0
    for s in specs:
        n = _nbytes(s)
        yield s.name, flat[offset:offset + n].view(getattr(torch, s.dtype)).reshape(s.shape)
        offset += n


def recv_bucket_into(group: dist.ProcessGroup, specs: list[TensorSpec], state: dict[str, torch.Tensor]) -> None:
    """Rank >= 1: receive one bucket into the tensors of `state`; a lone tensor of the weight's own dtype straight
    into the weight, without a copy."""
    t = state[specs[0].name]
    if len(specs) == 1 and str(t.dtype).removeprefix("torch.") == specs[0].dtype and t.is_contiguous():
        group.broadcast(t.view(-1).view(torch.uint8), 0).wait()
        return
    for name, tensor in recv_bucket(group, specs, t.device):
        state[name].copy_(tensor)
