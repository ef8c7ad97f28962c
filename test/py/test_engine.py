"""The torch engine as a real process over real HTTP: logprobs against a teacher-forced forward,
continuous batching against one-at-a-time decoding, pause/abort, a weight push mid-request, a
checkpoint load, and bad input."""
import asyncio
import contextlib
import json
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
import torch.nn.functional as F

from conftest import GPU, PY, TOKEN, client, engine_server, free_port
from common import load_causal_lm
from contract import GenerateRequest, WeightReceiveRequest
from weight_transfer import open_group, plan_buckets, send_buckets

torch.set_num_threads(1)
TOL = 1e-4  # fp32 on CPU


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    with engine_server(tiny_model, tmp_path_factory.mktemp("engine")) as url:
        yield url


@pytest.fixture(scope="module")
def model(tiny_model):
    return load_causal_lm(str(tiny_model), device=torch.device("cpu"))


def perturbed(model, seed: int):
    """A copy of the model's weights, each moved by a little noise: a stand-in for a training step."""
    import copy
    new = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    return new


@torch.no_grad()
def expected_logprobs(model, prompt, tokens, temperature=1.0, top_k=0, top_p=1.0) -> list[float]:
    """Teacher-forced: log p(token) under softmax(filter(logits / T)); greedy reports the plain softmax."""
    logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()  # [T, V]
    out = []
    for row, tok in zip(logits, tokens):
        if temperature > 0:
            row = row / temperature
            if top_k:
                row = row.masked_fill(row < row.topk(top_k).values[-1], float("-inf"))
            if top_p < 1:
                probs, order = F.softmax(row, -1).sort(descending=True)
                keep = (probs.cumsum(-1) - probs) < top_p  # most likely tokens until their mass reaches top_p
                row = row.masked_fill(~torch.zeros_like(keep).scatter(0, order, keep), float("-inf"))
        out.append(F.log_softmax(row, -1)[tok].item())
    return out


def generate(url, prompt, **sampling) -> dict:
    r = client(url).post("/generate", json={"prompt_token_ids": prompt, "sampling": sampling})
    assert r.status_code == 200, r.text
    return r.json()


def concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as pool:
        return list(pool.map(fn, items))


def max_diff(a, b) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b))


CASES = [  # prompt, sampling
    ([1, 2, 3], dict(temperature=1.0, seed=1)),
    (list(range(40, 51)), dict(temperature=0.7, top_k=5, seed=2)),
    (list(range(100, 120)), dict(temperature=0.0)),
    ([7, 8, 9, 10, 11, 12], dict(temperature=1.3, top_p=0.9, seed=3)),
    ([200, 201], dict(temperature=1.0, top_k=20, top_p=0.8, seed=4)),
]


def test_logprobs_match_teacher_forced_forward(engine, model):
    outs = concurrently(lambda case: generate(engine, case[0], max_tokens=12, **case[1]), CASES)
    for (prompt, sampling), out in zip(CASES, outs):
        assert len(out["token_ids"]) == 12 and out["finish_reason"] == "length" and out["versions"] == [0] * 12
        sampling = {k: v for k, v in sampling.items() if k != "seed"}
        want = expected_logprobs(model, prompt, out["token_ids"], **sampling)
        assert max_diff(out["logprobs"], want) < TOL, (sampling, out["logprobs"], want)
    greedy_prompt, greedy = CASES[2][0], outs[2]["token_ids"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([greedy_prompt + greedy])).logits[0, len(greedy_prompt) - 1:-1]
    assert greedy == logits.argmax(-1).tolist()


def test_continuous_batching_matches_one_at_a_time(engine):
    prompts = [list(range(10 + i, 10 + 3 * i + 2)) for i in range(6)]  # different lengths
    one_by_one = [generate(engine, p, max_tokens=16, seed=10 + i) for i, p in enumerate(prompts)]
    together = concurrently(lambda ip: generate(engine, ip[1], max_tokens=16, seed=10 + ip[0]), list(enumerate(prompts)))
    for a, b in zip(one_by_one, together):
        assert a["token_ids"] == b["token_ids"]
        assert max_diff(a["logprobs"], b["logprobs"]) < TOL
    assert len({tuple(o["token_ids"]) for o in one_by_one}) == len(prompts)  # not trivially equal


