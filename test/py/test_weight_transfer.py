"""weight_transfer's pipelined send and receive, two ranks of a gloo group in one process: every bucket arrives
intact and in place, however many are kept on the wire."""
import threading

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

import weight_transfer
from conftest import free_port
from weight_transfer import open_group, plan_buckets, receive_buckets, send_buckets


@pytest.mark.parametrize("in_flight", [1, 5000, 64 << 20])  # one bucket at a time (past the two), a few, all
def test_buckets_arrive_intact_with_several_on_the_wire(monkeypatch, in_flight):
    monkeypatch.setattr(weight_transfer, "IN_FLIGHT_BYTES", in_flight)
    g = torch.Generator().manual_seed(0)
    sent = {f"w{i}": torch.randn(n, generator=g) for i, n in enumerate([700, 3, 5, 1200, 9, 400, 2000, 1, 1])}
    sent["h"] = torch.randint(0, 100, (300,), dtype=torch.int64, generator=g)  # another dtype in a bucket
    buckets = plan_buckets(sent.items(), 2000)  # lone tensors and packed ones
    assert {len(b) == 1 for b in buckets} == {True, False}
    state = {n: torch.zeros_like(t) for n, t in sent.items()}
    state["w3"] = torch.zeros(1200, dtype=torch.float64)  # another dtype than sent: copied, not received in place
    got = transfer(sent, buckets, state)
    lone = {b[0].name for b in buckets if len(b) == 1} - {"w3"}
    assert set(got) == set(sent) - lone  # the lone ones landed in `state` instead
    for n, t in sent.items():
        assert torch.equal(state[n] if n in lone else got[n], t), n


def test_buckets_land_in_weights_that_lie_back_to_back():
    """After flatten, a packed bucket lands straight in the weights too: nothing is left to copy."""
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.LayerNorm(20), torch.nn.Linear(20, 5))
    weight_transfer.flatten(model)
    state = model.state_dict()
    sent = {n: torch.randn_like(t) for n, t in state.items()}
    buckets = plan_buckets(sent.items(), 1000)
    assert {len(b) == 1 for b in buckets} == {True, False}
    assert transfer(sent, buckets, state) == {}
    for n, t in sent.items():
        assert torch.equal(state[n], t), n
        assert torch.equal(dict(model.named_parameters())[n], t), n  # the parameters are those views


def test_a_one_rank_fsdp_model_sends_from_its_weights():
    """A one-rank actor's weights after flatten: FSDP2 computes with the flat shards, an optimizer step updates them
    in place, and a push sends every bucket from them, packing nothing."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.LayerNorm(20), torch.nn.Linear(20, 5))
        fully_shard(model[0])
        fully_shard(model)
        weight_transfer.flatten(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(4, 30)).square().sum().backward()
        optimizer.step()
        state = {n: t.to_local() for n, t in model.state_dict().items()}
        plain = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.LayerNorm(20), torch.nn.Linear(20, 5))
        plain.load_state_dict(state)
        x = torch.randn(3, 30)
        assert torch.allclose(model(x), plain(x))  # the step is in the shards FSDP computes with
        buckets = plan_buckets(state.items(), 1000)
        assert {len(b) == 1 for b in buckets} == {True, False}
        got = transfer(state, buckets, {}, packs=False)
        assert set(got) == set(state)
        for n, t in state.items():
            assert torch.equal(got[n], t), n
    finally:
        dist.destroy_process_group()


def transfer(sent: dict[str, torch.Tensor], buckets, into: dict[str, torch.Tensor],
             packs: bool = True) -> dict[str, torch.Tensor]:
    """Send `sent` in `buckets` from rank 0 to rank 1 (a thread) of a gloo group, packing buckets of several
    tensors (unless they lie back to back: packs=False); returns what receive_buckets yielded (not landed in
    `into`)."""
    port, got = free_port(), {}

    def engine():
        _, group = open_group("127.0.0.1", port, 2, 1, "gloo")
        for _ in range(2):
            got.update((n, t.clone()) for n, t in receive_buckets(group, buckets, torch.device("cpu"), into=into))

    receiver = threading.Thread(target=engine)
    receiver.start()
    _, group = open_group("127.0.0.1", port, 2, 0, "gloo")
    spare, kept = [], []
    for _ in range(2):  # the second time through the packing buffers kept from the first, no new ones
        assert send_buckets(group, ([sent[s.name] for s in b] for b in buckets), spare) == sum(
            t.numel() * t.element_size() for t in sent.values())
        kept.append({b.data_ptr() for b in spare})
    assert bool(kept[0]) == packs and kept[1] == kept[0]
    receiver.join(timeout=60)
    return got
