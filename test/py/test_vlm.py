"""A tiny Qwen3-VL policy through the real engine and actor processes: images processed once by the engine and
stored content-addressed, a multi-turn image conversation generated over the expanded placeholder ids, and the
actor's logprobs on the stored segment (the same stored pixel values) equal to the engine's; an image processed at
another resolution gives other logprobs (so the check sees re-processing); an FSDP2 step with the vision tower
frozen or trained; bad images get a 400 naming the problem; a Qwen3-VL-MoE's recorded experts replayed by the actor."""
import base64
import io
import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import actor_server, client, engine_server

torch.set_num_threads(1)
TOL = 1e-4  # engine vs actor, fp32 on CPU
RUN = "run-vlm"
IM_START, IM_END, V_START, V_END, IMAGE_PAD = 257, 258, 259, 260, 261
NO_ROUTE = [[-1, -1]] * 2  # the tiny MoE VLM's record for a token it did not sample: [layers][top_k]


def png(size=(64, 48), shape=((5, 40), (58, 8), (30, 44)), colour="red") -> bytes:
    img = Image.new("RGB", (64, 48), "white")
    ImageDraw.Draw(img).polygon(shape, outline="black", fill=colour)
    buf = io.BytesIO()
    img.resize(size).save(buf, format="PNG")
    return buf.getvalue()


def text(s: str) -> list[int]:
    return list(s.encode())


def user_turn(parts: list) -> list[int]:
    """ChatML user turn; an int part is an image of that many placeholders (the processor's expansion)."""
    ids = [IM_START] + text("user\n")
    for p in parts:
        ids += [V_START] + [IMAGE_PAD] * p + [V_END] if isinstance(p, int) else text(p)
    return ids + [IM_END] + text("\n") + [IM_START] + text("assistant\n")


def post_image(c, data: bytes, directory) -> dict:
    r = c.post("/images", json={"data": base64.b64encode(data).decode(), "dir": str(directory)})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def engine(tiny_vlm, tmp_path_factory):
    with engine_server(tiny_vlm, tmp_path_factory.mktemp("engine")) as url:
        yield url


def run_episode(c, root, episode: int, reward: float, routes: bool = False) -> dict:
    """Two turns: [triangle] -> reply, [square, triangle again] -> reply; one segment, written as the rollout worker
    writes it, with its images stored once in the episode's image folder (and with routes, an MoE model: the experts
    the engine recorded with each sampled token, -1 rows for the others)."""
    images_dir = root / RUN / "trajectories" / "g0" / f"e{episode}-images"
    tri = post_image(c, png(), images_dir)
    square = post_image(c, png(shape=((8, 8), (56, 8), (56, 40), (8, 40)), colour="blue"), images_dir)
    assert post_image(c, png(), images_dir)["path"] == tri["path"]  # content-addressed: the same file
    assert tri["grid_thw"] == [1, 6, 8] and tri["tokens"] == 12  # 48x64 pixels, patch 8, merge 2
    tokens, logprobs, versions, mask, paths, experts = [], [], [], [], [], []
    for turn, (parts, images) in enumerate([([tri["tokens"], "angle?"], [tri]),
                                            ([square["tokens"], "and ", tri["tokens"], "?"], [square, tri])]):
        prompt = (text("\n") if turn else []) + user_turn(parts)
        tokens += prompt
        logprobs += [0.0] * len(prompt)
        versions += [-1] * len(prompt)
        mask += [0] * len(prompt)
        experts += [NO_ROUTE] * len(prompt)
        paths += [im["path"] for im in images]
        r = c.post("/generate", json={"prompt_token_ids": tokens, "images": paths, "return_routed_experts": routes,
                                      "sampling": {"max_tokens": 6, "seed": 10 * episode + turn,
                                                   "stop_token_ids": [IM_END]}})
        assert r.status_code == 200, r.text
        out = r.json()
        closed = out["token_ids"][-1] == IM_END  # else the turn's end is context, not sampled
        tokens += out["token_ids"] + ([] if closed else [IM_END])
        logprobs += out["logprobs"] + ([] if closed else [0.0])
        versions += out["versions"] + ([] if closed else [-1])
        mask += [1] * len(out["token_ids"]) + ([] if closed else [0])
        experts += (out["routed_experts"] or []) + ([] if closed else [NO_ROUTE])
    ref = f"{RUN}/trajectories/g0/e{episode}-s0.safetensors"
    segment = {"tokens": torch.tensor(tokens, dtype=torch.int32), "logprobs": torch.tensor(logprobs),
               "versions": torch.tensor(versions, dtype=torch.int32), "loss_mask": torch.tensor(mask, dtype=torch.uint8)}
    if routes:
        segment["routed_experts"] = torch.tensor(experts, dtype=torch.int16)  # [T, layers, top_k]
    save_file(segment, str(root / ref), metadata={
        "format": "molt-trajectory-v1", "run": RUN, "group": "0", "episode": str(episode), "segment": "0",
        "reward": str(reward), "finish": "stop", "images": json.dumps([str(Path(p).relative_to(root)) for p in paths])})
    return {"root": root, "ref": ref, "tokens": tokens, "logprobs": torch.tensor(logprobs),
            "mask": torch.tensor(mask, dtype=torch.bool), "paths": paths, "images_dir": images_dir}


