"""Benchmark the torch engine against baselines run side by side in the same process tree:

- generation: engine tokens/s with 1, 16, 64 concurrent requests (NEW_TOKENS each), against
  transformers' batched `model.generate` on the same prompts (left-padded, sampling, same length), on the
  tiny model and on a 33.7M one of the same family (--size); engine and baseline alternate, medians of --repeats;
  --compare DIR also runs the engine of another gpu-services copy (e.g. main's, for before/after), interleaved;
- refit: the actor's /push_weights of the whole model, against a raw gloo broadcast of the
  same bytes between two processes (bench/refit.py), on each model.

    python bench/engine.py [--model DIR] [--size tiny|33.7M|all] [--threads 1] [--repeats 3] [--concurrency 1,16,64]
                           [--no-refit] [--compare GPU_SERVICES_DIR] [--out bench.json] [--smoke]

Without --model it makes the tiny test model in a temp dir. Prints a markdown table; ratios are
engine / baseline (tokens/s: higher is better; refit seconds: lower is better).
"""
import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

GPU_SERVICES = Path(__file__).resolve().parents[1] / "gpu-services"
sys.path.insert(0, str(GPU_SERVICES))
from common import load_causal_lm  # noqa: E402
from refit import bench_model as bench_refit, cpu_seconds  # noqa: E402

NEW_TOKENS = 32
TOKEN = "bench"


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_engine(model: str, threads: int, services: Path = GPU_SERVICES) -> tuple[subprocess.Popen, httpx.Client]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(services / "engine.py"), "--model", model,
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


def engine_tokens_per_s(url: str, prompts: list[list[int]], pid: int) -> tuple[float, float]:
    """All requests at once over connections opened before the clock starts (as a rollout worker keeps them),
    written as raw HTTP/1.1 from one asyncio task: an httpx client spent more CPU per request than the engine
    does, on the same 2 cores, and its slow trickle of requests was measured as the engine's.
    Returns (tokens per second, tokens per CPU-second of the engine process)."""
    host, port = httpx.URL(url).host, httpx.URL(url).port

    def request(i: int) -> bytes:
        body = json.dumps({"prompt_token_ids": prompts[i], "sampling": {"max_tokens": NEW_TOKENS, "seed": i}}).encode()
        return (f"POST /generate HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body

    async def tokens(reader: asyncio.StreamReader) -> int:
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        assert head.startswith("http/1.1 200"), head
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        return len(json.loads(await reader.readexactly(length))["token_ids"])

    async def run() -> float:
        conns = [await asyncio.open_connection(host, port) for _ in prompts]
        requests = [request(i) for i in range(len(prompts))]
        start, cpu = time.perf_counter(), cpu_seconds(pid)
        for (_, writer), req in zip(conns, requests):
            writer.write(req)
        n = sum(await asyncio.gather(*(tokens(reader) for reader, _ in conns)))
        seconds, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
        for _, writer in conns:
            writer.close()
        return n / seconds, n / max(cpu, 1e-9)
    return asyncio.run(run())


@torch.no_grad()
def generate_tokens_per_s(model, prompts: list[list[int]], pad_id: int) -> tuple[float, float]:
    """(tokens per second, tokens per CPU-second of this process)."""
    L = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (L - len(p)) + p for p in prompts])  # [B, L], left-padded
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    start, cpu = time.perf_counter(), time.process_time()
    out = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=True, max_new_tokens=NEW_TOKENS,
                         min_new_tokens=NEW_TOKENS, pad_token_id=pad_id)
    n = out.shape[0] * (out.shape[1] - L)
    return n / (time.perf_counter() - start), n / (time.process_time() - cpu)


SIZES = {"tiny": {}, "33.7M": {"hidden": 512, "layers": 8, "heads": 16}}  # make_tiny_model.make arguments


