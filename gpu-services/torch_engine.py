"""The `torch` engine backend: continuous batching over a Hugging Face causal LM, on CPU or GPU.

Why not transformers' own continuous-batching manager (`model.init_continuous_batching`)? It batches
well, but (5.24) it samples the whole batch with one `torch.multinomial` on the global RNG under one
`do_sample` switch, so there is no per-request seed and no greedy/sampled mix in one batch, and it
knows nothing of weight versions or of recomputing a held request's KV after a weight swap. Those
are the engine's whole point for RL, so the scheduler below is our own, kept small:

  one background thread loops: [reap aborts] -> one batched decode forward over every running
  sequence (a left-padded KV cache shared by the batch, attention mask, per-sequence position ids)
  -> one left-padded prefill forward over newly admitted sequences -> sample one token per
  sequence with its own torch.Generator -> merge the new sequences' KV into the batch -> drop
  finished ones -> hand the step's events to the HTTP event loop in one call (streaming requests get
  their new tokens once stream_chunk are new, the others one event when they finish).

Weights change only under `_model_lock`, which the thread holds for a whole step, so a swap never
lands mid-forward, and every token records the version it was sampled under. After a swap the
held sequences' KV is recomputed by a prefill over prompt + tokens so far (unless keep_stale_kv).

MoE models: a forward hook on each router keeps its top-k expert ids; the ids at the position that produced
a token's logits are that token's routed experts (int [layers, top_k]), sent with the token when the request
asked for them. They come from the forward that sampled the token, so across a weight swap each token keeps
the experts of its own version. Models without routers get no hooks.

The HTTP server (engine.py) talks to this class only through: submit, health, pause, resume, abort,
receive_weights, load_weights, score.
"""
import asyncio
import contextlib
import ctypes
import random
import threading
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Optional

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache

import fast_forward
from common import check_generate_ids, load_causal_lm, moe_routers, read_safetensors
from contract import GenerateRequest, ImageRequest, SamplingParams, WeightReceiveRequest
from vision import check_placeholders, image_token_id, load_image, store_image, vision_inputs
from weight_transfer import Membership, flatten, receive_buckets

UNIFORMS = 64
Event = dict  # {"token_ids": [...], "logprobs": [...], "versions": [...], "finish_reason": str | None,
#                 and "routed_experts": [[[expert id] * top_k] * layers] * tokens when the request asked}


@dataclass(eq=False)  # compared and hashed by identity
class Sequence:
    request_id: str
    prompt: list[int]
    sampling: SamplingParams
    generator: torch.Generator  # per request: same seed -> same draws, whatever else is in the batch
    loop: asyncio.AbstractEventLoop  # of the HTTP handler waiting on this request
    events: asyncio.Queue  # its events, put there only on `loop` (see TorchEngine._flush)
    stream: bool = False  # False: one event at the end, with every token
    stream_chunk: int = 1  # streamed: an event once this many tokens are new (or at the end)
    return_routed_experts: bool = False
    images: list[dict] = field(default_factory=list)  # processed images (vision.load_image), in placeholder order
    rope_delta: int = 0  # M-RoPE: position of the next token minus its index (images take fewer positions)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # per token, as the tokens
    versions: list[int] = field(default_factory=list)
    routes: list = field(default_factory=list)  # per token [layers][top_k], when asked
    sent: int = 0  # tokens already handed to the HTTP handler
    finish_reason: Optional[str] = None
    uniforms: list[float] = field(default_factory=list)  # drawn from generator ahead, UNIFORMS at a time

    def context(self) -> list[int]:
        return self.prompt + self.tokens

    def uniform(self) -> float:
        """The request's next uniform in [0, 1). Drawn in blocks: a torch.rand call per token cost more than the
        tiny model's decode step at 64 requests."""
        if not self.uniforms:
            self.uniforms = torch.rand(UNIFORMS, generator=self.generator).tolist()[::-1]
        return self.uniforms.pop()