@pytest.fixture(scope="module")
def episodes(engine, tmp_path_factory) -> list[dict]:
    """One group of two episodes with rewards 1 and 0."""
    root = tmp_path_factory.mktemp("store")
    with client(engine) as c:
        return [run_episode(c, root, 0, 1.0), run_episode(c, root, 1, 0.0)]


@pytest.fixture(scope="module")
def episode(episodes) -> dict:
    return episodes[0]


def logprobs(actor, tokens, paths) -> torch.Tensor:
    with client(actor) as c:
        r = c.post("/logprobs", json={"token_ids": [tokens], "images": [paths]})
    assert r.status_code == 200, r.text
    return torch.tensor(r.json()["logprobs"][0])


@pytest.fixture(scope="module")
def actor(tiny_vlm, tmp_path_factory):
    with actor_server(tiny_vlm, tmp_path_factory.mktemp("actor"), 1) as url:
        yield url


def test_actor_matches_engine_on_a_multi_turn_image_conversation(engine, episode, actor):
    tokens, mask = episode["tokens"], episode["mask"]
    assert tokens.count(IMAGE_PAD) == 36 and len(set(episode["paths"])) == 2  # 3 image uses, 2 files
    assert len(list(episode["images_dir"].iterdir())) == 2  # stored once per episode, not per turn
    diff = (logprobs(actor, tokens, episode["paths"]) - episode["logprobs"])[mask].abs().max().item()
    print(f"engine vs actor max |logprob diff| on the sampled tokens of the image conversation: {diff:.2e}")
    assert diff < TOL
    # the image processed at another resolution (66x46 instead of 64x48: the same 6x8 grid, so the same
    # placeholders) feeds other pixel values: the logprobs move well beyond the tolerance
    with client(engine) as c:
        other = post_image(c, png(size=(66, 46)), episode["images_dir"].parent / "other")
    assert other["grid_thw"] == [1, 6, 8]
    paths = [other["path"] if p == episode["paths"][0] else p for p in episode["paths"]]
    assert (logprobs(actor, tokens, paths) - episode["logprobs"])[mask].abs().max() > 10 * TOL
    sizes = sum(p.stat().st_size for p in episode["images_dir"].iterdir())
    print(f"stored bytes of the episode: images {sizes}, segment {(episode['root'] / episode['ref']).stat().st_size}")


def train(actor, episodes, step=1):
    with client(actor) as c:
        t0 = time.time()
        r = c.post("/train_step", json={"run_id": RUN, "step": step, "store_root": str(episodes[0]["root"]),
                                        "trajectories": [e["ref"] for e in episodes], "algo": {"lr": 1e-2}})
        assert r.status_code == 200, r.text
        print(f"VLM train step: {time.time() - t0:.2f} s (actor: {r.json()['metrics']['time/total']:.2f} s)")
        return r.json()["metrics"]


def saved(actor, path) -> dict:
    with client(actor) as c:
        assert c.post("/checkpoint/save", json={"path": str(path)}).status_code == 200
    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("freeze", [False, True])
def test_fsdp2_step_trains_on_the_stored_images_with_the_vision_tower_frozen_or_not(
        tiny_vlm, engine, episodes, freeze, tmp_path):
    (tmp_path / "state").mkdir()
    with actor_server(tiny_vlm, tmp_path / "state", 2 if freeze else 1, *(["--freeze-vision"] if freeze else [])) as a:
        before = saved(a, tmp_path / "before")
        m = train(a, episodes)
        assert m["rollout_logp_max_abs_diff"] < TOL and m["grad_norm"] > 0, m
        after = saved(a, tmp_path / "after")
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    vision = {n for n in before if ".visual." in n}
    assert moved - vision  # the language model trained
    assert (moved & vision == set()) if freeze else (moved & vision)


def test_a_refit_sends_the_frozen_vision_tower_only_to_engines_that_lack_it(tiny_vlm, episodes, tmp_path):
    """--freeze-vision: the first push to an engine, and the first after the actor loads other weights, send every
    tensor; the pushes between leave the vision tower out (no step changes it). After each one the engine's logprobs
    of an image conversation it samples equal the actor's."""
    other = tmp_path / "other-vision"  # the tiny VLM with another vision tower
    shutil.copytree(tiny_vlm, other)
    weights = load_file(str(other / "model.safetensors"))
    vision = {n for n in weights if ".visual." in n}
    g = torch.Generator().manual_seed(0)
    save_file({n: t + 0.2 * torch.randn(t.shape, generator=g) if n in vision else t for n, t in weights.items()},
              str(other / "model.safetensors"))
    vision_bytes = sum(weights[n].numel() * weights[n].element_size() for n in vision)
    (tmp_path / "state").mkdir()
    with engine_server(tiny_vlm, tmp_path) as e, client(e) as ec, \
            actor_server(tiny_vlm, tmp_path / "state", 1, "--freeze-vision") as a, client(a) as c:
        def push(version: int) -> int:
            r = c.post("/push_weights", json={"engines": [{"url": e}], "version": version})
            assert r.status_code == 200, r.text
            out = run_episode(ec, tmp_path, 10 + version, 0.0)  # sampled by the engine at this version
            assert (logprobs(a, out["tokens"], out["paths"]) - out["logprobs"])[out["mask"]].abs().max() < TOL
            return r.json()["bytes"]

        full = push(0)
        train(a, episodes)
        assert full - push(1) == vision_bytes > 0
        assert c.post("/init", json={"run_id": "other", "path": str(other)}).status_code == 200
        assert push(0) == full