def generation_rows(model_dir: str, a, prompts: list[list[int]]) -> list[dict]:
    """Engine (and --compare engine) vs model.generate, alternating within each repeat; medians reported, of
    tokens/s and of tokens per CPU-second (steadier than wall time on a shared machine)."""
    model = load_causal_lm(model_dir, device=torch.device("cpu"))
    pad_id = model.config.pad_token_id or 0
    engines = {"engine": start_engine(model_dir, a.threads)}
    if a.compare:
        engines["compare"] = start_engine(model_dir, a.threads, Path(a.compare))
    rows = []
    try:
        for proc, http in engines.values():  # warm-up
            engine_tokens_per_s(str(http.base_url), prompts[:4], proc.pid)
        generate_tokens_per_s(model, prompts[:4], pad_id)
        for n in a.concurrency:
            runs: dict[str, list[tuple[float, float]]] = {k: [] for k in [*engines, "baseline"]}
            for _ in range(a.repeats):
                for k, (proc, http) in engines.items():
                    runs[k].append(engine_tokens_per_s(str(http.base_url), prompts[:n], proc.pid))
                runs["baseline"].append(generate_tokens_per_s(model, prompts[:n], pad_id))
            row = {"what": f"generate, {n} concurrent x {NEW_TOKENS} tokens (tokens/s)"}
            for k, v in runs.items():
                row[k], row[f"{k}_cpu"] = statistics.median(x for x, _ in v), statistics.median(c for _, c in v)
            for k in engines:
                prefix = "" if k == "engine" else f"{k}_"
                row[f"{prefix}ratio"] = row[k] / row["baseline"]
                row[f"{prefix}cpu_ratio"] = row[f"{k}_cpu"] / row["baseline_cpu"]
            rows.append(row)
    finally:
        for proc, _ in engines.values():
            proc.terminate()
            proc.wait(timeout=30)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="HF model dir (default: the tiny test model and a 33.7M one, made in a temp dir)")
    p.add_argument("--size", choices=[*SIZES, "all"], default="all", help="which made model(s) without --model")
    p.add_argument("--threads", type=int, default=1, help="torch threads for the engine and for the baseline")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measure (medians are reported)")
    p.add_argument("--concurrency", default="1,16,64", help="comma-separated numbers of concurrent requests")
    p.add_argument("--no-refit", action="store_true", help="generation only")
    p.add_argument("--compare", help="also run the engine of this gpu-services dir (e.g. a copy of main's)")
    p.add_argument("--out", help="also write the figures as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny model, 1 and 4 concurrent, one try each: checks it runs")
    a = p.parse_args()
    a.concurrency = [1, 4] if a.smoke else [int(n) for n in a.concurrency.split(",")]
    a.repeats = 1 if a.smoke else a.repeats
    torch.set_num_threads(a.threads)
    tmp = tempfile.TemporaryDirectory()
    models = {"given": a.model} if a.model else {}
    if not a.model:
        from make_tiny_model import make
        for size in ["tiny"] if a.smoke else SIZES if a.size == "all" else [a.size]:
            models[size] = str(make(str(Path(tmp.name) / size), seed=0, **SIZES[size]))
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(8, 24))] for _ in range(64)]

    rows = []
    for name, model_dir in models.items():
        for row in generation_rows(model_dir, a, prompts):
            rows.append({**row, "what": f"{name}: {row['what']}"})
    if not a.no_refit:
        for name, model_dir in models.items():
            r = bench_refit(model_dir, a.repeats if a.repeats > 1 else 3, a.threads, Path(tmp.name))
            rows.append({"what": f"{name}: refit {r['bytes'] / 1e6:.2f} MB (s): actor /push_weights vs "
                                 f"raw gloo broadcast of the same bytes on a ready group (bench/refit.py)",
                         "engine": r["refit_median"], "baseline": r["raw_median"], "ratio": r["ratio"],
                         **({"cpu_ratio": r["cpu_ratio"]} if r["cpu_ratio"] else {})})
    print(f"models {models}, torch threads {a.threads}, baselines: transformers model.generate / raw gloo broadcast; "
          f"medians of {a.repeats}\n")
    print("ratio per CPU-s: tokens per CPU-second of the engine process / of model.generate\n")
    extra = " | --compare ratio | --compare per CPU-s" if a.compare else ""
    print(f"| measure | engine | baseline | ratio | ratio per CPU-s{extra} |\n| --- | ---: | ---: | ---: | ---:"
          f"{' | ---: | ---:' if a.compare else ''} |")
    for r in rows:
        cpu = f"{r['cpu_ratio']:.2f}" if "cpu_ratio" in r else ""
        more = f" | {r['compare_ratio']:.2f} | {r['compare_cpu_ratio']:.2f}" if "compare" in r else " | |" if a.compare else ""
        print(f"| {r['what']} | {r['engine']:.4g} | {r['baseline']:.4g} | {r['ratio']:.2f} | {cpu}{more} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"models": models, "threads": a.threads, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