def test_stop_tokens_and_length_limit(engine):
    greedy = generate(engine, [5, 6, 7], max_tokens=8, temperature=0)["token_ids"]
    stop = greedy[3]
    out = generate(engine, [5, 6, 7], max_tokens=8, temperature=0, stop_token_ids=[stop])
    assert out["finish_reason"] == "stop" and out["token_ids"] == greedy[:greedy.index(stop) + 1]
    max_len = 1024  # the tiny model's max_position_embeddings
    out = generate(engine, [65] * (max_len - 3), max_tokens=10, seed=0)
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3


def test_streaming_equals_non_streaming(engine):
    body = {"prompt_token_ids": [3, 1, 4, 1, 5], "sampling": {"max_tokens": 10, "seed": 7}}
    whole = client(engine).post("/generate", json=body).json()
    with client(engine).stream("POST", "/generate", json={**body, "stream": True}) as r:
        chunks = [json.loads(line) for line in r.iter_lines() if line]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert [x for c in chunks for x in c["logprobs"]] == whole["logprobs"]
    assert chunks[-1]["finish_reason"] == "length" and all(c["finish_reason"] is None for c in chunks[:-1])


def test_stream_chunk_holds_tokens_until_that_many_are_new(engine):
    """A streamed reply with stream_chunk=4 gets its 10 tokens as 4 + 4 + 2 (the last with the finish reason): the
    scheduler hands a chunk over once it has 4 new tokens, so a reader that keeps up sees no smaller one."""
    body = {"prompt_token_ids": [3, 1, 4, 1, 5], "sampling": {"max_tokens": 10, "seed": 7}}
    whole = client(engine).post("/generate", json=body).json()
    with client(engine).stream("POST", "/generate", json={**body, "stream": True, "stream_chunk": 4}) as r:
        chunks = [json.loads(line) for line in r.iter_lines() if line]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert [x for c in chunks for x in c["versions"]] == whole["versions"]
    sizes = [len(c["token_ids"]) for c in chunks]
    assert all(n % 4 == 0 for n in sizes[:-1]) and sum(sizes) == 10 and chunks[-1]["finish_reason"] == "length", sizes
    bad = client(engine).post("/generate", json={**body, "stream": True, "stream_chunk": 0})
    assert bad.status_code == 400 and "stream_chunk" in bad.json()["error"]


