"""What the engine and the actor share: bearer-token auth, clear 4xx errors, model loading, devices."""
import contextlib
import errno
import hmac
import os
from pathlib import Path

import torch
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from safetensors.torch import load_file


def service_app(title: str, token: str | None) -> FastAPI:
    """A FastAPI app where every route needs `Authorization: Bearer <token>` (when a token is set)
    and every error is `{"error": "..."}` naming what was wrong."""
    app = FastAPI(title=title)
    if token:
        app.add_middleware(BearerToken, expected=f"Bearer {token}".encode())

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request: Request, exc: RequestValidationError):
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        return JSONResponse({"error": f"bad request body: {problems}"}, status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_request: Request, exc: HTTPException):
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(OSError)  # e.g. a full disk: 507 Insufficient Storage, the message names the path
    async def os_error(_request: Request, exc: OSError):
        return JSONResponse({"error": str(exc)}, status_code=507 if exc.errno == errno.ENOSPC else 500)

    return app


class BearerToken:
    """Plain ASGI, not @app.middleware("http"): Starlette's BaseHTTPMiddleware runs each request in a task group
    over memory streams, which cost the engine more per request than a decode step."""

    def __init__(self, app, expected: bytes):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send):
        got = dict(scope.get("headers", [])).get(b"authorization", b"")
        if scope["type"] == "http" and not hmac.compare_digest(got, self.expected):
            return await JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)(scope, receive, send)
        await self.app(scope, receive, send)


@contextlib.contextmanager
def bad_request(prefix: str = ""):
    """A ValueError raised inside (bad input, its message names what is wrong) answers 400 with that message."""
    try:
        yield
    except ValueError as e:
        raise HTTPException(400, f"{prefix}{e}") from None


def write_error(e: BaseException, path) -> BaseException:
    """ENOSPC anywhere in e's chain as an OSError naming path; other errors unchanged. torch.save reports a full
    disk as `RuntimeError: [enforce fail at inline_container.cc] unexpected pos` (the OSError, when it writes to a
    Python file, is its __context__), safetensors as `SafetensorError: ... (os error 28)`: neither names the disk."""
    cause = e
    while cause is not None:
        if (isinstance(cause, OSError) and cause.errno == errno.ENOSPC) or "(os error 28)" in str(cause):
            return OSError(errno.ENOSPC, f"no space left on device (ENOSPC) writing {path}")
        cause = cause.__cause__ or cause.__context__
    return e


def check_model_dir(path: str) -> Path:
    """Fail with a message naming the directory and what it lacks."""
    p = Path(path)
    if not p.is_dir():
        raise ValueError(f"model dir {path!r} does not exist")
    if not (p / "config.json").is_file():
        raise ValueError(f"model dir {path!r} has no config.json")
    if not any(p.glob("*.safetensors")):
        raise ValueError(f"model dir {path!r} has no *.safetensors weights")
    return p


def read_safetensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a model directory's *.safetensors files; a ValueError names what the directory lacks."""
    check_model_dir(path)
    return {name: t for f in sorted(Path(path).glob("*.safetensors")) for name, t in load_file(str(f)).items()}


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, device: torch.device | None = None):
    """A causal LM, or a vision-language model (config with a vision_config) whose policy never samples vision
    tokens: their logits are -1e4 (probability 0, yet a finite logprob where they stand in a prompt) in the engine
    and in the actor alike (vision.vision_token_ids)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    check_model_dir(path)
    vlm = hasattr(AutoConfig.from_pretrained(path), "vision_config")
    model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_pretrained(path, dtype=dtype)
    if vlm:
        from vision import vision_token_ids
        banned = torch.tensor(vision_token_ids(model.config))
        model.get_output_embeddings().register_forward_hook(
            lambda _m, _i, logits: logits.index_fill(-1, banned.to(logits.device), -1e4))
    return model.to(device or default_device()).eval()


def moe_routers(model) -> list[torch.nn.Module]:
    """The MoE top-k routers in layer order (transformers' *TopKRouter modules return (logits, scores, indices))."""
    return [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]


def token_from_env() -> str | None:
    return os.environ.get("MOLT_TOKEN") or None


def check_generate_ids(req, vocab_size: int, max_len: int, limit_name: str) -> None:
    """The checks every engine backend makes before it queues a GenerateRequest; a ValueError names the problem."""
    for what, ids in (("prompt_token_ids", req.prompt_token_ids), ("sampling.stop_token_ids", req.sampling.stop_token_ids)):
        for i, t in enumerate(ids):
            if not 0 <= t < vocab_size:
                raise ValueError(f"{what}[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    if len(req.prompt_token_ids) >= max_len:
        raise ValueError(f"prompt has {len(req.prompt_token_ids)} tokens; this engine allows at most "
                         f"{max_len - 1} so that one token can be generated ({limit_name} {max_len})")
