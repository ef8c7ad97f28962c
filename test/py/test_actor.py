"""The actor as real processes (torchrun, gloo, world sizes 1 and 2) training on trajectories sampled by a real
engine: forward consistency with the engine before and after a weight push, world size 1 == world size 2,
exactly-once steps, checkpoint round trip into a fresh process, bad input."""
import contextlib
import json
import subprocess

import httpx
import pytest
import torch
from safetensors.torch import save_file

from conftest import GPU, PY, TOKEN, actor_server, client, engine_server, free_port, service

torch.set_num_threads(1)
ENGINE_TOL = 1e-4  # actor vs engine logprobs, fp32 on CPU
RANKS_TOL = 1e-5  # world size 1 vs 2 after one step
RUN = "run-a"
# lr large enough that one step moves logprobs far beyond the tolerances; small micro-batches so that the ranks
# run several, and a rank with fewer rows runs dummy ones
ALGO = {"lr": 1e-3, "micro_batch_tokens": 32}


def generate(engine: httpx.Client, prompt: list[int], seed: int) -> dict:
    r = engine.post("/generate", json={"prompt_token_ids": prompt,
                                       "sampling": {"max_tokens": 6, "temperature": 1.0, "seed": seed}})
    assert r.status_code == 200, r.text
    return r.json()


def write_segment(path, prompt: list[int], out: dict, group: int, episode: int, segment: int, reward: float):
    n, m = len(prompt), len(out["token_ids"])
    save_file({"tokens": torch.tensor(prompt + out["token_ids"], dtype=torch.int32),
               "logprobs": torch.tensor([0.0] * n + out["logprobs"], dtype=torch.float32),
               "versions": torch.tensor([-1] * n + out["versions"], dtype=torch.int32),
               "loss_mask": torch.tensor([0] * n + [1] * m, dtype=torch.uint8)},
              str(path), metadata={"format": "molt-trajectory-v1", "run": RUN, "group": str(group),
                                   "episode": str(episode), "segment": str(segment), "reward": str(reward),
                                   "finish": out["finish_reason"]})


@pytest.fixture(scope="module")
def engine(tiny_model, tmp_path_factory):
    with engine_server(tiny_model, tmp_path_factory.mktemp("engine")) as url:
        yield url


@pytest.fixture(scope="module")
def store(engine, tmp_path_factory) -> tuple[str, list[str]]:
    """2 groups x 2 episodes sampled by the engine at version 0; episode (0, 0) has two segments (the second
    one starts over from a new context, as after a compaction)."""
    root = tmp_path_factory.mktemp("store")
    (root / RUN).mkdir()
    rewards = {(0, 0): 1.0, (0, 1): 0.0, (1, 0): 0.25, (1, 1): 0.75}
    refs = []
    with client(engine) as c:
        for (group, episode), reward in rewards.items():
            prompt = list(b"copy ") + [97 + group, 98 + episode, ord(">")]
            segments = [prompt, list(b"again:")] if (group, episode) == (0, 0) else [prompt]
            for segment, context in enumerate(segments):
                ref = f"{RUN}/g{group}-e{episode}-s{segment}.safetensors"
                write_segment(root / ref, context, generate(c, context, seed=10 * group + episode + segment),
                              group, episode, segment, reward)
                refs.append(ref)
    return str(root), refs


def load_rows(store) -> list[dict]:
    from safetensors.torch import load_file
    root, refs = store
    return [load_file(f"{root}/{ref}") for ref in refs]


def actor_logprobs(url: str, rows: list[dict]) -> torch.Tensor:
    """Concatenated actor logprobs of all trajectory tokens."""
    with client(url) as c:
        r = c.post("/logprobs", json={"token_ids": [row["tokens"].tolist() for row in rows]})
    assert r.status_code == 200, r.text
    return torch.cat([torch.tensor(lp) for lp in r.json()["logprobs"]])


def train(url: str, store, step: int, run_id: str = RUN, **algo) -> httpx.Response:
    root, refs = store
    with client(url) as c:
        return c.post("/train_step", json={"run_id": run_id, "step": step, "store_root": root, "trajectories": refs,
                                           "algo": {**ALGO, **algo}})


@pytest.fixture(scope="module")
def actor2(tiny_model, tmp_path_factory):
    with actor_server(tiny_model, tmp_path_factory.mktemp("actor2"), 2) as url:
        yield url