def test_events_come_in_chunks_not_one_per_token(tiny_model):
    """In process (the HTTP layer writes one line per event): a non-streaming request gets one event with every
    token; a streaming reader that falls behind gets every waiting token in one event, not one per token."""
    from torch_engine import TorchEngine
    eng = TorchEngine(str(tiny_model), torch.float32, torch.device("cpu"))

    async def read_when_done(stream: bool) -> list[dict]:
        req = GenerateRequest(prompt_token_ids=[1, 2, 3], stream=stream, sampling={"max_tokens": 20, "seed": 1})
        _, events = eng.submit(req)
        while eng.health()["load"] != {"running": 0, "waiting": 0}:
            await asyncio.sleep(0.02)
        with eng._model_lock:  # the scheduler hands events over before it lets go of the lock
            pass
        await asyncio.sleep(0)  # run the hand-off on this loop
        return [ev async for ev in events]
    for stream in (False, True):
        events = asyncio.run(read_when_done(stream))
        assert [(len(e["token_ids"]), len(e["logprobs"]), len(e["versions"]), e["finish_reason"]) for e in events] == \
            [(20, 20, 20, "length")], f"stream={stream}"


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
@torch.no_grad()
def test_fast_forward_matches_the_models_forward(model, packed, flat, gqa, monkeypatch):
    """fast_forward (the engine's forward for dense Qwen3, over fused q/k/v and gate/up weights) against the model's
    own forward: a prefill of one unpadded row, a left-padded prefill whose padding no linear layer sees, then decode
    steps over the cache it wrote; then again after new weights are copied into the state_dict (as a weight push does).
    packed: every GEMM over oneDNN's reordered weights (by default only weights larger than the tiny model's).
    flat: the weights laid out in one buffer first (weight_transfer.flatten, as the engine does): the fused weights
    are views of it, and the whole state dict is one span of bytes a push lands in.
    gqa: 4 query heads sharing 2 kv heads (as real Qwen3 models), which the decode steps' attention reads through a view.
    10 decode steps: the cache grows its spare columns twice."""
    import copy
    import fast_forward
    from make_tiny_model import model_config
    from transformers import AutoModelForCausalLM, DynamicCache
    from weight_transfer import flatten, span
    if gqa:
        config = model_config(moe=False, heads=4)
        config.num_key_value_heads = 2
        model = AutoModelForCausalLM.from_config(config).eval()
    assert fast_forward.supports(model)
    if packed:
        monkeypatch.setattr(fast_forward, "PACK_MIN", 0)
    fast = copy.deepcopy(model)
    if flat:
        flatten(fast)
    fast_forward.fuse(fast)
    assert fast.fast_pack or not packed  # oneDNN is there in the CPU builds of torch
    unique = list({t.data_ptr(): t for t in fast.state_dict().values()}.values())  # a tied weight once
    assert (span(unique) is not None) == flat
    g = torch.Generator().manual_seed(0)
    for reference, lens in ((model, [7]), (model, [5, 12, 9]), (perturbed(model, 1), [5, 12, 9])):
        for name, t in fast.state_dict().items():
            t.copy_(reference.state_dict()[name])
        fast_forward.forget(fast)  # as the engine does after new weights land
        seqs = [torch.randint(0, 256, (n + 10,), generator=g).tolist() for n in lens]
        L = max(lens)
        ids = torch.tensor([[0] * (L - n) + s[:n] for s, n in zip(seqs, lens)])  # [B, L], left-padded
        mask = torch.tensor([[0] * (L - n) + [1] * n for n in lens])
        allowed = torch.ones(L, L, dtype=torch.bool).tril() & (mask.bool()[:, None, :] | torch.eye(L, dtype=torch.bool))
        cache = DynamicCache(config=fast.config)
        steps = [fast_forward.forward(fast, ids, (mask.cumsum(1) - 1).clamp(min=0), mask.bool(), cache, allowed[:, None])]
        for t in range(10):
            mask = torch.cat([mask, torch.ones(len(lens), 1, dtype=mask.dtype)], 1)
            steps.append(fast_forward.forward(fast, torch.tensor([[s[n + t]] for s, n in zip(seqs, lens)]),
                                              torch.tensor([[n + t] for n in lens]), torch.ones(len(lens), 1, dtype=torch.bool),
                                              cache, mask.bool()[:, None, None, :]))
        for i, (s, n) in enumerate(zip(seqs, lens)):
            want = reference(input_ids=torch.tensor([s])).logits[0, n - 1:n + 10]  # [11, V]
            got = torch.stack([step[i] for step in steps])
            assert (got - want).abs().max() < 1e-5, (lens, i)


@pytest.mark.parametrize("rope_type", ["linear", "dynamic"])
@torch.no_grad()
def test_fast_forward_rotary_table_only_for_rope_fixed_per_position(rope_type):
    """fast_forward reads cos/sin from a table made once over every position: right for rope types whose values are
    fixed per position (linear scaling: equal to the model's forward), not for those that rescale with the length
    (dynamic: left to the model's own forward)."""
    import fast_forward
    from make_tiny_model import model_config
    from transformers import AutoModelForCausalLM, DynamicCache
    config = model_config(moe=False)
    config.rope_parameters = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    model = AutoModelForCausalLM.from_config(config).eval()
    assert fast_forward.supports(model) == (rope_type == "linear")
    if rope_type == "linear":
        fast_forward.fuse(model)
        ids = torch.randint(0, 256, (1, 50), generator=torch.Generator().manual_seed(0))
        got = fast_forward.forward(model, ids, torch.arange(50)[None], None, DynamicCache(config=config),
                                   torch.ones(50, 50, dtype=torch.bool).tril()[None, None])
        assert (got - model(input_ids=ids).logits[:, -1]).abs().max() < 1e-5


LONG = {"prompt_token_ids": [1, 2, 3], "stream": True, "sampling": {"max_tokens": 1000, "seed": 5}}


