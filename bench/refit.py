"""Refit against the wire: a real actor (torchrun, 1 rank) pushes its weights to a real engine, against a raw
gloo broadcast of the same bytes between two processes on a group that is already up.

- refit: the actor's POST /push_weights, as activities/actor.ts calls it (its health checks left out; the engine holds
  its requests while it receives, no /pause or /resume around it); the first push (the group's rendezvous) is a
  warm-up, not counted; on the tiny model it is the fixed cost of a refit;
- raw: the same bytes broadcast with ProcessGroupGloo to a process that receives them into buffers it keeps, in
  the actor's buckets packed beforehand and in one message; the faster is the baseline: moving the bytes, nothing else.

Repeats alternate raw and refit (the machine is shared: a slow spell hits both); medians are reported. Beside the
seconds, the CPU seconds (all threads) of the processes at each end: on a machine whose cores are all busy, what a
refit costs the others, and a figure that moves less with the load than the wall clock.

    python bench/refit.py [--model DIR ...] [--repeats 7] [--threads 1] [--bucket-bytes N] [--out refit.json]

Without --model it makes the tiny test model in a temp dir.
"""
import argparse
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import torch

GPU_SERVICES = Path(__file__).resolve().parents[1] / "gpu-services"
sys.path.insert(0, str(GPU_SERVICES))
from common import load_causal_lm  # noqa: E402
from contract import PushWeightsRequest  # noqa: E402
from weight_transfer import listen, open_group, plan_buckets  # noqa: E402

TOKEN = "bench"
BUCKET_BYTES = PushWeightsRequest.model_fields["bucket_bytes"].default


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(*pids: int) -> float:
    """User + system CPU seconds of these processes (this one: alone) and their children, all threads."""
    procs = [q for pid in pids for q in [psutil.Process(pid), *(psutil.Process(pid).children(recursive=True)
                                                                 if pid != os.getpid() else [])]]
    return sum(q.cpu_times().user + q.cpu_times().system for q in procs)


@contextlib.contextmanager
def service(cmd: list[str], port: int, threads: int, log: Path):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": str(threads)}, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600)
    http.pid = proc.pid
    try:
        for _ in range(1200):
            if proc.poll() is not None:
                sys.exit(f"{cmd[1:3]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if http.get("/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield http
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=60)


def refit_seconds(actor: httpx.Client, engine: httpx.Client, version: int, bucket_bytes: int = BUCKET_BYTES) -> float:
    start = time.perf_counter()
    r = actor.post("/push_weights", json={"engines": [{"url": str(engine.base_url)}], "version": version,
                                          "bucket_bytes": bucket_bytes})
    r.raise_for_status()
    return time.perf_counter() - start


def _raw_receiver(port: int, sizes: list[list[int]], repeats: int, threads: int) -> None:
    torch.set_num_threads(threads)
    _, group = open_group("127.0.0.1", port, 2, 1, "gloo")
    buffers = [[torch.empty(n, dtype=torch.uint8) for n in messages] for messages in sizes]  # kept, as an engine's weights
    for _ in range(repeats):
        for messages in buffers:
            for b in messages:
                group.broadcast(b, 0).wait()