@pytest.fixture(scope="module")
def actor1(tiny_model, tmp_path_factory):
    # the initial model as reference: KL terms can be asked for (with kl_coef 0 the step is the same as without)
    with actor_server(tiny_model, tmp_path_factory.mktemp("actor1"), 1, "--ref-model", str(tiny_model)) as url:
        yield url


@pytest.fixture(scope="module")
def stepped2(actor2, store):
    """Actor (world size 2) logprobs of the trajectories before and after training step 1, and the response."""
    rows = load_rows(store)
    before = actor_logprobs(actor2, rows)
    r = train(actor2, store, 1)
    assert r.status_code == 200, r.text
    return before, actor_logprobs(actor2, rows), r.json()


@pytest.fixture(scope="module")
def stepped1(actor1, store):
    r = train(actor1, store, 1)
    assert r.status_code == 200, r.text
    return actor_logprobs(actor1, load_rows(store)), r.json()


def test_actor_matches_engine_before_and_after_push(engine, store, actor2, stepped2):
    rows = load_rows(store)
    mask = torch.cat([row["loss_mask"] for row in rows]).bool()
    rollout = torch.cat([row["logprobs"] for row in rows])
    before, after, resp = stepped2
    # version 0: the engine sampled these tokens with the logprobs the actor computes
    assert (before[mask] - rollout[mask]).abs().max() < ENGINE_TOL
    assert resp["version"] == 1 and not resp["replayed"]
    m = resp["metrics"]
    assert m["rollout_logp_max_abs_diff"] < ENGINE_TOL
    assert m["tokens/trained"] == m["tokens/sampled"] == m["staleness/0"] == mask.sum().item()
    assert m["sequences"] == len(rows) == 5 and m["episodes"] == 4  # the two-segment episode counts once
    assert m["reward/mean"] == pytest.approx(0.5)
    assert m["grad_norm"] > 0 and m["entropy"] > 0
    assert (after - before).abs().max() > 100 * ENGINE_TOL  # the step changed the policy
    with client(actor2) as c:  # this actor has no reference model
        r = c.post("/train_step", json={"run_id": RUN, "step": 2, "store_root": store[0], "trajectories": store[1],
                                        "algo": {"kl_coef": 0.1}})
        assert r.status_code == 400 and "--ref-model" in r.json()["error"]

    with client(actor2) as c:
        r = c.post("/push_weights", json={"engines": [{"url": engine}], "version": 1, "bucket_bytes": 100_000})
        assert r.status_code == 200, r.text
        assert r.json()["version"] == 1 and r.json()["bytes"] > 0
    with client(engine) as c:
        assert c.get("/health").json()["version"] == 1
        prompt = list(b"copy ab>")
        out = generate(c, prompt, seed=7)
    assert set(out["versions"]) == {1}
    logp = actor_logprobs(actor2, [{"tokens": torch.tensor(prompt + out["token_ids"])}])[len(prompt):]
    assert (logp - torch.tensor(out["logprobs"])).abs().max() < ENGINE_TOL


# grpo advantage of every episode in the store (groups [1, 0] and [0.25, 0.75]): 0.5 / std 0.5^0.5 = 0.5^0.5;
# rows in store order: episode (0, 0) in two segments, (0, 1), (1, 0), (1, 1)
ROW_ADVANTAGES = [0.5 ** 0.5, 0.5 ** 0.5, -0.5 ** 0.5, -0.5 ** 0.5, 0.5 ** 0.5]


def loss_at_start(store, loss_agg: str) -> float:
    """A step's loss at its start, written out: the ratio is 1 and there is no correction, entropy or KL term, so
    every token's loss is -A and  loss = -sum_b A_b n_b / D_b  (n_b: the row's loss tokens; D_b: loss_divisor).
    A divisor computed per micro-batch or per rank instead of for the whole step would miss it."""
    n = [float(row["loss_mask"].sum()) for row in load_rows(store)]
    if loss_agg == "token-mean":  # D_b = N
        return -sum(a * k for a, k in zip(ROW_ADVANTAGES, n)) / sum(n)
    assert loss_agg == "seq-mean-token-mean"  # D_b = S n_b
    return -sum(ROW_ADVANTAGES) / len(n)


