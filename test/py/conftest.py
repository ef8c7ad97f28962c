"""Shared pytest fixtures: a tiny model made on the fly, and real engine/actor processes on free ports."""
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "gpu-services"
sys.path.insert(0, str(GPU))
PY = sys.executable
TOKEN = "test-token"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 120.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not healthy after {timeout}s:\n{log.read_text()[-4000:]}")


@contextlib.contextmanager
def service(cmd: list[str], port: int, log: Path, env: dict | None = None):
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)


@contextlib.contextmanager
def engine_server(model: Path, log_dir: Path, *extra: str):
    port = free_port()
    with service([PY, str(GPU / "engine.py"), "--model", str(model), "--port", str(port), "--token", TOKEN, *extra],
                 port, log_dir / f"engine-{port}.log") as url:
        yield url


@contextlib.contextmanager
def actor_server(model: Path, state_dir: Path, world_size: int = 1, *extra: str):
    port = free_port()
    torchrun = [PY, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}"]
    with service([*torchrun, str(GPU / "actor.py"), "--model", str(model), "--port", str(port), "--token", TOKEN,
                  "--state-dir", str(state_dir), *extra], port, state_dir / f"actor-{port}.log") as url:
        yield url


def client(url: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from make_tiny_model import make
    return make(str(tmp_path_factory.mktemp("models") / "tiny"), seed=0)


@pytest.fixture(scope="session")
def tiny_moe_model(tmp_path_factory) -> Path:
    from make_tiny_model import make
    return make(str(tmp_path_factory.mktemp("models") / "tiny-moe"), seed=0, moe=True)


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "recipes" / "geo"))
    from make_tiny_vlm import make
    return make(str(tmp_path_factory.mktemp("models") / "tiny-vlm"), seed=0)


@pytest.fixture(scope="session")
def tiny_vlm_moe(tmp_path_factory) -> Path:
    sys.path.insert(0, str(ROOT / "recipes" / "geo"))
    from make_tiny_vlm import make
    return make(str(tmp_path_factory.mktemp("models") / "tiny-vlm-moe"), seed=0, moe=True)
