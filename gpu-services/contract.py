"""The HTTP bodies of the engine and the actor, defined once.

`python gpu-services/contract.py` writes gpu-services/contract.schema.json, which the TypeScript side
validates against (ajv), so both ends check the same shapes. Every model forbids unknown fields:
a typo in a sampling parameter must fail loudly, not be silently ignored.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ----------------------------------------------------------------------------- engine

class SamplingParams(Strict):
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)  # 0 = greedy
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # 0 = off
    stop_token_ids: list[int] = []
    seed: Optional[int] = None  # per-request generator; same seed + same weights -> same tokens


class GenerateRequest(Strict):
    prompt_token_ids: list[int] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    request_id: Optional[str] = None
    stream: bool = False  # true: NDJSON lines of GenerateChunk, the last one carries finish_reason
    # A streamed reply's tokens may be held until this many are ready (or it ends): fewer chunks to hand over, write
    # and parse when the reader needs no token at once (the episode journal). The torch engine does; vLLM's sends each.
    stream_chunk: int = Field(1, ge=1)
    return_routed_experts: bool = False  # MoE: per sampled token, the experts of every layer (see GenerateResponse)
    # vision-language models: processed image files (ImageResponse.path), in the order of their placeholder runs
    images: list[str] = []


class GenerateChunk(Strict):
    """One streamed piece; the final line also has finish_reason set."""
    token_ids: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: Optional[Literal["stop", "length", "abort"]] = None
    routed_experts: Optional[list[list[list[int]]]] = None  # [tokens][layers][top_k], when asked


class GenerateResponse(Strict):
    request_id: str
    token_ids: list[int]  # sampled ids, never re-tokenized text
    logprobs: list[float]  # log p(token) under the distribution actually sampled from
    versions: list[int]  # engine weight version when each token was sampled
    finish_reason: Literal["stop", "length", "abort"]
    # [tokens][layers][top_k], when asked: token i's experts are those chosen in the forward that produced its
    # logits (at the position before it), by the weights of versions[i]
    routed_experts: Optional[list[list[list[int]]]] = None


class ImageRequest(Strict):
    """Process one image with the model's image processor; the result is stored content-addressed in dir."""
    data: str  # base64 of the image file (PNG, JPEG, WEBP, GIF)
    dir: str  # where the processed tensors go (the episode's image folder in the store)


class ImageResponse(Strict):
    path: str  # <dir>/<sha256>.safetensors: pixel_values, image_grid_thw
    grid_thw: list[int]
    tokens: int  # placeholder tokens the image fills in the prompt


class EngineLoad(Strict):
    running: int
    waiting: int


class EngineHealth(Strict):
    backend: Literal["torch", "vllm"]
    model: str
    version: int
    paused: bool
    load: EngineLoad


class PauseRequest(Strict):
    mode: Literal["keep", "abort"] = "keep"


class AbortRequest(Strict):
    request_ids: Optional[list[str]] = None  # None = all


class TensorSpec(Strict):
    name: str
    dtype: str  # torch dtype name without prefix: "float32", "bfloat16"
    shape: list[int]


class WeightReceiveRequest(Strict):
    """Receive a broadcast of each bucket from the actor (rank 0) in torch.distributed group `group`: one flat uint8
    tensor holding the bucket's tensors back to back, in spec order. join: make the group now (a rendezvous at
    master_addr:master_port); else the engine holds it from an earlier push and checks in as push `seq`
    (weight_transfer.py). A bucket list may leave out tensors that cannot have changed (frozen ones)."""
    master_addr: str
    master_port: int
    world_size: int
    rank: int = Field(ge=1)
    backend: Literal["gloo", "nccl"] = "gloo"
    buckets: list[list[TensorSpec]]
    version: int
    group: str = ""
    join: bool = True
    seq: int = 0


class NotInGroup(Exception):
    """/weights/receive answers 409 with this: the engine does not hold the kept group it was asked to receive in
    (it restarted, or loaded other weights), so the actor makes a new one."""


