"""GPU check for a lent accelerator (one GPU, PyTorch, no vLLM, no network): the real torch engine and the real
actor, both bf16 on the GPU, a few train steps with a refit after each, printing tokens/s, step time, refit time
and the engine-vs-actor logprob mismatch at each version. Takes a few minutes; exits non-zero on any failure.

    python bench/gpu_check.py [--steps 3] [--prompts 16] [--group 8] [--max-tokens 64] [--layers 8]

The model is a random-init Qwen3 (byte tokenizer from make_tiny_model.py) scaled to --hidden/--layers, big enough
for the GPU timings to mean something. Refit goes through the actor's /push_weights; on one GPU both ranks of the
transfer group sit on the same device, which NCCL refuses, so if that push fails the check says so and falls
back to checkpoint save + engine /weights/load (the restart path) to keep checking the mismatch.
"""
import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

GPU = Path(__file__).resolve().parent.parent / "gpu-services"
TOKEN = "gpu-check"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def service(name: str, cmd: list[str], port: int, log: Path, timeout_s: float = 300):
    import httpx
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + timeout_s
        while True:
            if proc.poll() is not None:
                sys.exit(f"gpu_check: {name} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2).status_code == 200:
                    break
            if time.time() > deadline:
                sys.exit(f"gpu_check: {name} not healthy after {timeout_s}s:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)
        yield httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
        out.close()


def post(c, path: str, body: dict) -> dict:
    r = c.post(path, json=body)
    if r.status_code != 200:
        sys.exit(f"gpu_check: POST {path} answered {r.status_code}: {r.text[:2000]}")
    return r.json()


def make_model(out: Path, hidden: int, layers: int) -> Path:
    """The tiny model's tokenizer and config, scaled up; random init, fp32 master weights."""
    sys.path.insert(0, str(GPU))
    from make_tiny_model import make
    from transformers import AutoConfig, AutoModelForCausalLM
    make(str(out), seed=0)
    config = AutoConfig.from_pretrained(out)
    heads = hidden // 64
    config.update({"hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
                   "num_key_value_heads": max(1, heads // 2), "head_dim": 64, "intermediate_size": 3 * hidden,
                   "layer_types": ["full_attention"] * layers, "max_position_embeddings": 2048})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    print(f"model: Qwen3 hidden {hidden}, {layers} layers, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    return out


def rollouts(engine, prompts: list[list[int]], group: int, max_tokens: int, version: int) -> tuple[list[dict], float]:
    """Every prompt `group` times, all at once. Returns the samples and the generated tokens per second."""
    def one(i: int) -> dict:
        g, k = divmod(i, group)
        out = post(engine, "/generate", {"prompt_token_ids": prompts[g], "sampling": {
            "max_tokens": max_tokens, "temperature": 1.0, "seed": version * 100_000 + i}})
        return {"group": g, "episode": k, "prompt": prompts[g], **out}
    t0 = time.time()
    with ThreadPoolExecutor(len(prompts) * group) as pool:
        samples = list(pool.map(one, range(len(prompts) * group)))
    seconds = time.time() - t0
    return samples, sum(len(s["token_ids"]) for s in samples) / seconds


def write_store(store: Path, step: int, samples: list[dict]) -> list[str]:
    """Trajectory files as trajectories.py reads them; reward = fraction of sampled bytes that are lowercase letters."""
    from safetensors.torch import save_file
    refs = []
    for s in samples:
        p, t = s["prompt"], s["token_ids"]
        reward = sum(97 <= x <= 122 for x in t) / max(1, len(t))
        ref = f"step{step}/g{s['group']}-e{s['episode']}.safetensors"
        (store / ref).parent.mkdir(parents=True, exist_ok=True)
        save_file({"tokens": torch.tensor(p + t, dtype=torch.int32),
                   "logprobs": torch.tensor([0.0] * len(p) + s["logprobs"], dtype=torch.float32),
                   "versions": torch.tensor([-1] * len(p) + s["versions"], dtype=torch.int32),
                   "loss_mask": torch.tensor([0] * len(p) + [1] * len(t), dtype=torch.uint8)},
                  str(store / ref), metadata={"format": "molt-trajectory-v1", "run": "gpu-check", "group": str(s["group"]),
                                              "episode": str(s["episode"]), "segment": "0", "reward": str(reward),
                                              "finish": s["finish_reason"]})
        refs.append(ref)
    return refs


def mismatch(actor, samples: list[dict]) -> tuple[float, float]:
    """max and mean |engine logprob - actor logprob| over the sampled tokens (same weights version)."""
    got = post(actor, "/logprobs", {"token_ids": [s["prompt"] + s["token_ids"] for s in samples]})["logprobs"]
    diffs = [abs(a - b) for s, row in zip(samples, got) for a, b in zip(s["logprobs"], row[len(s["prompt"]):])]
    return max(diffs), sum(diffs) / len(diffs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--workdir", default=None, help="default: a fresh temporary directory")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device (torch.cuda.is_available() is False). Run this on a machine with a GPU; "
                 "on CPU the pytest suites cover the engine and the actor.")
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="molt-gpu-check-"))
    model = make_model(work / "model", args.hidden, args.layers)
    store = work / "store"
    prompts = [list(f"copy {w}>".encode()) for w in ("abc", "xyz", "hello", "molt", "gpu", "rl", "byte", "token")]
    prompts = [prompts[i % len(prompts)] + [48 + i % 10] for i in range(args.prompts)]

    e_port, a_port = free_port(), free_port()
    engine_cmd = [sys.executable, str(GPU / "engine.py"), "--model", str(model), "--port", str(e_port), "--token", TOKEN,
                  "--dtype", "bfloat16", "--device", "cuda", "--max-batch", str(args.prompts * args.group)]
    actor_cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                 str(GPU / "actor.py"), "--model", str(model), "--port", str(a_port), "--token", TOKEN,
                 "--state-dir", str(work / "actor-state"), "--dtype", "bfloat16", "--advertise-host", "127.0.0.1"]
    (work / "actor-state").mkdir(parents=True, exist_ok=True)
    with service("engine", engine_cmd, e_port, work / "engine.log") as engine, \
            service("actor", actor_cmd, a_port, work / "actor.log") as actor:
        samples, tps = rollouts(engine, prompts, args.group, args.max_tokens, 0)
        worst, mean = mismatch(actor, samples)
        print(f"version 0: rollout {tps:,.0f} tokens/s; logprob mismatch engine vs actor max {worst:.4f} mean {mean:.5f}")
        refit_via_push = True
        for step in range(1, args.steps + 1):
            refs = write_store(store, step, samples)
            t0 = time.time()
            out = post(actor, "/train_step", {"run_id": "gpu-check", "step": step, "store_root": str(store),
                                              "trajectories": refs, "algo": {"lr": 1e-5}})
            step_s = time.time() - t0
            t0 = time.time()
            how = "push_weights"
            if refit_via_push:
                r = actor.post("/push_weights", json={"engines": [{"url": str(engine.base_url)}], "version": step})
                if r.status_code != 200:
                    print(f"refit: /push_weights failed ({r.status_code}: {r.text[:300]}); on one GPU NCCL cannot put "
                          f"two ranks on the same device. Falling back to checkpoint save + /weights/load.")
                    refit_via_push = False
            if not refit_via_push:
                how = "checkpoint+load"
                post(actor, "/checkpoint/save", {"path": str(work / f"ckpt-{step}")})
                post(engine, "/weights/load", {"path": str(work / f"ckpt-{step}"), "version": step})
            refit_s = time.time() - t0
            samples, tps = rollouts(engine, prompts, args.group, args.max_tokens, step)
            assert all(v == step for s in samples for v in s["versions"]), "engine did not take the new version"
            worst, mean = mismatch(actor, samples)
            metrics = {k: round(v, 4) for k, v in out["metrics"].items() if k in ("pg_loss", "reward/mean", "grad_norm", "rollout_logp_max_abs_diff")}
            print(f"step {step}: train {step_s:.2f}s {json.dumps(metrics)}; refit ({how}) {refit_s:.2f}s; "
                  f"rollout {tps:,.0f} tokens/s; mismatch max {worst:.4f} mean {mean:.5f}")
    print(f"gpu_check: done ({work})")


if __name__ == "__main__":
    main()
