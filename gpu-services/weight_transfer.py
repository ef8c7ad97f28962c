"""Moving weights from the actor to engines over a torch.distributed group that outlives a push.

The actor is rank 0 and every engine a rank >= 1 of a group made from a TCPStore (gloo on CPU, NCCL on GPU),
apart from the actor's own training group. The group is made at the first push to a set of engines and kept while
that set stays the same, so a refit costs no rendezvous. At each later push every engine checks in through the
store before anything is sent; one that does not hold the group (it restarted) answers NotInGroup instead, and the
actor makes a new group.

Weights travel in buckets, broadcast from rank 0, each one flat uint8 tensor: a lone tensor as it is (no copy),
several small ones packed back to back in spec order into a send buffer kept from one push to the next, unless they
lie back to back already (a one-rank actor's, after flatten). An engine whose weights lie back to back in the
actor's order (flatten) receives every bucket straight into them. Both ends keep several buckets on the wire
(IN_FLIGHT_BYTES).
"""
import math
import os
import socket
from collections import deque
from datetime import timedelta
from typing import Iterable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from contract import NotInGroup, TensorSpec, WeightReceiveRequest

T = TypeVar("T")


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

    def done(self, req: WeightReceiveRequest) -> None:
        """Tell the actor through the store that this push is in: its wait for the HTTP answer costs ~1 ms more."""
        self.store.set(f"done/{req.seq}/{req.rank}", str(req.version))

    def leave(self) -> None:
        """Drop the group (a failed push leaves it in an unknown state; weights loaded otherwise may differ from
        what the actor last sent): the actor's next push finds NotInGroup and makes a new one."""
        if self.group is not None:
            self.group.shutdown()  # frees its connections (NCCL communicators on GPU)
        self.id, self.store, self.group = None, None, None


def check_in(store: dist.Store, seq: int, world_size: int) -> bool:
    """Rank 0, kept group: whether every engine has checked in for push seq (see Membership.group_for)."""
    return store.check([f"ready/{seq}/{r}" for r in range(1, world_size)])


def done_versions(store: dist.Store, seq: int, answers: list) -> list[int] | None:
    """Rank 0: each engine's version once all hold push seq, from its HTTP answer (a Future) where it has come, else
    from the store (Membership.done; an engine that does not say so there is waited for on HTTP); None till then.
    An answer that failed raises."""
    keys = [f"done/{seq}/{rank}" for rank in range(1, len(answers) + 1)]
    if any(a.done() and a.exception() for a in answers):
        raise next(a.exception() for a in answers if a.done() and a.exception())
    if not store.check([k for k, a in zip(keys, answers) if not a.done()]):
        return None
    return [a.result() if a.done() else int(store.get(k)) for k, a in zip(keys, answers)]


# Bytes kept on the wire at once. A receiver that posts bucket k+1 only once k has landed costs each bucket a
# wake-up of both ends: on this 2-core machine under load, 73 buckets of 1 MB went 2.5x slower one at a time than
# with 8 in flight. At least two are in flight whatever their size (bucket k+1 packs while k is on the wire),
# so either end holds at most this plus its two largest buckets.
IN_FLIGHT_BYTES = 64 << 20


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * getattr(torch, spec.dtype).itemsize


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _in_flight(posted: Iterator[tuple[dist.Work, torch.Tensor, T]]) -> Iterator[T]:
    """Pulls (work, bytes on the wire, payload) from `posted` (each pull starts a broadcast) while at most
    IN_FLIGHT_BYTES, or two works, are unfinished; yields each payload in order once its work is done."""
    pending: deque = deque()
    size = 0
    for work, flat, payload in posted:
        pending.append((work, flat, payload))
        size += flat.numel()
        while len(pending) > 1 and size > IN_FLIGHT_BYTES:
            work, flat, payload = pending.popleft()
            work.wait()
            if flat.is_cuda:  # NCCL's wait only orders the streams: block, or every bucket's buffer is allocated at once
                torch.cuda.current_stream(flat.device).synchronize()
            size -= flat.numel()
            yield payload
    for work, _, payload in pending:
        work.wait()
        yield payload