def test_abort_and_pause_abort_return_partial_tokens(engine):
    c = client(engine)
    for end in (lambda: c.post("/abort", json={"request_ids": ["long-1"]}), lambda: c.post("/pause", json={"mode": "abort"})):
        with client(engine).stream("POST", "/generate", json={**LONG, "request_id": "long-1"}) as r:
            lines = r.iter_lines()
            first = json.loads(next(lines))
            assert end().status_code == 200
            chunks = [first] + [json.loads(line) for line in lines if line]
        tokens = [t for ch in chunks for t in ch["token_ids"]]
        assert chunks[-1]["finish_reason"] == "abort" and 1 <= len(tokens) < 1000
    assert c.get("/health").json()["paused"] is True
    # while paused, new requests wait; they run after resume
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate, engine, [9, 9], max_tokens=4, seed=1)
        while c.get("/health").json()["load"]["waiting"] < 1:
            time.sleep(0.05)
        assert not pending.done()
        assert c.post("/resume").status_code == 200
        assert len(pending.result()["token_ids"]) == 4


def test_a_client_that_goes_away_frees_its_slot(engine):
    c = client(engine)
    with client(engine).stream("POST", "/generate", json=LONG) as r:
        lines = r.iter_lines()  # keep a reference: a collected iterator closes the response
        next(lines)
        c.post("/pause", json={"mode": "keep"})  # held: from here only the disconnect can end it
        assert c.get("/health").json()["load"]["running"] == 1
    try:
        for _ in range(200):
            if c.get("/health").json()["load"] == {"running": 0, "waiting": 0}:
                return
            time.sleep(0.05)
        pytest.fail(f"the abandoned request is still in the engine: {c.get('/health').json()}")
    finally:
        c.post("/resume")


def push_weights(url, new_model, version: int, bucket_bytes: int = 64 * 1024) -> dict:
    """Act as the actor (rank 0): post /weights/receive in a thread and broadcast the buckets."""
    named = list(new_model.state_dict().items())
    buckets = plan_buckets(named, bucket_bytes)
    port = free_port()
    body = WeightReceiveRequest(master_addr="127.0.0.1", master_port=port, world_size=2, rank=1,
                                buckets=buckets, version=version).model_dump()
    reply = {}
    poster = threading.Thread(target=lambda: reply.update(r=client(url).post("/weights/receive", json=body)))
    poster.start()
    _, group = open_group("127.0.0.1", port, 2, 0, "gloo")
    tensors = dict(named)
    send_buckets(group, ([tensors[s.name] for s in bucket] for bucket in buckets))
    poster.join()
    assert reply["r"].status_code == 200, reply["r"].text
    return reply["r"].json()


@pytest.fixture(scope="module")
def weights_engine(tiny_model, tmp_path_factory):
    with engine_server(tiny_model, tmp_path_factory.mktemp("weights-engine")) as url:
        yield url


HELD_PROMPTS = [[1, 2, 3], list(range(30, 47))]  # two held requests of different lengths
HELD_TOKENS = 900  # long enough to outlast a push's group setup: 300 lost that race on a loaded machine (faster decode)


def generate_across_push(url, new_model, version: int, pause: bool = True) -> list[tuple[list[int], list[int], list[float], list[int]]]:
    """Start two long requests, pause(keep), push new_model, resume; returns (prompt, tokens, logprobs, versions).
    pause False: push only, as a refit does (the engine holds its requests while it receives)."""
    c = client(url)
    with contextlib.ExitStack() as stack:
        streams = []
        for i, prompt in enumerate(HELD_PROMPTS):
            body = {"prompt_token_ids": prompt, "stream": True, "sampling": {"max_tokens": HELD_TOKENS, "seed": i}}
            lines = stack.enter_context(client(url).stream("POST", "/generate", json=body)).iter_lines()
            streams.append((lines, [json.loads(next(lines))]))
        if pause:
            assert c.post("/pause", json={"mode": "keep"}).status_code == 200
            assert c.get("/health").json()["load"] == {"running": 2, "waiting": 0}  # held, not dropped
        assert push_weights(url, new_model, version) == {"version": version}
        assert c.get("/health").json()["version"] == version
        if pause:
            assert c.post("/resume").status_code == 200
        for lines, chunks in streams:
            chunks += [json.loads(line) for line in lines if line]
    out = []
    for prompt, (_, chunks) in zip(HELD_PROMPTS, streams):
        assert chunks[-1]["finish_reason"] == "length"
        out.append((prompt, *([x for ch in chunks for x in ch[key]] for key in ("token_ids", "logprobs", "versions"))))
    return out