class WeightLoadRequest(Strict):
    path: str  # HF model directory (safetensors)
    version: int


class VersionResponse(Strict):
    version: int


class ScoreRequest(Strict):
    """Teacher scoring: log p(token_ids[t] | token_ids[:t]) of exactly these ids under plain softmax."""
    token_ids: list[int] = Field(min_length=2)


class ScoreResponse(Strict):
    logprobs: list[float]  # [t] for each position; [0] = 0 (no context)
    version: int


# ----------------------------------------------------------------------------- actor

class RolloutCorrection(Strict):
    """Formulas in algorithm.rollout_correction."""
    level: Literal["off", "token", "seq", "geo"] = "off"
    mode: Literal["mask", "clip", "trunc"] = "mask"
    gate: Literal["ratio", "binary_kl", "tv"] = "ratio"  # the statistic that keeps or drops tokens or sequences
    low: float = 0.5  # ratio gate: kept if low <= ratio <= high; binary_kl and tv: kept if <= high
    high: float = 5.0

    @model_validator(mode="after")
    def _check(self):
        if self.level in ("seq", "geo") and self.mode != "mask":
            raise ValueError(f"rollout_correction level {self.level!r} keeps or drops whole sequences and weights each "
                             f"kept token by its own ratio: it needs mode 'mask', not {self.mode!r}")
        if self.level != "off" and self.gate != "ratio" and self.mode != "mask":
            raise ValueError(f"rollout_correction gate {self.gate!r} keeps or drops tokens: it needs mode 'mask', "
                             f"not {self.mode!r}")
        if self.gate == "ratio" and not self.low <= self.high:
            raise ValueError(f"rollout_correction needs low <= high, got low {self.low} and high {self.high}")
        return self


class AlgoConfig(Strict):
    advantage: Literal["grpo", "dr_grpo", "rloo", "reinforce_baseline", "reinforce++", "on_policy_distill",
                       "flash_reinforce"] = "grpo"
    policy_loss: Literal["ppo", "gspo", "cispo"] = "ppo"
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: Optional[float] = None  # c > 1: caps the loss of negative advantages at c * |A|
    rollout_correction: RolloutCorrection = RolloutCorrection()
    max_staleness: Optional[int] = None  # tokens older than this many versions are masked
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    kl_coef: float = 0.0  # needs a reference model (the actor's initial weights)
    entropy_coef: float = 0.0
    gamma: float = 1.0  # reinforce++ discount
    reward_clip: Union[float, tuple[float, float]] = 10.0  # c: rewards clamped to [-c, c]; [low, high]: to that range
    # MoE: route each sampled token's forward through the experts the engine recorded for it; sampled tokens
    # without a record are masked from the loss (metric routing/unrecorded_masked)
    routing_replay: bool = False
    micro_batch_tokens: int = 8192  # forward/backward in chunks of at most this many tokens
    # how the token losses add up to the step's loss (formulas in algorithm.loss_divisor); seq-mean-token-sum-norm
    # divides by a constant token budget per sequence, loss_agg_tokens (Dr. GRPO: the generation budget)
    loss_agg: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                      "seq-mean-token-sum-norm"] = "token-mean"
    loss_agg_tokens: Optional[int] = Field(None, ge=1)

    @model_validator(mode="after")
    def _check(self):
        clip = self.reward_clip
        if isinstance(clip, tuple) and not clip[0] < clip[1]:
            raise ValueError(f"reward_clip [low, high] needs low < high, got {list(clip)}")
        if not isinstance(clip, tuple) and not clip > 0:
            raise ValueError(f"reward_clip c clamps rewards to [-c, c] and must be > 0, got {clip}")
        if self.loss_agg == "seq-mean-token-sum-norm" and self.loss_agg_tokens is None:
            raise ValueError("loss_agg 'seq-mean-token-sum-norm' divides each sequence's token sum by a constant: set "
                             "loss_agg_tokens to the per-sequence token budget (Dr. GRPO uses the generation budget)")
        return self