def test_world_sizes_1_and_2_take_the_same_step(stepped1, stepped2, store):
    before, after2, resp2 = stepped2
    after1, resp1 = stepped1
    assert (after1 - after2).abs().max() < RANKS_TOL
    assert (after1 - before).abs().max() > 100 * RANKS_TOL
    # Adam's first update hardly depends on the gradient's scale: grad_norm is what shows that FSDP's averaging
    # over ranks is compensated (without it world size 2 has half the gradient)
    for key in ("loss", "pg_loss", "entropy", "grad_norm", "tokens/trained", "clip_frac"):
        assert resp1["metrics"][key] == pytest.approx(resp2["metrics"][key], rel=1e-4, abs=1e-6), key
    assert resp1["metrics"]["loss"] == pytest.approx(loss_at_start(store, "token-mean"), rel=1e-4)


def test_repeated_step_is_a_no_op_and_a_skipped_step_conflicts(actor1, store, stepped1):
    after1, resp1 = stepped1
    r = train(actor1, store, 1)
    assert r.status_code == 200 and r.json()["replayed"] and r.json()["metrics"] == resp1["metrics"]
    assert torch.equal(actor_logprobs(actor1, load_rows(store)), after1)
    for step, run_id in [(3, RUN), (2, "other-run")]:
        r = train(actor1, store, step, run_id)
        assert r.status_code == 409 and "step 1 of run 'run-a'" in r.json()["error"]
    with client(actor1) as c:
        assert c.get("/health").json()["last_step"] == 1


def test_kl_against_the_reference_model(actor1, store, stepped1):
    assert stepped1[1]["metrics"]["kl"] == 0  # step 1 started from the reference weights
    r = train(actor1, store, 2, kl_coef=0.1, kl_estimator="k2")
    assert r.status_code == 200, r.text
    assert r.json()["metrics"]["kl"] > 0  # step 2 starts from weights one step away


def test_stale_tokens_are_masked(actor1, store, stepped1):
    # the tokens were sampled at version 0 and the actor is past version 1: max_staleness 1 masks them all
    with client(actor1) as c:
        step = c.get("/health").json()["last_step"] + 1
    r = train(actor1, store, step, max_staleness=1)
    assert r.status_code == 200, r.text
    m = r.json()["metrics"]
    assert m["tokens/trained"] == 0 and m["stale_masked"] == m["tokens/sampled"] == m[f"staleness/{step - 1}"] > 0


def test_checkpoint_round_trip_into_a_fresh_actor(actor1, store, stepped1, tiny_model, tmp_path):
    rows = load_rows(store)
    with client(actor1) as c:
        health = c.get("/health").json()
        r = c.post("/checkpoint/save", json={"path": str(tmp_path / "ckpt")})
        assert r.status_code == 200, r.text
        assert r.json()["step"] == health["last_step"] >= 1
    (tmp_path / "fresh").mkdir()
    with actor_server(tiny_model, tmp_path / "fresh", 2) as fresh, client(fresh) as c:
        r = c.post("/checkpoint/load", json={"path": str(tmp_path / "ckpt")})
        assert r.status_code == 200, r.text
        assert {k: v for k, v in c.get("/health").json().items() if k != "world_size"} == \
               {k: v for k, v in health.items() if k != "world_size"}
        assert (actor_logprobs(fresh, rows) - actor_logprobs(actor1, rows)).abs().max() < RANKS_TOL
        # the step log travelled with the checkpoint: its steps replay, not retrain
        assert train(fresh, store, 1).json()["replayed"]
        # optimizer state travelled too: the next step (Adam moments) agrees. It aggregates per sequence (divisors
        # that differ by row), which must be exact across world sizes 2 (fresh) and 1 and their micro-batches.
        next_step = health["last_step"] + 1
        seq_mean = {"loss_agg": "seq-mean-token-mean"}
        r2, r1 = train(fresh, store, next_step, **seq_mean), train(actor1, store, next_step, **seq_mean)
        assert r2.status_code == 200 and r1.status_code == 200, (r2.text, r1.text)
        assert (actor_logprobs(fresh, rows) - actor_logprobs(actor1, rows)).abs().max() < RANKS_TOL
        for key in ("loss", "grad_norm", "pg_loss"):
            assert r2.json()["metrics"][key] == pytest.approx(r1.json()["metrics"][key], rel=1e-4, abs=1e-6), key
        assert r1.json()["metrics"]["loss"] == pytest.approx(loss_at_start(store, "seq-mean-token-mean"), rel=1e-4)
        r = c.post("/checkpoint/load", json={"path": str(tmp_path / "missing")})
        assert r.status_code == 400 and "missing" in r.json()["error"]