def flatten(model: torch.nn.Module) -> None:
    """Make the model's parameters views of one buffer, back to back in their order (a tied one once), which is the
    order of its state dict and so of the actor's buckets. On an engine each bucket then lands in them straight off
    the wire (receive_buckets), with no unpacking copy; on a one-rank actor each is sent from them, with no packing
    copy (send_buckets). Left as they are when their dtypes or devices differ, or when they are sharded over ranks.
    An FSDP2 model must not have run a forward yet: its lazy init takes the new shards up (reset_sharded_param)."""
    params = list(model.parameters())
    if any(isinstance(p, DTensor) and p.device_mesh.size() > 1 for p in params):
        return
    local = [(p.to_local() if isinstance(p, DTensor) else p).detach() for p in params]  # no autograd between them
    if len({(t.dtype, t.device) for t in local}) != 1:
        return
    flat = torch.cat([t.reshape(-1) for t in local])
    offset = 0
    for p, t in zip(params, local):
        view = flat[offset:offset + t.numel()].view(t.shape)
        if isinstance(p, DTensor):
            p._local_tensor = view  # no public setter (`p.data =` a new DTensor copies it); FSDP2 reads this one
        else:
            p.data = view
        offset += t.numel()


def span(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """The bytes these tensors fill when they lie back to back in one storage, in this order, as one flat uint8
    tensor over that storage; else None."""
    first, end = tensors[0], tensors[0].data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.data_ptr() != end or \
                t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += t.numel() * t.element_size()
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
        first.untyped_storage(), first.storage_offset() * first.element_size(), (end - first.data_ptr(),))


def send_buckets(group: dist.ProcessGroup, buckets: Iterable[list[torch.Tensor]], spare: list | None = None) -> int:
    """Rank 0: broadcast each bucket (a lone tensor, or several lying back to back, as they are; else packed); pulling
    the next bucket from `buckets` (a gather, on the actor) and packing it overlap the ones on the wire. Packing goes
    into buffers taken from `spare` and put back once sent: the caller keeps them from one push to the next, because
    a new CPU buffer costs a page fault per 4 KB at first touch (135 MB in 16 MB buckets here: 0.069 CPU s to pack,
    0.054 kept).
    Returns the bytes sent."""
    spare = [] if spare is None else spare

    def posted():
        for tensors in buckets:
            buffer, flat = None, span(tensors)  # a lone tensor, or weights back to back (flatten): sent as they lie
            if flat is None:
                n = sum(t.numel() * t.element_size() for t in tensors)
                fits = [i for i, b in enumerate(spare) if b.numel() >= n and b.device == tensors[0].device]
                buffer = spare.pop(min(fits, key=lambda i: spare[i].numel())) if fits else \
                    torch.empty(n, dtype=torch.uint8, device=tensors[0].device)
                flat = torch.cat([_bytes(t) for t in tensors], out=buffer[:n])
            yield group.broadcast(flat, 0), flat, (flat.numel(), buffer)
    sent = 0
    for n, buffer in _in_flight(posted()):
        sent += n
        if buffer is not None:
            spare.append(buffer)
    return sent


def receive_buckets(group: dist.ProcessGroup, buckets: list[list[TensorSpec]], device: torch.device,
                    into: dict[str, torch.Tensor] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Rank >= 1: receive every bucket, posting the next ones while earlier ones land, and yield their tensors by
    name. A bucket whose weights in `into` have its dtypes and lie back to back in its order (a lone one always;
    all of them after flatten) lands straight in them, uncopied, and its tensors are not yielded."""
    def posted():
        for specs in buckets:
            flat = None
            if into is not None and all(s.name in into and str(into[s.name].dtype) == f"torch.{s.dtype}" for s in specs):
                flat = span([into[s.name] for s in specs])
            if flat is not None:
                specs = []
            else:
                flat = torch.empty(sum(_nbytes(s) for s in specs), dtype=torch.uint8, device=device)
            yield group.broadcast(flat, 0), flat, (flat, specs)
    for flat, specs in _in_flight(posted()):
        offset = 0
        for s in specs:
            n = _nbytes(s)
            yield s.name, flat[offset:offset + n].view(getattr(torch, s.dtype)).reshape(s.shape)
            offset += n
