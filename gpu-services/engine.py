"""The rollout engine: token ids in, token ids out, over HTTP (see contract.py and DESIGN.md).

    python gpu-services/engine.py --model DIR [--host 127.0.0.1] [--port 8100] [--token T] \\
        [--backend torch] [--dtype float32] [--device auto] [--max-batch 64] [--keep-stale-kv] [--name NAME]

The server holds no tensors: it validates bodies and forwards to a backend object with the methods
submit, health, pause, resume, abort, receive_weights, load_weights, process_image, and optionally score (torch_engine.TorchEngine;
a `vllm` backend will offer the same methods).
"""
import argparse
import sys
import traceback

import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from common import bad_request, service_app, token_from_env
from contract import (AbortRequest, EngineHealth, GenerateChunk, GenerateRequest, GenerateResponse, ImageRequest,
                      ImageResponse, NotInGroup, PauseRequest, ScoreRequest, ScoreResponse, VersionResponse,
                      WeightLoadRequest, WeightReceiveRequest)


def build_app(backend, token: str | None) -> FastAPI:
    app = service_app("molt engine", token)

    @app.get("/health")
    def health() -> EngineHealth:
        return EngineHealth(**backend.health())

    async def generate(request: Request):
        # a plain Starlette route (below), the body parsed here by pydantic's own JSON parser: FastAPI's body and
        # dependency machinery cost the event loop a third of what the tiny model's decode cost per token at 64
        # requests, and its route handling another 0.05 ms a request (measured); so /generate is not in /openapi.json
        try:
            req = GenerateRequest.model_validate_json(await request.body())
        except ValidationError as e:  # answered as FastAPI answers a bad body (service_app)
            raise RequestValidationError([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]) from None
        with bad_request():
            request_id, events = backend.submit(req)
        if req.stream:
            async def lines():
                try:
                    async for ev in events:
                        yield GenerateChunk(**ev).model_dump_json() + "\n"
                finally:  # on a client disconnect this ends the request in the backend
                    await events.aclose()
            return StreamingResponse(lines(), media_type="application/x-ndjson")
        out = {"token_ids": [], "logprobs": [], "versions": []}
        if req.return_routed_experts:
            out["routed_experts"] = []
        async for ev in events:
            for key in out:
                out[key] += ev[key]
            finish_reason = ev["finish_reason"]
        # serialized here: FastAPI's jsonable_encoder walks every list item in Python
        return Response(GenerateResponse(request_id=request_id, finish_reason=finish_reason, **out).model_dump_json(),
                        media_type="application/json")

    app.add_route("/generate", generate, methods=["POST"])

    @app.post("/images")
    def images(req: ImageRequest) -> ImageResponse:
        with bad_request():
            return ImageResponse(**backend.process_image(req))

    @app.post("/score")
    def score(req: ScoreRequest) -> ScoreResponse:
        if not hasattr(backend, "score"):
            raise HTTPException(400, f"/score: the {type(backend).__name__} backend cannot score token ids")
        with bad_request():
            logprobs, version = backend.score(req.token_ids)
        return ScoreResponse(logprobs=logprobs, version=version)

    @app.post("/pause")
    def pause(req: PauseRequest | None = None) -> dict:
        backend.pause((req or PauseRequest()).mode)
        return {"paused": True}

    @app.post("/resume")
    def resume() -> dict:
        backend.resume()
        return {"paused": False}

    @app.post("/abort")
    def abort(req: AbortRequest | None = None) -> dict:
        return {"aborted": backend.abort((req or AbortRequest()).request_ids)}

    def weights(apply) -> VersionResponse:
        try:
            return VersionResponse(version=apply())
        except ValueError as e:  # a name, shape or path that does not fit the model
            raise HTTPException(400, str(e))
        except NotInGroup as e:  # the actor makes a new transfer group
            raise HTTPException(409, str(e))
        except Exception as e:  # e.g. the transfer group timed out
            traceback.print_exc()
            raise HTTPException(500, f"weight update failed: {type(e).__name__}: {e}")

    @app.post("/weights/receive")
    def weights_receive(req: WeightReceiveRequest) -> VersionResponse:
        return weights(lambda: backend.receive_weights(req))

    @app.post("/weights/load")
    def weights_load(req: WeightLoadRequest) -> VersionResponse:
        return weights(lambda: backend.load_weights(req.path, req.version))

    return app


def make_backend(args):
    if args.backend == "torch":
        import torch
        from common import default_device, parse_dtype
        from torch_engine import TorchEngine
        device = default_device() if args.device == "auto" else torch.device(args.device)
        return TorchEngine(args.model, parse_dtype(args.dtype), device, max_batch=args.max_batch,
                           keep_stale_kv=args.keep_stale_kv, name=args.name)
    from vllm_engine import VllmEngine  # needs vllm installed (see vllm_engine.py)
    return VllmEngine.from_args(args)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--token", default=token_from_env(), help="bearer token (default: env MOLT_TOKEN)")
    p.add_argument("--backend", default="torch", choices=["torch", "vllm"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    p.add_argument("--max-batch", type=int, default=64, help="most sequences decoded together")
    p.add_argument("--keep-stale-kv", action="store_true",
                   help="after a weight update keep held requests' KV from the old weights instead of recomputing it")
    p.add_argument("--name", help="model name reported by /health (default: the model dir's name)")
    args = p.parse_args()
    if args.max_batch < 1:
        p.error("--max-batch must be at least 1")
    try:
        backend = make_backend(args)
    except ValueError as e:
        sys.exit(f"engine: {e}")
    uvicorn.run(build_app(backend, args.token), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