def test_a_save_clears_what_saves_killed_midway_left(actor1, tmp_path):
    """A save killed midway (kill -9: no cleanup of its own) leaves a half-written .<name>.tmp-<pid>, or the checkpoint
    it replaced as .<name>.old-<pid>: each a whole checkpoint's bytes on the disk for good. The next save clears them,
    and puts back an old one whose replacement never landed (killed between the two renames). Other names stay."""
    ckpts = tmp_path / "checkpoints"
    for name in [".step-3.tmp-99999", ".step-2.old-12345", "step-2", ".step-1.old-4242", ".keep", ".step-5.tmp-x"]:
        (ckpts / name).mkdir(parents=True)
        (ckpts / name / "model.safetensors").write_bytes(name.encode())
    with client(actor1) as c:
        assert c.post("/checkpoint/save", json={"path": str(ckpts / "step-4")}).status_code == 200
    assert sorted(p.name for p in ckpts.iterdir()) == [".keep", ".step-5.tmp-x", "step-1", "step-2", "step-4"]
    assert (ckpts / "step-1" / "model.safetensors").read_bytes() == b".step-1.old-4242"
    assert (ckpts / "step-2" / "model.safetensors").read_bytes() == b"step-2"


def test_reset_starts_another_run_from_the_initial_weights(store, tiny_model, tmp_path):
    """One actor serves run after run: /reset brings back the --model weights, a fresh optimizer and an empty step
    log, so a second run's step 1 is the same update as the first run's step 1 was."""
    rows = load_rows(store)
    with actor_server(tiny_model, tmp_path, 1) as url, client(url) as c:
        initial = actor_logprobs(url, rows)
        first = train(url, store, 1, run_id="first").json()
        after_first = actor_logprobs(url, rows)
        assert train(url, store, 2, run_id="first").status_code == 200
        assert train(url, store, 1, run_id="second").status_code == 409  # holds step 2 of run first
        r = c.post("/reset", json={})
        assert r.status_code == 200, r.text
        assert (r.json()["run_id"], r.json()["last_step"], r.json()["version"]) == (None, 0, 0)
        assert (actor_logprobs(url, rows) - initial).abs().max() == 0
        second = train(url, store, 1, run_id="second").json()
        assert not second["replayed"]
        assert second["metrics"]["pg_loss"] == pytest.approx(first["metrics"]["pg_loss"], abs=1e-7)
        assert (actor_logprobs(url, rows) - after_first).abs().max() < RANKS_TOL
        # the log is the second run's now: the first run's steps are no longer in these weights
        assert c.get("/health").json()["run_id"] == "second"
        assert train(url, store, 1, run_id="first").status_code == 409