def bench_model(model_dir: str, repeats: int, threads: int, tmp: Path, bucket_bytes: int = BUCKET_BYTES) -> dict:
    model = load_causal_lm(model_dir, device=torch.device("cpu"))
    tensors = dict(model.state_dict())
    # the raw ways: the refit's own buckets, packed beforehand, and all bytes in one message; the faster is the baseline
    ways = {"buckets": [torch.cat([tensors[s.name].reshape(-1).view(torch.uint8) for s in b])
                        for b in plan_buckets(tensors.items(), bucket_bytes)]}
    ways["one message"] = [torch.cat(ways["buckets"])]

    def raw(messages: list[torch.Tensor]) -> float:
        start = time.perf_counter()
        for m in messages:
            group.broadcast(m, 0).wait()
        return time.perf_counter() - start

    eport, aport = free_port(), free_port()
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    with service([sys.executable, str(GPU_SERVICES / "engine.py"), "--model", model_dir, "--port", str(eport),
                  "--token", TOKEN], eport, threads, tmp / "engine.log") as engine, \
            service([*torchrun, str(GPU_SERVICES / "actor.py"), "--model", model_dir, "--port", str(aport),
                     "--token", TOKEN, "--state-dir", str(tmp / "actor")], aport, threads, tmp / "actor.log") as actor:
        first = refit_seconds(actor, engine, 1, bucket_bytes)
        # the raw group comes up once both services are: its receiver waits at most the transfer timeout
        server = listen("127.0.0.1")
        receiver = mp.get_context("spawn").Process(target=_raw_receiver, args=(
            server.getsockname()[1], [[m.numel() for m in w] for w in ways.values()], repeats + 1, threads))
        receiver.start()
        _, group = open_group("127.0.0.1", server.getsockname()[1], 2, 0, "gloo", server=server)
        raws: dict[str, list[float]] = {w: [] for w in ways}
        refits, cpu = [], {"raw": {w: [] for w in ways}, "refit": []}
        for i in range(repeats + 1):  # the first round warms up
            for w, messages in ways.items():
                c = cpu_seconds(os.getpid(), receiver.pid)
                raws[w].append(raw(messages))
                cpu["raw"][w].append(cpu_seconds(os.getpid(), receiver.pid) - c)
            c = cpu_seconds(actor.pid, engine.pid)
            refits.append(refit_seconds(actor, engine, 2 + i, bucket_bytes))
            cpu["refit"].append(cpu_seconds(actor.pid, engine.pid) - c)
        receiver.join()
    medians = {w: statistics.median(x[1:]) for w, x in raws.items()}
    baseline = min(medians, key=medians.get)
    refit_s = statistics.median(refits[1:])
    # means: the counters tick in hundredths of a second, a median of a few would be one of those steps
    cpu_raw, cpu_refit = statistics.mean(cpu["raw"][baseline][1:]), statistics.mean(cpu["refit"][1:])
    return {"model": model_dir, "bytes": sum(m.numel() for m in ways["buckets"]), "buckets": len(ways["buckets"]),
            "first_refit": first, "raw": raws, "refit": refits, "raw_medians": medians, "baseline": baseline,
            "raw_median": medians[baseline], "refit_median": refit_s, "ratio": refit_s / medians[baseline],
            "ratio_of_pairs": statistics.median(b / a for a, b in zip(raws[baseline][1:], refits[1:])),
            "cpu": cpu, "cpu_raw": cpu_raw, "cpu_refit": cpu_refit, "cpu_ratio": cpu_refit / cpu_raw if cpu_raw else None}  # None: under the counters' tick


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", action="append", help="HF model dir (repeatable; default: the tiny test model)")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine, the actor and the baseline")
    p.add_argument("--bucket-bytes", type=int, default=BUCKET_BYTES, help="the push's bucket size (and the raw one's)")
    p.add_argument("--out", help="also write the figures as JSON here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if not a.model:
            from make_tiny_model import make
            a.model = [str(make(str(Path(tmp) / "tiny"), seed=0))]
        rows = [bench_model(m, a.repeats, a.threads, Path(tmp), a.bucket_bytes) for m in a.model]
    print(f"refit (/push_weights) vs raw gloo broadcast of the same bytes on a ready group; "
          f"medians of {a.repeats} alternating repeats\n")
    print("| model | MB | buckets | first refit (s) | refit (s) | raw (s), buckets / one message | ratio | "
          "median of pair ratios | CPU s: refit / raw | CPU ratio |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | "
          "---: | ---: |")
    for r in rows:
        raw = " / ".join(f"{r['raw_medians'][w]:.4f}" for w in ("buckets", "one message"))
        print(f"| {Path(r['model']).name} | {r['bytes'] / 1e6:.2f} | {r['buckets']} | {r['first_refit']:.4f} | "
              f"{r['refit_median']:.4f} | {raw} | {r['ratio']:.2f} | {r['ratio_of_pairs']:.2f} | "
              f"{r['cpu_refit']:.3f} / {r['cpu_raw']:.3f} | {'n/a' if r['cpu_ratio'] is None else round(r['cpu_ratio'], 2)} |")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
