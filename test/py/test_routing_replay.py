"""MoE routing replay (invariant 3 for mixture-of-experts): the engine records each sampled token's experts, the
actor trains through exactly those.

The controlled difference: the engine runs the tiny Qwen3-MoE in bfloat16, the actor in float32. The random
tiny router rarely has near-ties (about 1 token in 200 flips), so the test model's router row of expert 1 is
moved next to that of expert 0 (as in an upcycled MoE whose experts started as copies): bf16 rounding then flips
the top-2 of many tokens, while the experts themselves stay different.
"""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import actor_server, client, engine_server

torch.set_num_threads(1)
PROMPTS = [list(f"prompt {i}: ".encode()) for i in range(12)]
NEW_TOKENS = 32
TIE = 0.003  # router row 1 := row 0 + TIE * (row 1 - row 0)


@pytest.fixture(scope="module")
def tied_moe_model(tiny_moe_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / "tied-moe"
    shutil.copytree(tiny_moe_model, out)
    weights = load_file(str(out / "model.safetensors"))
    for name, w in weights.items():
        if name.endswith("mlp.gate.weight"):  # [experts, hidden]
            w[1] = w[0] + TIE * (w[1] - w[0])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def bf16_engine(tied_moe_model, tmp_path_factory):
    with engine_server(tied_moe_model, tmp_path_factory.mktemp("bf16-engine"), "--dtype", "bfloat16") as url:
        yield url


@pytest.fixture(scope="module")
def actor(tied_moe_model, tmp_path_factory):
    state = tmp_path_factory.mktemp("actor")
    with actor_server(tied_moe_model, state, 1) as url:
        yield {"url": url, "step": 0}


def generate(url: str, prompt: list[int], seed: int, **extra) -> dict:
    body = {"prompt_token_ids": prompt, "sampling": {"max_tokens": NEW_TOKENS, "seed": seed}, **extra}
    with client(url) as c:
        r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def write_trajectory(path, prompt: list[int], out: dict, episode: int = 0, reward: float = 0.0) -> None:
    """As the rollout worker stores it: routed_experts aligned with the tokens, -1 rows for the prompt."""
    routes = torch.tensor(out["routed_experts"], dtype=torch.int16)  # [n, layers, k]
    n = len(out["token_ids"])
    save_file({"tokens": torch.tensor(prompt + out["token_ids"], dtype=torch.int32),
               "logprobs": torch.tensor([0.0] * len(prompt) + out["logprobs"]),
               "versions": torch.tensor([-1] * len(prompt) + out["versions"], dtype=torch.int32),
               "loss_mask": torch.tensor([0] * len(prompt) + [1] * n, dtype=torch.uint8),
               "routed_experts": torch.cat([torch.full((len(prompt), *routes.shape[1:]), -1, dtype=torch.int16), routes])},
              str(path), metadata={"format": "molt-trajectory-v1", "run": "moe", "group": "0", "episode": str(episode),
                                   "segment": "0", "reward": str(reward), "finish": "length"})


def train_step(actor: dict, store, refs: list[str], **algo) -> dict:
    actor["step"] += 1
    with client(actor["url"]) as c:
        r = c.post("/train_step", json={"run_id": "moe", "step": actor["step"], "store_root": str(store),
                                        "trajectories": refs, "algo": {"lr": 1e-12, **algo}})
    assert r.status_code == 200, r.text
    return r.json()["metrics"]


def routes_by_position(model, tokens: list[int], replay_routes: torch.Tensor | None = None):
    """Forward one sequence in-process; returns (logp [T] of each token, the experts each position actually ran
    [T, layers, k]), replaying replay_routes [T, layers, k] (by input position) if given."""
    from actor import moe_routing, token_logprobs
    ran = []
    hooks = [m.register_forward_pre_hook(lambda _m, args: ran.append(args[1]))  # (hidden, top_k_index, weights)
             for m in model.modules() if type(m).__name__ == "Qwen3MoeExperts"]
    routes = None if replay_routes is None else replay_routes[None]
    with torch.no_grad(), moe_routing(model, routes, replay=replay_routes is not None):
        x = torch.tensor([tokens])
        logp = token_logprobs(model(input_ids=x).logits, x)[0]
    for h in hooks:
        h.remove()
    return logp, torch.stack(ran, dim=1)


def test_engine_records_the_experts_of_each_sampled_token(bf16_engine, tiny_model, tmp_path):
    prompt = PROMPTS[0]
    out = generate(bf16_engine, prompt, seed=3, return_routed_experts=True)
    routes = torch.tensor(out["routed_experts"])
    assert routes.shape == (NEW_TOKENS, 2, 2)  # [tokens, layers, top_k]
    assert routes.min() >= 0 and routes.max() < 4 and (routes[..., 0] != routes[..., 1]).all()
    assert generate(bf16_engine, prompt, seed=3)["routed_experts"] is None  # only when asked
    # streamed chunks carry the same records
    body = {"prompt_token_ids": prompt, "sampling": {"max_tokens": NEW_TOKENS, "seed": 3}, "stream": True,
            "return_routed_experts": True}
    with client(bf16_engine) as c, c.stream("POST", "/generate", json=body) as r:
        chunks = [json.loads(line) for line in r.iter_lines() if line]
    assert [t for ch in chunks for t in ch["token_ids"]] == out["token_ids"]
    assert [e for ch in chunks for e in ch["routed_experts"]] == out["routed_experts"]
    # a dense model has nothing to record: a clear 400
    with engine_server(tiny_model, tmp_path) as dense, client(dense) as c:
        r = c.post("/generate", json={"prompt_token_ids": [1, 2], "return_routed_experts": True})
        assert r.status_code == 400 and "no MoE routers" in r.json()["error"]


def test_replay_makes_the_actor_run_the_engines_experts(bf16_engine, actor, tied_moe_model, tmp_path):
    from common import load_causal_lm
    refs = []
    for i, prompt in enumerate(PROMPTS):
        out = generate(bf16_engine, prompt, seed=i, return_routed_experts=True)
        write_trajectory(tmp_path / f"t{i}.safetensors", prompt, out, episode=i)
        refs.append(f"t{i}.safetensors")

    # in-process, fp32: with replay every sampled token's forward runs exactly the recorded experts
    model = load_causal_lm(str(tied_moe_model), device=torch.device("cpu"))
    flipped = 0
    for ref in refs:
        t = load_file(str(tmp_path / ref))
        tokens, sampled = t["tokens"].tolist(), t["loss_mask"].bool()
        recorded = t["routed_experts"].long()  # [T, layers, k], token-aligned
        by_position = torch.cat([recorded[1:], torch.full_like(recorded[:1], -1)])  # token t's experts ran at t-1
        at = sampled.nonzero()[:, 0] - 1  # the positions whose forward produced a sampled token
        _, own = routes_by_position(model, tokens)
        _, ran = routes_by_position(model, tokens, by_position)
        assert torch.equal(ran[at], recorded[sampled])  # same experts, same order, every layer
        flipped += (own[at].sort(-1).values != recorded[sampled].sort(-1).values).flatten(1).any(-1).sum().item()
    assert flipped > 0  # without replay the actor's own routing differs for some tokens

    # the actor: the same trajectories without and with replay (lr ~0: both steps see the same weights)
    off = train_step(actor, tmp_path, refs, routing_replay=False)
    on = train_step(actor, tmp_path, refs, routing_replay=True)
    print(f"\nbf16 engine vs fp32 actor, {int(off['tokens/sampled'])} sampled tokens, {flipped} with other experts: "
          f"logprob |diff| without replay mean {off['rollout_logp_mean_abs_diff']:.2e} max {off['rollout_logp_max_abs_diff']:.2e}; "
          f"with replay mean {on['rollout_logp_mean_abs_diff']:.2e} max {on['rollout_logp_max_abs_diff']:.2e}; "
          f"routing agreement {off['routing/agreement']:.3f}")
    assert off["routing/agreement"] == pytest.approx(1 - flipped / off["tokens/sampled"])
    assert on["rollout_logp_mean_abs_diff"] < 0.7 * off["rollout_logp_mean_abs_diff"]
    assert on["rollout_logp_max_abs_diff"] < off["rollout_logp_max_abs_diff"]
    assert off["routing/unrecorded"] == on["routing/unrecorded_masked"] == 0
    assert on["tokens/trained"] == off["tokens/trained"] == off["tokens/sampled"]

    # tokens the engine could not route: masked from the loss and counted with replay on, trained without it
    t = load_file(str(tmp_path / refs[0]))
    t["routed_experts"][-5:] = -1
    save_file(t, str(tmp_path / "unrouted.safetensors"), metadata=load_metadata(tmp_path / refs[0]))
    m = train_step(actor, tmp_path, ["unrouted.safetensors", *refs[1:]], routing_replay=True)
    assert m["routing/unrecorded"] == m["routing/unrecorded_masked"] == 5
    assert m["tokens/trained"] == on["tokens/trained"] - 5
    m = train_step(actor, tmp_path, ["unrouted.safetensors", *refs[1:]], routing_replay=False)
    assert m["routing/unrecorded"] == 5 and m["routing/unrecorded_masked"] == 0
    assert m["tokens/trained"] == on["tokens/trained"]


def load_metadata(path) -> dict:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return f.metadata()


def test_replay_across_a_refit(actor, tied_moe_model, tmp_path):
    """A request held across a weight push: each token's experts are those of the version that sampled it."""
    from common import load_causal_lm
    prompt = PROMPTS[1]
    with engine_server(tied_moe_model, tmp_path) as engine:  # fp32, so its records can be checked exactly
        # a real step (two episodes, rewards 0 and 1), so version 'new' routes differently
        for i in range(2):
            out = generate(engine, prompt, seed=i, return_routed_experts=True)
            write_trajectory(tmp_path / f"a{i}.safetensors", prompt, out, episode=i, reward=float(i))
        train_step(actor, tmp_path, ["a0.safetensors", "a1.safetensors"], routing_replay=True, lr=3e-2)
        new = actor["step"]
        body = {"prompt_token_ids": prompt, "sampling": {"max_tokens": NEW_TOKENS, "seed": 2}, "stream": True,
                "return_routed_experts": True}
        with client(engine) as c, c.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            chunks = [json.loads(next(lines))]
            assert c.post("/pause", json={"mode": "keep"}).status_code == 200
            with client(actor["url"]) as a:
                assert a.post("/push_weights", json={"engines": [{"url": engine}], "version": new}).status_code == 200
            assert c.post("/resume").status_code == 200
            chunks += [json.loads(line) for line in lines if line]
    out = {k: [x for ch in chunks for x in ch[k]] for k in ("token_ids", "logprobs", "versions", "routed_experts")}
    versions = torch.tensor(out["versions"])
    assert (versions == 0).any() and (versions == new).any() and chunks[-1]["finish_reason"] == "length"

    # teacher-forced routing of the whole sequence under each version's weights
    with client(actor["url"]) as a:
        assert a.post("/checkpoint/save", json={"path": str(tmp_path / "new")}).status_code == 200
    tokens = prompt + out["token_ids"]
    at = torch.arange(len(prompt), len(tokens)) - 1  # the positions whose forward produced each sampled token
    old_routes = routes_by_position(load_causal_lm(str(tied_moe_model), device=torch.device("cpu")), tokens)[1][at]
    new_routes = routes_by_position(load_causal_lm(str(tmp_path / "new"), device=torch.device("cpu")), tokens)[1][at]
    recorded = torch.tensor(out["routed_experts"])
    assert not torch.equal(old_routes, new_routes)  # the versions route differently, so the check below can fail
    assert torch.equal(recorded[versions == 0], old_routes[versions == 0])
    assert torch.equal(recorded[versions == new], new_routes[versions == new])

    # and the actor replays them: every token has a record, nothing is masked
    write_trajectory(tmp_path / "refit.safetensors", prompt, out)
    m = train_step(actor, tmp_path, ["refit.safetensors"], routing_replay=True)
    assert m["routing/unrecorded_masked"] == 0 and m["tokens/trained"] == NEW_TOKENS
