"""Benchmark the torch engine against baselines run side by side in the same process tree:

- generation: engine tokens/s with 1, 16, 64 concurrent requests (NEW_TOKENS each), against
  transformers' batched `model.generate` on the same prompts (left-padded, sampling, same length);
- refit: pause -> /weights/receive of the whole model -> resume, against a raw gloo broadcast of the
  same buckets between two processes (group set-up included in both).

    python bench/engine.py [--model DIR] [--threads 1] [--out bench.json] [--smoke]

Without --model it makes the tiny test model in a temp dir. Prints a markdown table; ratios are
engine / baseline (tokens/s: higher is better; refit seconds: lower is better).
"""
import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch

GPU_SERVICES = Path(__file__).resolve().parents[1] / "gpu-services"
sys.path.insert(0, str(GPU_SERVICES))
from common import load_causal_lm  # noqa: E402
from contract import WeightReceiveRequest  # noqa: E402
from weight_transfer import open_group, plan_buckets, recv_bucket, send_bucket  # noqa: E402

NEW_TOKENS = 32
TOKEN = "bench"
BUCKET_BYTES = 16 * 1024 * 1024


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model: str, threads: int) -> tuple[subprocess.Popen, httpx.Client]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(GPU_SERVICES / "engine.py"), "--model", model,
                             "--port", str(port), "--token", TOKEN], env={**os.environ, "OMP_NUM_THREADS": str(threads)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300)
    for _ in range(600):
        if proc.poll() is not None:
            sys.exit(f"engine exited with {proc.returncode}")
        try:
            if http.get("/health").status_code == 200:
                return proc, http
        except httpx.HTTPError:
            time.sleep(0.2)
    sys.exit("engine did not become healthy")


def engine_tokens_per_s(url: str, prompts: list[list[int]]) -> float:
    """All requests at once from one asyncio client (client threads would steal the engine's CPU)."""
    async def run() -> int:
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=300,
                                     limits=httpx.Limits(max_connections=len(prompts))) as http:
            async def one(i: int) -> int:
                body = {"prompt_token_ids": prompts[i], "sampling": {"max_tokens": NEW_TOKENS, "seed": i}}
                return len((await http.post("/generate", json=body)).json()["token_ids"])
            return sum(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
    start = time.perf_counter()
    n = asyncio.run(run())
    return n / (time.perf_counter() - start)


@torch.no_grad()
def generate_tokens_per_s(model, prompts: list[list[int]], pad_id: int) -> float:
    L = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts])  # [B, L], left-padded
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, pad_token_id=pad_id)
    return (out.shape[0] * (out.shape[1] - L)) / (time.perf_counter() - start)


def refit_seconds(http: httpx.Client, model) -> float:
    """pause -> the engine receives every weight from us (rank 0) -> resume."""
    named = list(model.state_dict().items())
    buckets = plan_buckets(named, BUCKET_BYTES)
    port = free_port()
    body = WeightReceiveRequest(master_addr="127.0.0.1", master_port=port, world_size=2, rank=1,
                                buckets=buckets, version=1).model_dump()
    start = time.perf_counter()
    http.post("/pause", json={"mode": "keep"})
    poster = threading.Thread(target=lambda: http.post("/weights/receive", json=body).raise_for_status())
    poster.start()
    group = open_group("127.0.0.1", port, 2, 0, "gloo")
    tensors = dict(named)
    for bucket in buckets:
        send_bucket(group, [tensors[s.name] for s in bucket])
    poster.join()
    http.post("/resume")
    return time.perf_counter() - start


def _raw_receiver(port: int, buckets) -> None:
    group = open_group("127.0.0.1", port, 2, 1, "gloo")
    for bucket in buckets:
        list(recv_bucket(group, bucket, torch.device("cpu")))


def raw_broadcast_seconds(model) -> float:
    """The same buckets over a ready gloo group to a second process: what moving the bytes costs."""
    named = list(model.state_dict().items())
    buckets = plan_buckets(named, BUCKET_BYTES)
    port = free_port()
    receiver = mp.get_context("spawn").Process(target=_raw_receiver, args=(port, buckets))
    receiver.start()
    group = open_group("127.0.0.1", port, 2, 0, "gloo")
    tensors = dict(named)
    start = time.perf_counter()
    for bucket in buckets:
        send_bucket(group, [tensors[s.name] for s in bucket])
    seconds = time.perf_counter() - start
    receiver.join()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model dir (default: the tiny test model, made in a temp dir)")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the engine and for the baseline")
    p.add_argument("--out", help="also write the figures as JSON here")
    p.add_argument("--smoke", action="store_true", help="1 and 4 concurrent, one try each: checks it runs")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    tmp = tempfile.TemporaryDirectory()
    if a.model is None:
        from make_tiny_model import make
        a.model = str(make(str(Path(tmp.name) / "tiny"), seed=0))
    model = load_causal_lm(a.model, device=torch.device("cpu"))
    pad_id = model.config.pad_token_id or 0
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(8, 24))] for _ in range(64)]

    proc, http = start_engine(a.model, a.threads)
    rows = []
    try:
        engine_tokens_per_s(str(http.base_url), prompts[:4])  # warm-up
        generate_tokens_per_s(model, prompts[:4], pad_id)
        tries = 1 if a.smoke else 3
        for n in (1, 4) if a.smoke else (1, 16, 64):
            # best of 3: the machine is shared, and noise only ever slows a run down
            engine = max(engine_tokens_per_s(str(http.base_url), prompts[:n]) for _ in range(tries))
            baseline = max(generate_tokens_per_s(model, prompts[:n], pad_id) for _ in range(tries))
            rows.append({"what": f"generate, {n} concurrent x {NEW_TOKENS} tokens (tokens/s)",
                         "engine": engine, "baseline": baseline, "ratio": engine / baseline})
        refit = min(refit_seconds(http, model) for _ in range(tries))
        raw = min(raw_broadcast_seconds(model) for _ in range(min(tries, 2)))
        nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        rows.append({"what": f"refit {nbytes / 1e6:.2f} MB (s): pause+receive+resume vs raw gloo broadcast on a ready group",
                     "engine": refit, "baseline": raw, "ratio": refit / raw})
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    print(f"model {a.model}, torch threads {a.threads}, baselines: transformers model.generate / raw gloo broadcast\n")
    print("| measure | engine | baseline | ratio |\n| --- | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['what']} | {r['engine']:.4g} | {r['baseline']:.4g} | {r['ratio']:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"model": a.model, "threads": a.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