@pytest.mark.parametrize("pause", [True, False])
def test_pause_push_resume_continues_with_new_weights(weights_engine, model, pause):
    new_model = perturbed(model, seed=1)
    v = client(weights_engine).get("/health").json()["version"]
    if v != 0:  # an earlier test pushed other weights: the model's own back first
        v = push_weights(weights_engine, model, v + 1)["version"]
    for prompt, tokens, logprobs, versions in generate_across_push(weights_engine, new_model, v + 1, pause):
        n_old = versions.count(v)
        assert 1 <= n_old < HELD_TOKENS and versions == [v] * n_old + [v + 1] * (HELD_TOKENS - n_old)
        assert max_diff(logprobs[:n_old], expected_logprobs(model, prompt, tokens[:n_old])) < TOL
        # the held requests' KV was recomputed, so the new tokens match a forward with the new weights
        assert max_diff(logprobs[n_old:], expected_logprobs(new_model, prompt + tokens[:n_old], tokens[n_old:])) < TOL


def test_keep_stale_kv_keeps_the_old_keys_and_values(tiny_model, model, tmp_path):
    new_model = perturbed(model, seed=1)
    with engine_server(tiny_model, tmp_path, "--keep-stale-kv") as url:
        for prompt, tokens, logprobs, versions in generate_across_push(url, new_model, version=1):
            n_old = versions.count(0)
            assert 1 <= n_old < HELD_TOKENS and versions == [0] * n_old + [1] * (HELD_TOKENS - n_old)
            # new weights over old KV: not what a fresh forward with the new weights gives
            fresh = expected_logprobs(new_model, prompt + tokens[:n_old], tokens[n_old:])
            assert max_diff(logprobs[n_old:], fresh) > 1e-2


def test_load_weights_from_checkpoint(weights_engine, model, tmp_path):
    loaded = perturbed(model, seed=2)
    loaded.save_pretrained(tmp_path / "ckpt")
    before = generate(weights_engine, [4, 5, 6], max_tokens=8, temperature=0)
    r = client(weights_engine).post("/weights/load", json={"path": str(tmp_path / "ckpt"), "version": 7})
    assert r.status_code == 200 and r.json() == {"version": 7}
    assert client(weights_engine).get("/health").json()["version"] == 7
    after = generate(weights_engine, [4, 5, 6], max_tokens=8, temperature=0)
    assert after["versions"] == [7] * 8 and after["logprobs"] != before["logprobs"]
    assert max_diff(after["logprobs"], expected_logprobs(loaded, [4, 5, 6], after["token_ids"], temperature=0)) < TOL


BAD = [  # method, path, body, status, words the error must contain
    ("post", "/generate", {"prompt_token_ids": "abc"}, 400, "prompt_token_ids"),
    ("post", "/generate", {"prompt_token_ids": []}, 400, "prompt_token_ids"),
    ("post", "/generate", {"prompt_token_ids": [1], "sampling": {"temprature": 1}}, 400, "temprature"),
    ("post", "/generate", {"prompt_token_ids": [1], "sampling": {"top_p": 0}}, 400, "top_p"),
    ("post", "/generate", {"prompt_token_ids": [1, 259]}, 400, "prompt_token_ids[1] = 259 is outside the vocabulary"),
    ("post", "/generate", {"prompt_token_ids": [-1]}, 400, "prompt_token_ids[0] = -1"),
    ("post", "/generate", {"prompt_token_ids": [1], "sampling": {"stop_token_ids": [5000]}}, 400, "stop_token_ids[0]"),
    ("post", "/generate", {"prompt_token_ids": [1] * 1024}, 400, "prompt has 1024 tokens"),
    ("post", "/pause", {"mode": "later"}, 400, "mode"),
    ("post", "/weights/load", {"path": "/no/such/dir", "version": 1}, 400, "/no/such/dir"),
    ("post", "/weights/receive", {"master_addr": "127.0.0.1", "master_port": 1, "world_size": 2, "rank": 1, "version": 1,
                                  "buckets": [[{"name": "no.such.weight", "dtype": "float32", "shape": [1]}]]},
     400, "no.such.weight"),
]


def test_bad_requests_get_clear_errors_and_the_server_keeps_serving(engine):
    c = client(engine)
    for method, path, body, status, words in BAD:
        r = getattr(c, method)(path, json=body)
        assert r.status_code == status and words in r.json()["error"], (path, body, r.text)
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.get(f"{engine}/health", headers=headers)
        assert r.status_code == 401 and "bearer token" in r.json()["error"]
    assert c.get("/health").json()["version"] == 0
    assert len(generate(engine, [1, 2], max_tokens=3)["token_ids"]) == 3