def keep_freed_memory() -> None:
    """Have glibc keep freed blocks for reuse instead of handing them back to the kernel: by default a freed block over
    its (adaptive) threshold is unmapped or trimmed, and a step's next cache buffer came back as fresh pages, a page
    fault each on first touch (~2,000 a round of 64 tiny-model requests, 2-3% of its CPU). The cost: the process
    keeps the most memory it held at once, which the next batch of that size needs again."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-3, 32 << 20)  # M_MMAP_THRESHOLD: blocks up to 32 MB (glibc's most) come from the heap
        libc.mallopt(-1, 1 << 30)  # M_TRIM_THRESHOLD: give the heap's top back only past 1 GB free


def as_tensor(values: list, device: torch.device) -> torch.Tensor:
    """torch.tensor(values) of a flat list of ints, bools or floats (float32), through numpy: torch.tensor reads a
    list item by item in Python (~20 us for 64 items; numpy ~4 us), and a decode step made seven of them."""
    t = torch.from_numpy(np.array(values))
    return (t.float() if t.dtype == torch.float64 else t).to(device)


def filter_logits(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) what top-k and top-p remove. scaled [B, V] (already / temperature),
    top_k [B] (0 = off), top_p [B] (1 = off). Top-p keeps the smallest most-likely set whose mass
    reaches top_p, measured after top-k (vLLM's order)."""
    B, V = scaled.shape
    sorted_logits, order = scaled.sort(dim=-1, descending=True)  # [B, V]
    rank = torch.arange(V, device=scaled.device)[None, :]  # [1, V]
    k = torch.where(top_k > 0, top_k, V)[:, None]  # [B, 1]
    drop = rank >= k  # [B, V] in sorted order
    probs = F.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1.0)  # top_p = 1 must not drop rounding tails
    return scaled.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))


def take_event(seq: Sequence) -> Event:
    """What seq has not handed over yet: its tokens since the last event, and the finish reason if it is done."""
    start, seq.sent = seq.sent, len(seq.tokens)
    event = {"token_ids": seq.tokens[start:], "logprobs": seq.logprobs[start:], "versions": seq.versions[start:],
             "finish_reason": seq.finish_reason}
    if seq.return_routed_experts:
        event["routed_experts"] = seq.routes[start:]
    return event


def put_all(items: list[tuple[asyncio.Queue, Event]]) -> None:  # on the HTTP handlers' event loop
    for queue, event in items:
        queue.put_nowait(event)


def merge_events(first: Event, queue: asyncio.Queue) -> Event:
    """first plus every event already waiting in queue, as one: a client slower than the engine gets one chunk
    (one HTTP write) per read instead of one per token."""
    while not first["finish_reason"] and not queue.empty():
        ev = queue.get_nowait()
        first = {key: first[key] + ev[key] if isinstance(ev[key], list) else ev[key] for key in ev}
    return first