def test_bad_images_and_placeholder_counts_are_400s(engine, episode, tiny_model, tmp_path):
    with client(engine) as c:
        def image(data: bytes) -> str:
            r = c.post("/images", json={"data": base64.b64encode(data).decode(), "dir": str(tmp_path)})
            assert r.status_code == 400
            return r.json()["error"]
        assert "does not decode" in image(b"not an image at all")
        buf = io.BytesIO()
        Image.new("RGB", (8, 8)).save(buf, format="BMP")
        assert "format BMP is not supported" in image(buf.getvalue())
        buf = io.BytesIO()
        Image.new("1", (5000, 4000)).save(buf, format="PNG")
        assert "5000x4000 pixels, over the limit" in image(buf.getvalue())
        r = c.post("/images", json={"data": "%%%", "dir": str(tmp_path)})
        assert r.status_code == 400 and "base64" in r.json()["error"]
        r = c.post("/generate", json={"prompt_token_ids": user_turn([5, "x"]), "images": episode["paths"][:1]})
        assert r.status_code == 400 and "5 image placeholder tokens" in r.json()["error"] and "fill 12" in r.json()["error"]
        r = c.post("/generate", json={"prompt_token_ids": [1, 2], "images": [str(tmp_path / "missing.safetensors")]})
        assert r.status_code == 400 and "images[0]" in r.json()["error"]
        assert c.get("/health").status_code == 200
    with engine_server(tiny_model, tmp_path) as text_only, client(text_only) as c:
        r = c.post("/images", json={"data": base64.b64encode(png()).decode(), "dir": str(tmp_path)})
        assert r.status_code == 400 and "not a vision-language model" in r.json()["error"]


def test_moe_vlm_actor_replays_the_experts_the_engine_recorded(tiny_vlm_moe, tmp_path):
    """Routing replay on a Qwen3-VL-MoE (invariant 3 for MoE with images): the engine records each sampled token's
    experts over the multi-turn image conversation; the actor, replaying them over the same stored images, computes
    the engine's logprobs. Routes that are not the engine's (each expert id + 1) change the logprobs only when
    replayed, so the check sees whether the actor runs the recorded experts."""
    (tmp_path / "state").mkdir()
    with engine_server(tiny_vlm_moe, tmp_path) as e, client(e) as c, \
            actor_server(tiny_vlm_moe, tmp_path / "state", 1) as a, client(a) as ac:
        refs = [run_episode(c, tmp_path, i, float(1 - i), routes=True)["ref"] for i in range(2)]
        shifted = []
        for ref in refs:
            t = load_file(str(tmp_path / ref))
            sampled, experts = t["loss_mask"].bool(), t["routed_experts"]
            assert experts.shape[1:] == (2, 2) and (experts[sampled] >= 0).all() and (experts[~sampled] == -1).all()
            t["routed_experts"] = torch.where(sampled[:, None, None], (experts + 1) % 4, experts)
            shifted.append(ref.replace(".safetensors", "-shifted.safetensors"))
            save_file(t, str(tmp_path / shifted[-1]), metadata=safe_open(str(tmp_path / ref), "pt").metadata())

        def step(n: int, trajectories: list[str], replay: bool) -> dict:  # lr ~0: every step sees the same weights
            r = ac.post("/train_step", json={"run_id": "vlm-moe", "step": n, "store_root": str(tmp_path),
                                             "trajectories": trajectories,
                                             "algo": {"lr": 1e-12, "routing_replay": replay}})
            assert r.status_code == 200, r.text
            return r.json()["metrics"]

        on, off = step(1, refs, True), step(2, refs, False)
        shifted_on, shifted_off = step(3, shifted, True), step(4, shifted, False)
    print(f"\nMoE VLM, {int(on['tokens/sampled'])} sampled tokens: engine vs actor max |logprob diff| with replay "
          f"{on['rollout_logp_max_abs_diff']:.2e}, without {off['rollout_logp_max_abs_diff']:.2e}; routes shifted: "
          f"with replay {shifted_on['rollout_logp_max_abs_diff']:.2e}, without {shifted_off['rollout_logp_max_abs_diff']:.2e}")
    assert on["routing/agreement"] == 1 and on["tokens/trained"] == on["tokens/sampled"] > 0
    assert on["rollout_logp_max_abs_diff"] < TOL and off["rollout_logp_max_abs_diff"] < TOL
    assert shifted_on["routing/agreement"] == 0 and shifted_on["rollout_logp_max_abs_diff"] > 10 * TOL
    assert shifted_off["rollout_logp_max_abs_diff"] < TOL