def test_unknown_model_dir_exits_with_a_clear_message(tmp_path):
    proc = subprocess.run([PY, str(GPU / "engine.py"), "--model", str(tmp_path / "nope"), "--port", str(free_port()),
                           "--token", TOKEN], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and f"model dir {str(tmp_path / 'nope')!r} does not exist" in proc.stderr


def test_a_dead_actor_does_not_block_generation_or_the_next_push(weights_engine, model):
    """An actor that died before the rendezvous: the engine waits for it (up to the transfer timeout,
    30 s) in one thread, and meanwhile generates and takes a push from a live actor. Before, the wait
    held the model lock, so both blocked until the timeout."""
    import socket
    dead = socket.socket()  # bound, never listening: the dead actor's port, kept from other users
    dead.bind(("127.0.0.1", 0))
    body = WeightReceiveRequest(master_addr="127.0.0.1", master_port=dead.getsockname()[1], world_size=2, rank=1,
                                buckets=plan_buckets(model.state_dict().items(), 64 * 1024), version=99).model_dump()
    reply = {}
    waiting = threading.Thread(target=lambda: reply.update(r=client(weights_engine).post("/weights/receive", json=body)))
    waiting.start()
    try:
        time.sleep(1)  # the engine is in the rendezvous now
        assert len(generate(weights_engine, [1, 2, 3], max_tokens=20)["token_ids"]) == 20
        assert waiting.is_alive(), "generation waited for the dead actor's rendezvous"
        assert push_weights(weights_engine, perturbed(model, seed=5), version=8) == {"version": 8}
        assert waiting.is_alive(), "the next push waited for the dead actor's rendezvous"
        assert client(weights_engine).get("/health").json()["version"] == 8
    finally:
        waiting.join()
        dead.close()
    assert reply["r"].status_code == 500 and "weight update failed" in reply["r"].json()["error"]
    assert client(weights_engine).get("/health").json()["version"] == 8  # the failed transfer changed nothing


def test_a_kept_group_takes_later_pushes_without_a_rendezvous(weights_engine, model):
    """The actor's side by hand: the first push joins group g (a rendezvous); later ones name g without joining, the
    engine checks in through the store, and the weights come over the same connections. A push naming a group the
    engine does not hold (the actor's view after an engine restart) is refused at once with a 409, changing nothing."""
    named = list(model.state_dict().items())
    buckets = plan_buckets(named, 64 * 1024)  # lone tensors (received in place) and packed small ones
    assert {len(b) == 1 for b in buckets} == {True, False}
    port = free_port()
    store = group = None
    for seq, seed in enumerate([11, 12, 13], start=1):
        new = perturbed(model, seed=seed)
        body = WeightReceiveRequest(master_addr="127.0.0.1", master_port=port, world_size=2, rank=1, buckets=buckets,
                                    version=seq, group="g", join=seq == 1, seq=seq).model_dump()
        reply = {}
        poster = threading.Thread(target=lambda: reply.update(r=client(weights_engine).post("/weights/receive", json=body)))
        poster.start()
        if seq == 1:
            store, group = open_group("127.0.0.1", port, 2, 0, "gloo")
        else:
            store.wait([f"ready/{seq}/1"])  # checked in, and now waits to be told to go
            store.set(f"go/{seq}", "1")
        tensors = dict(new.named_parameters(remove_duplicate=False))
        send_buckets(group, ([tensors[s.name] for s in bucket] for bucket in buckets))
        poster.join()
        assert reply["r"].status_code == 200 and reply["r"].json() == {"version": seq}, reply["r"].text
        out = generate(weights_engine, [4, 5, 6], max_tokens=8, temperature=0)
        assert out["versions"] == [seq] * 8
        assert max_diff(out["logprobs"], expected_logprobs(new, [4, 5, 6], out["token_ids"], temperature=0)) < TOL
    stranger = {**body, "group": "another", "seq": 4, "version": 4}
    r = client(weights_engine).post("/weights/receive", json=stranger)
    assert r.status_code == 409 and "does not hold transfer group 'another'" in r.json()["error"]
    assert client(weights_engine).get("/health").json()["version"] == 3
    group.shutdown()