class TorchEngine:
    def __init__(self, model_dir: str, dtype: torch.dtype, device: torch.device, max_batch: int = 64,
                 keep_stale_kv: bool = False, name: Optional[str] = None):
        if device.type == "cpu":
            keep_freed_memory()
        self.model = load_causal_lm(model_dir, dtype=dtype, device=device)
        self.device = device
        self.name = name or Path(model_dir).resolve().name
        self.max_batch = max_batch
        self.keep_stale_kv = keep_stale_kv
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        text_config = self.model.config.get_text_config()
        self.max_len = text_config.max_position_embeddings  # prompt + output never exceed this
        self.pad_id = text_config.pad_token_id or 0  # masked out; any valid id works
        self.version = 0
        flatten(self.model)  # before fusing, which then keeps each fused weight where a refit writes it
        self._fast = fast_forward.supports(self.model)  # dense Qwen3: the engine's own forward (fast_forward.py)
        if self._fast:
            fast_forward.fuse(self.model)
        self._state = self.model.state_dict()  # name -> tensor sharing storage with the live parameters
        self._membership = Membership()  # in the actor's weight transfer group
        self._routers = moe_routers(self.model)
        self.vlm = image_token_id(self.model) is not None
        if self.vlm:
            from transformers import AutoImageProcessor
            self.processor = AutoImageProcessor.from_pretrained(model_dir)
        self._picked: list[torch.Tensor] = []  # per MoE layer, in forward order: the router's top-k ids [B*L, k]
        for router in self._routers:
            router.register_forward_hook(lambda _m, _inputs, out: self._picked.append(out[2]))

        self._model_lock = threading.Lock()  # held for a whole step and for a weight swap
        self._cv = threading.Condition()  # guards _waiting, _live, _to_abort, _paused; never held across a forward
        self._waiting: deque[Sequence] = deque()
        self._live: dict[str, Sequence] = {}  # every unfinished request, by id
        self._to_abort: set[str] = set()
        self._paused = False
        self._rng = random.Random()  # seeded from os.urandom: request ids and seeds of unseeded requests
        self._outbox: list[Sequence] = []  # sequences with an event to hand over at the end of the step
        # Owned by the scheduler step (under _model_lock):
        self._running: list[Sequence] = []  # rows of the batch cache, in order
        self._stale: list[Sequence] = []  # held sequences whose KV was dropped after a swap; prefilled next
        self._cache: Optional[DynamicCache] = None  # per layer keys/values [B, heads, L + spare, head_dim], left-padded
        self._mask: Optional[torch.Tensor] = None  # [B, L] 1 = real token, 0 = left padding
        threading.Thread(target=self._loop, name="scheduler", daemon=True).start()

    # ------------------------------------------------------------------ the seam used by engine.py

    def health(self) -> dict:
        with self._cv:
            running = len(self._live) - len(self._waiting)
            return {"backend": "torch", "model": self.name, "version": self.version, "paused": self._paused,
                    "load": {"running": running, "waiting": len(self._waiting)}}

    def submit(self, req: GenerateRequest) -> tuple[str, AsyncIterator[Event]]:
        """Validate and queue a request (ValueError names the problem); returns its id and its events.
        Call from the event loop: events are handed over with call_soon_threadsafe."""
        check_generate_ids(req, self.vocab_size, self.max_len, "max_position_embeddings")
        images = [load_image(p, f"images[{i}]") for i, p in enumerate(req.images)]
        check_placeholders(self.model, req.prompt_token_ids, images, "prompt_token_ids")
        if req.return_routed_experts and not self._routers:
            raise ValueError(f"return_routed_experts: model {self.name!r} has no MoE routers")
        # a seeded Random, not uuid4/SystemRandom: their urandom call dropped the GIL, and the event loop waited
        # for the busy scheduler thread to give it back (measured: 1.6 ms a request)
        seed = req.sampling.seed if req.sampling.seed is not None else self._rng.getrandbits(63)
        seq = Sequence(request_id=req.request_id or f"{self._rng.getrandbits(64):016x}",
                       prompt=list(req.prompt_token_ids), sampling=req.sampling,
                       generator=torch.Generator().manual_seed(seed), loop=asyncio.get_running_loop(),
                       events=asyncio.Queue(), stream=req.stream, stream_chunk=req.stream_chunk,
                       return_routed_experts=req.return_routed_experts, images=images)
        with self._cv:
            if seq.request_id in self._live:
                raise ValueError(f"request_id {seq.request_id!r} is already in flight")
            self._live[seq.request_id] = seq
            self._waiting.append(seq)
            self._cv.notify_all()

        async def stream() -> AsyncIterator[Event]:
            try:
                while True:
                    ev = merge_events(await seq.events.get(), seq.events)
                    yield ev
                    if ev["finish_reason"]:
                        return
            finally:  # the client went away: stop generating for it
                if seq.finish_reason is None:
                    self._request_abort([seq.request_id])
        return seq.request_id, stream()

    def process_image(self, req: ImageRequest) -> dict:
        """Process an image once, store it content-addressed; generate requests and trajectories then name it."""
        if not self.vlm:
            raise ValueError(f"model {self.name!r} is not a vision-language model: it takes no images")
        return store_image(self.processor, self.model.config, req)

    def score(self, token_ids: list[int]) -> tuple[list[float], int]:
        """Teacher scoring: log p(token_ids[t] | token_ids[:t]) under the plain softmax, [0] = 0; one forward,
        between scheduler steps. Returns (logprobs, weight version)."""
        if len(token_ids) > self.max_len or min(token_ids) < 0 or max(token_ids) >= self.vocab_size:
            raise ValueError(f"score: token_ids must be at most {self.max_len} ids in [0, {self.vocab_size})")
        ids = torch.tensor([token_ids], device=self.device)  # [1, T]
        with self._model_lock, torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, :-1].float()  # [T-1, V]
            version = self.version
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0]  # [T-1]
        return [0.0] + logp.tolist(), version

    def pause(self, mode: str) -> None:
        """keep: stop stepping, hold in-flight requests. abort: also end them with 'abort'.
        Returns once no step is in flight (and the aborted requests have their final events)."""
        with self._cv:
            self._paused = True
            if mode == "abort":
                self._to_abort |= set(self._live)
            self._cv.notify_all()
        self._wait_reaped()
        with self._model_lock:  # wait for the step in flight, if any
            pass

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    def abort(self, request_ids: Optional[list[str]]) -> list[str]:
        """End the listed (None: all) requests with 'abort'; returns the ids that were in flight."""
        with self._cv:
            ids = [i for i in (request_ids if request_ids is not None else list(self._live)) if i in self._live]
        self._request_abort(ids)
        self._wait_reaped()
        return ids

    def receive_weights(self, req: WeightReceiveRequest) -> int:
        """Receive each broadcast bucket into the model, in the actor's transfer group (joined now or kept from an
        earlier push, weight_transfer.Membership). Joining runs outside the model lock: it waits up to the transfer
        timeout for an actor that may have died, and meanwhile the engine keeps generating (after the refit's resume)
        and can join the next push. Only the transfer itself blocks the scheduler, so no forward sees half-updated
        weights."""
        for bucket in req.buckets:
            for spec in bucket:
                self._check_tensor(spec.name, spec.shape, spec.dtype)
        group = self._membership.group_for(req)
        try:
            with self._model_lock:
                for name, t in receive_buckets(group, req.buckets, self.device, into=self._state):
                    self._state[name].copy_(t)
                self._set_version(req.version)
                self._membership.done(req)
        except Exception:
            self._membership.leave()
            raise
        return req.version

    def load_weights(self, path: str, version: int) -> int:
        """Load an HF safetensors directory (e.g. a checkpoint written by the actor)."""
        tensors = read_safetensors(path)
        for name, t in tensors.items():
            self._check_tensor(name, list(t.shape), str(t.dtype).removeprefix("torch."))
        with self._model_lock:
            for name, t in tensors.items():
                self._state[name].copy_(t)
            self._set_version(version)
        self._membership.leave()  # the actor's next push sends every tensor, frozen ones included
        return version

    # ------------------------------------------------------------------ weights

    def _check_tensor(self, name: str, shape: list[int], dtype: str) -> None:
        if name not in self._state:
            raise ValueError(f"tensor {name!r} is not a weight of this model")
        if list(self._state[name].shape) != list(shape):
            raise ValueError(f"tensor {name!r} has shape {list(shape)}, the model has {list(self._state[name].shape)}")
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r}")

    def _set_version(self, version: int) -> None:
        """Under _model_lock, after new weights are in."""
        self.version = version
        if self._fast:
            fast_forward.forget(self.model)  # its packed copies of the old weights
        if not self.keep_stale_kv:  # the held sequences' KV came from the old weights: recompute it
            self._stale = self._running + self._stale
            self._running, self._cache, self._mask = [], None, None
        with self._cv:
            self._cv.notify_all()

    # ------------------------------------------------------------------ aborts

    def _request_abort(self, ids: list[str]) -> None:
        with self._cv:
            self._to_abort.update(ids)
            self._cv.notify_all()

    def _wait_reaped(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: not self._to_abort)

    def _reap_aborted(self) -> None:
        """Under _model_lock: end the requests marked for abort, wherever they are."""
        with self._cv:  # an RLock: _drop_finished takes it again
            ids, self._to_abort = self._to_abort, set()
            for seq in [self._live[i] for i in ids if i in self._live]:
                seq.finish_reason = "abort"
                self._outbox.append(seq)
            self._waiting = deque(s for s in self._waiting if not s.finish_reason)
            self._stale = [s for s in self._stale if not s.finish_reason]
            self._drop_finished()
            self._flush()  # before the notify: abort() and pause() return once the final events are handed over
            self._cv.notify_all()

    # ------------------------------------------------------------------ the scheduler

    def _has_work(self) -> bool:
        return bool(self._to_abort) or (not self._paused and bool(self._waiting or self._running or self._stale))

    def _loop(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(self._has_work)
            with self._model_lock:
                self._reap_aborted()
                with self._cv:
                    if self._paused:
                        continue
                    room = self.max_batch - len(self._running) - len(self._stale)
                    fresh = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
                admitted, self._stale = self._stale + fresh, []
                try:
                    with torch.inference_mode():  # no_grad still kept version counters: a tenth of a tiny-model step
                        self._step(admitted)
                except Exception:  # e.g. out of memory: end this batch's requests, keep serving
                    traceback.print_exc()
                    self._fail(self._running + admitted)
                self._flush()

    def _flush(self) -> None:
        """Hand the step's events to their event loops, one call per loop: a call per token cost more than
        the decode forward (each wakes the loop through a socket write)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for seq in dict.fromkeys(self._outbox):  # once each, in order
            by_loop.setdefault(seq.loop, []).append((seq.events, take_event(seq)))
        self._outbox = []
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # the server's loop is already closed (shutdown)
                loop.call_soon_threadsafe(put_all, items)

    def _fail(self, seqs: list[Sequence]) -> None:
        with self._cv:
            for seq in seqs:
                if not seq.finish_reason:
                    seq.finish_reason = "abort"
                    self._outbox.append(seq)
            self._running, self._cache, self._mask = [], None, None
            self._drop_finished()

    def _step(self, admitted: list[Sequence]) -> None:
        if self._running:  # decode: feed each running sequence its last sampled token
            B = len(self._running)
            input_ids = as_tensor([s.tokens[-1] for s in self._running], self.device)[:, None]  # [B, 1]
            positions = as_tensor([len(s.prompt) + len(s.tokens) - 1 + s.rope_delta for s in self._running],
                                  self.device)[:, None]  # [B, 1]
            if self.vlm:  # M-RoPE: text positions are the same in its 3 sections
                positions = positions[None].expand(3, -1, -1)  # [3, B, 1]
            self._mask = torch.cat([self._mask, self._mask.new_ones(B, 1)], dim=1)  # [B, L+1]
            self._picked.clear()
            if self._fast:
                logits = fast_forward.forward(self.model, input_ids, positions, None, self._cache,
                                              self._mask.bool()[:, None, None, :])  # [B, V]
            else:
                logits = self.model(input_ids=input_ids, attention_mask=self._mask, position_ids=positions,
                                    cache=self._cache, use_cache=True, logits_to_keep=1).logits[:, -1]  # [B, V]
            self._sample(self._running, logits, self._last_routes(B))
        if admitted:  # prefill over prompt + tokens so far (the tokens are there after a weight swap)
            contexts = [s.context() for s in admitted]
            L = max(len(c) for c in contexts)
            input_ids = torch.tensor([[self.pad_id] * (L - len(c)) + c for c in contexts], device=self.device)  # [A, L]
            mask = torch.tensor([[0] * (L - len(c)) + [1] * len(c) for c in contexts], device=self.device)  # [A, L]
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # [A, L], 0-based within each sequence
            images = vision_inputs(self.model, input_ids, [im for s in admitted for im in s.images])
            if self.vlm:  # M-RoPE positions [3, A, L], as the model computes them itself (the actor's forward)
                positions, deltas = self.model.model.get_rope_index(
                    input_ids, (input_ids == image_token_id(self.model)).int(), images.get("image_grid_thw"),
                    attention_mask=mask)
                for s, delta in zip(admitted, deltas[:, 0].tolist()):
                    s.rope_delta = delta
            cache = DynamicCache(config=self.model.config.get_text_config())
            self._picked.clear()
            if self._fast:  # causal, over real keys (a padding query sees itself: a row of no keys would be NaN)
                causal = torch.ones(L, L, dtype=torch.bool, device=self.device).tril()  # [L, L]
                allowed = causal & (mask.bool()[:, None, :] | torch.eye(L, dtype=torch.bool, device=self.device))
                logits = fast_forward.forward(self.model, input_ids, positions, mask.bool(), cache, allowed[:, None])
            else:
                logits = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, cache=cache,
                                    use_cache=True, logits_to_keep=1, **images).logits[:, -1]  # [A, V]
            self._sample(admitted, logits, self._last_routes(len(admitted)))
            self._merge(admitted, cache, mask)
        self._drop_finished()

    def _last_routes(self, B: int) -> Optional[list]:
        """After a forward over [B, L] positions: each row's experts at its last position (the one whose
        logits are sampled from), [B][layers][k]; None for a model without routers."""
        if not self._routers:
            return None
        picked = [ids.view(B, -1, ids.shape[-1])[:, -1] for ids in self._picked]  # layers x [B, k]
        return torch.stack(picked, dim=1).tolist()  # [B, layers, k]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, routes: Optional[list]) -> None:
        """One token per sequence from logits [B, V], with each sequence's own parameters and generator.
        logprob = log p(token) under the distribution sampled from (after temperature, top-k, top-p).
        Greedy (temperature 0) takes the argmax and reports its logprob under the plain softmax.
        routes [B][layers][k]: the experts of the forward that produced these logits (MoE), or None."""
        logits = logits.float()
        params = [s.sampling for s in seqs]
        scaled = logits  # [B, V]; each step-wide op below only when a sequence needs it (x / 1 is x)
        if any(p.temperature not in (0, 1) for p in params):
            scaled = logits / as_tensor([p.temperature or 1.0 for p in params], self.device)[:, None]
        if any(p.top_k or p.top_p < 1 for p in params):  # the sort in filter_logits is a step's biggest cost
            scaled = filter_logits(scaled, as_tensor([p.top_k for p in params], self.device),
                                   as_tensor([p.top_p for p in params], self.device))
        logp = F.log_softmax(scaled, dim=-1)  # [B, V]
        # inverse-CDF sampling, one uniform per token from the request's own generator
        u = as_tensor([s.uniform() for s in seqs], self.device)  # [B]
        cdf = logp.exp().cumsum(dim=-1)  # [B, V]
        sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # [B], never a masked token
        tokens = sampled
        if any(p.temperature == 0 for p in params):
            greedy = as_tensor([p.temperature == 0 for p in params], self.device)  # [B]
            tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)  # [B]
            logp = torch.where(greedy[:, None], F.log_softmax(logits, dim=-1), logp)
        logprobs = logp.gather(1, tokens[:, None])[:, 0]  # [B]
        for i, (seq, token, logprob) in enumerate(zip(seqs, tokens.tolist(), logprobs.tolist())):
            seq.tokens.append(token)
            seq.logprobs.append(logprob)
            seq.versions.append(self.version)
            if seq.return_routed_experts:
                seq.routes.append(routes[i])
            if token in seq.sampling.stop_token_ids:
                seq.finish_reason = "stop"
            elif len(seq.tokens) >= seq.sampling.max_tokens or len(seq.prompt) + len(seq.tokens) >= self.max_len:
                seq.finish_reason = "length"
            if seq.finish_reason or seq.stream and len(seq.tokens) - seq.sent >= seq.stream_chunk:
                self._outbox.append(seq)

    def _merge(self, seqs: list[Sequence], cache: DynamicCache, mask: torch.Tensor) -> None:
        """Append freshly prefilled rows to the batch cache, left-padding the shorter side."""
        if not self._running:
            self._running, self._cache, self._mask = list(seqs), cache, mask
            return
        W, L = self._mask.shape[1], max(self._mask.shape[1], mask.shape[1])
        pad = lambda t, dim: F.pad(t, (0, 0) * (t.dim() - 1 - dim) + (L - t.shape[dim], 0))  # left-pad along dim
        for old, new in zip(self._cache.layers, cache.layers):  # [:W]: without fast_forward's spare columns
            old.keys = torch.cat([pad(old.keys[:, :, :W], 2), pad(new.keys, 2)], dim=0)
            old.values = torch.cat([pad(old.values[:, :, :W], 2), pad(new.values, 2)], dim=0)
        self._mask = torch.cat([pad(self._mask, 1), pad(mask, 1)], dim=0)
        self._running += seqs

    def _drop_finished(self) -> None:
        """Remove finished rows from the batch (and columns that became padding for everyone)."""
        with self._cv:
            for seq in [s for s in self._live.values() if s.finish_reason]:
                del self._live[seq.request_id]
        if all(not s.finish_reason for s in self._running):
            return
        keep = [i for i, s in enumerate(self._running) if not s.finish_reason]
        self._running = [self._running[i] for i in keep]
        if not keep:
            self._cache, self._mask = None, None
            return
        rows = torch.tensor(keep, device=self.device)
        mask = self._mask[rows]
        first = int(mask.any(dim=0).nonzero()[0])  # leading columns that are padding in every row
        self._mask = mask[:, first:]
        for layer in self._cache.layers:
            layer.keys = layer.keys[rows, :, first:]
            layer.values = layer.values[rows, :, first:]