def test_bad_requests_get_clear_errors_and_the_actor_keeps_serving(actor1, store, tmp_path):
    root, refs = store
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    body = {"run_id": RUN, "step": 99, "store_root": root, "trajectories": refs}
    with client(actor1) as c:
        r = c.post("/train_step", json={**body, "learning_rate": 1})
        assert r.status_code == 400 and "learning_rate" in r.json()["error"]
        last = c.get("/health").json()["last_step"]
        body["step"] = last + 1
        r = c.post("/train_step", json={**body, "trajectories": refs + ["run-a/nope.safetensors"]})
        assert r.status_code == 400 and "run-a/nope.safetensors" in r.json()["error"]
        r = c.post("/train_step", json={**body, "store_root": str(tmp_path), "trajectories": ["bad.safetensors"]})
        assert r.status_code == 400 and "bad.safetensors" in r.json()["error"]
        r = c.post("/logprobs", json={"token_ids": [[1, 100000]]})
        assert r.status_code == 400 and "token_ids[0]" in r.json()["error"]
        r = c.post("/push_weights", json={"engines": [{"url": actor1}], "version": 5})  # not an engine
        assert r.status_code == 502 and "404" in r.json()["error"]
        assert c.get("/health").json()["last_step"] == last
    r = httpx.get(f"{actor1}/health", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "token" in r.json()["error"]


def test_unknown_model_dir_is_a_clear_error(tmp_path):
    out = subprocess.run([PY, str(GPU / "actor.py"), "--model", str(tmp_path / "no-model"), "--port", "1",
                          "--token", TOKEN, "--state-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "no-model" in out.stderr and "does not exist" in out.stderr


def natural_routes(model, tokens: list[int]) -> torch.Tensor:
    """The experts the model's own routers pick in the forward that produces each token's logits (the position
    before it), as an engine records them: [T, layers, top_k], -1 for token 0."""
    picked = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: picked.append(out[2]))
             for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
    with torch.no_grad():
        model(input_ids=torch.tensor([tokens]))
    for h in hooks:
        h.remove()
    by_position = torch.stack(picked, dim=1)  # [T, layers, k]
    return torch.cat([torch.full_like(by_position[:1], -1), by_position[:-1]])


def test_moe_routing_replay(tiny_moe_model, tmp_path):
    from common import load_causal_lm
    model = load_causal_lm(str(tiny_moe_model), device=torch.device("cpu"))
    sequences = [list(b"route me please"), list(b"and me, too!")]
    (tmp_path / "state").mkdir()
    with actor_server(tiny_moe_model, tmp_path / "state", 1) as url:
        with client(url) as c:
            rollout = c.post("/logprobs", json={"token_ids": sequences}).json()["logprobs"]  # natural routing

        def step(step: int, name: str, routes_of) -> httpx.Response:
            refs = []
            for i, tokens in enumerate(sequences):
                mask = [0] * 4 + [1] * (len(tokens) - 4)
                save_file({"tokens": torch.tensor(tokens, dtype=torch.int32),
                           "logprobs": torch.tensor(rollout[i]) * torch.tensor(mask),
                           "versions": torch.tensor([0 if m else -1 for m in mask], dtype=torch.int32),
                           "loss_mask": torch.tensor(mask, dtype=torch.uint8),
                           "routed_experts": routes_of(tokens).to(torch.int16)},
                          str(tmp_path / f"{name}-{i}.safetensors"),
                          metadata={"format": "molt-trajectory-v1", "run": "moe", "group": "0", "episode": str(i),
                                    "segment": "0", "reward": str(float(i)), "finish": "length"})
                refs.append(f"{name}-{i}.safetensors")
            with client(url) as c:
                # lr so small that the weights stay put: every step sees the version-0 policy
                return c.post("/train_step", json={"run_id": "moe", "step": step, "store_root": str(tmp_path),
                                                   "trajectories": refs,
                                                   "algo": {"lr": 1e-12, "routing_replay": True}})

        # replaying the experts the routers pick anyway changes nothing
        r = step(1, "natural", lambda t: natural_routes(model, t))
        assert r.status_code == 200, r.text
        assert r.json()["metrics"]["rollout_logp_max_abs_diff"] < 1e-5
        # the other experts (4 experts, top 2: the complement) change the logprobs: the routes were applied
        complement = lambda t: torch.stack([torch.tensor([e for e in range(4) if e not in row] if row[0] >= 0 else row)
                                            for row in natural_routes(model, t).reshape(-1, 2).tolist()]
                                           ).reshape(len(t), -1, 2)
        r = step(2, "complement", complement)
        assert r.status_code == 200, r.text
        assert r.json()["metrics"]["rollout_logp_max_abs_diff"] > 1e-3
        # routes that do not fit the model
        r = step(3, "bad", lambda t: torch.zeros(len(t), 5, 2))
        assert r.status_code == 400 and "does not fit the model" in r.json()["error"]


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only), filled and freed by the test: a disk that runs full."""
    import os
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)], check=True)
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=True)


def fill(disk) -> None:
    with open(disk / "filler", "wb", buffering=0) as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 4096)


def test_a_full_disk_is_named_and_the_actor_goes_on_once_there_is_room(store, tiny_model, small_disk):
    """The state dir and the checkpoint on a full disk: each failed write says ENOSPC and names its path, leaves no
    temp file, and a step whose log line could not be written is still applied once (the retry is answered)."""
    (small_disk / "state").mkdir()
    with actor_server(tiny_model, small_disk / "state", 1) as url, client(url) as c:
        fill(small_disk)
        r = train(url, store, 1)
        assert r.status_code == 507 and r.json()["error"] == \
            f"[Errno 28] no space left on device (ENOSPC) writing {small_disk / 'state' / 'steps.jsonl'}"
        ckpt = small_disk / "ckpt"
        r = c.post("/checkpoint/save", json={"path": str(ckpt)})
        assert r.status_code == 507 and r.json()["error"] == f"[Errno 28] no space left on device (ENOSPC) writing {ckpt}"
        assert sorted(p.name for p in small_disk.iterdir()) == ["filler", "state"]  # no half-written checkpoint
        (small_disk / "filler").unlink()
        r = train(url, store, 1)
        assert r.status_code == 200 and r.json()["replayed"], r.text  # applied once, before the disk was full
        assert train(url, store, 2).status_code == 200
        log = [json.loads(line) for line in (small_disk / "state" / "steps.jsonl").read_text().splitlines()]
        assert [e["step"] for e in log] == [1, 2]
        assert c.post("/checkpoint/save", json={"path": str(ckpt)}).status_code == 200
        assert (ckpt / "optimizer.pt").is_file()
        assert sorted(p.name for p in small_disk.iterdir()) == ["ckpt", "state"]


def test_init_starts_a_run_from_other_weights_in_policy_and_reference(store, tiny_model, tmp_path):
    """/init: the policy and the KL reference take the weights of another directory, at step 0 of the run;
    a directory that does not fit is a 400 naming it, and the actor keeps serving."""
    import shutil
    from safetensors.torch import load_file as load
    other = tmp_path / "other"
    shutil.copytree(tiny_model, other)
    for f in other.glob("*.safetensors"):
        save_file({k: v * 1.5 for k, v in load(str(f)).items()}, str(f), metadata={"format": "pt"})
    rows = load_rows(store)
    (tmp_path / "state").mkdir()
    with actor_server(tiny_model, tmp_path / "state", 1, "--ref-model", str(tiny_model)) as url, client(url) as c:
        base = actor_logprobs(url, rows)
        r = c.post("/init", json={"run_id": RUN, "path": str(tmp_path / "missing")})
        assert r.status_code == 400 and str(tmp_path / "missing") in r.json()["error"], r.text
        r = c.post("/init", json={"run_id": RUN, "path": str(other)})
        assert r.status_code == 200, r.text
        health = c.get("/health").json()
        assert (health["run_id"], health["last_step"], health["version"]) == (RUN, 0, 0)
        assert (actor_logprobs(url, rows) - base).abs().max() > 0.05  # other weights in the policy
        r = train(url, store, 1, kl_coef=0.1)
        assert r.status_code == 200, r.text
        assert abs(r.json()["metrics"]["kl"]) < 1e-6  # the reference is the same starting point


def test_refits_keep_the_transfer_group_until_the_engines_change(tiny_model, tmp_path):
    """A push to the engines of the last push makes no new group (no rendezvous); an engine added or left out, or one
    that restarted (it does not hold the group), makes a new one, and every engine gets the version. A dead engine
    fails the push at once, and the next push without it goes on."""
    (tmp_path / "actor").mkdir()
    ports = [free_port(), free_port()]

    def engine_on(port: int, life: str):
        return service([PY, str(GPU / "engine.py"), "--model", str(tiny_model), "--port", str(port), "--token", TOKEN],
                       port, tmp_path / f"engine-{port}-{life}.log")

    with actor_server(tiny_model, tmp_path / "actor", 1) as a, client(a) as c, engine_on(ports[0], "1") as e1:
        def push(engines: list[str], version: int) -> dict:
            r = c.post("/push_weights", json={"engines": [{"url": e} for e in engines], "version": version})
            assert r.status_code == 200, r.text
            for e in engines:
                assert client(e).get("/health").json()["version"] == version
            return r.json()

        assert push([e1], 1)["new_group"] and not push([e1], 2)["new_group"]
        with engine_on(ports[1], "1") as e2:
            assert push([e1, e2], 3)["new_group"] and not push([e1, e2], 4)["new_group"]
        with engine_on(ports[1], "2") as e2:  # the same address, a new process
            assert push([e1, e2], 5)["new_group"] and not push([e1, e2], 6)["new_group"]
        r = c.post("/push_weights", json={"engines": [{"url": e1}, {"url": e2}], "version": 7}, timeout=25)
        assert r.status_code == 502 and e2 in r.json()["error"]  # its address refuses connections
        assert push([e1], 8)["new_group"] and not push([e1], 9)["new_group"]