class TrainStepRequest(Strict):
    run_id: str
    step: int = Field(ge=1)  # the step that produces weight version `step`
    store_root: str
    trajectories: list[str] = Field(min_length=1)  # refs relative to store_root
    algo: AlgoConfig = AlgoConfig()


class SftExample(Strict):
    """One demonstration, tokenized by the TS side with the rollouts' own path (agents/sft-data.ts)."""
    tokens: list[int] = Field(min_length=2)
    mask: list[int]  # 1 on the tokens the loss trains (the assistant turns), 0 elsewhere

    @model_validator(mode="after")
    def same_length(self):
        if len(self.mask) != len(self.tokens) or any(m not in (0, 1) for m in self.mask):
            raise ValueError(f"mask must be {len(self.tokens)} values of 0 or 1, one per token")
        return self


class SftStepRequest(Strict):
    """A supervised step: masked token cross-entropy on demonstrations (lr, betas, grad_clip, micro_batch_tokens
    from algo)."""
    run_id: str
    step: int = Field(ge=1)
    examples: list[SftExample] = Field(min_length=1)
    algo: AlgoConfig = AlgoConfig()


class TrainStepResponse(Strict):
    run_id: str
    step: int
    version: int
    replayed: bool  # true: (run_id, step) was already applied; these are the recorded metrics
    metrics: dict[str, float]


class EngineRef(Strict):
    url: str


class PushWeightsRequest(Strict):
    engines: list[EngineRef] = Field(min_length=1)
    version: int
    # a larger tensor goes alone, uncopied; smaller ones are packed. 16 MB: 33.7M parameters went 1.6x a raw broadcast
    # against 2.7x in 1 MB buckets (bench/refit.py; per bucket both ends wake up, and gloo costs CPU per message)
    bucket_bytes: int = Field(16 << 20, ge=1)


class PushWeightsResponse(Strict):
    version: int
    bytes: int  # frozen tensors go only to engines that lack them
    seconds: float
    new_group: bool = False  # a new transfer group (other engines, or one restarted): a rendezvous


class CheckpointRequest(Strict):
    path: str


class InitRequest(Strict):
    """Start run_id at step 0 from the weights of path: an HF model dir or a Molt checkpoint."""
    run_id: str
    path: str


class CheckpointResponse(Strict):
    path: str
    step: int
    version: int


class LogprobsRequest(Strict):
    token_ids: list[list[int]] = Field(min_length=1)
    images: list[list[str]] = []  # vision-language models: row i's processed image files, as in GenerateRequest


class LogprobsResponse(Strict):
    logprobs: list[list[float]]  # [i][t] = log p(token t | tokens < t); [i][0] = 0


class ActorHealth(Strict):
    version: int
    last_step: int
    run_id: Optional[str]
    world_size: int
    model: str


class ErrorResponse(Strict):
    error: str


ALL = [SamplingParams, GenerateRequest, GenerateChunk, GenerateResponse, ImageRequest, ImageResponse, EngineHealth, PauseRequest,
       AbortRequest, WeightReceiveRequest, WeightLoadRequest, VersionResponse, ScoreRequest, ScoreResponse,
       AlgoConfig,
       TrainStepRequest, SftExample, SftStepRequest, TrainStepResponse, PushWeightsRequest, PushWeightsResponse,
       CheckpointRequest, InitRequest, CheckpointResponse, LogprobsRequest, LogprobsResponse, ActorHealth, ErrorResponse]

SCHEMA_PATH = Path(__file__).with_name("contract.schema.json")


def json_schema() -> dict:
    return {m.__name__: m.model_json_schema() for m in ALL}


if __name__ == "__main__":
    text = json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
    if "--check" in sys.argv:  # used by the tests: the checked-in schema is current
        sys.exit(0 if SCHEMA_PATH.read_text() == text else f"{SCHEMA_PATH} is stale: run python {__file__}")
    SCHEMA_PATH.write_text(text)
