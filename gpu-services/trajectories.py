"""Reading trajectory files from the store (written by the TypeScript rollout worker).

One safetensors file per episode segment:
  tensors  tokens int32 [T] (prompt, sampled and observation tokens), logprobs float32 [T] (rollout logprob,
           0 where not sampled), versions int32 [T] (-1 where not sampled), loss_mask uint8 [T] (1 = sampled,
           trained), optional teacher_logprobs float32 [T] (on-policy distillation: log p_teacher of each sampled
           token given the tokens before it, 0 elsewhere), optional routed_experts int16 [T, layers, top_k] (MoE: the experts of the engine's forward
           that produced token t's logits, i.e. at position t-1; rows of -1 where there is no record)
  metadata format="molt-trajectory-v1", run, group, episode, segment, reward, finish (all strings), and
           sha256: hex digest of the data part of the file (everything after the header), checked here; optional
           images: a JSON list of processed image files (vision.py) relative to the store root, in the order of
           their placeholder runs in tokens (one file per distinct image of the episode, shared by its segments)
"""
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from vision import load_image

FORMAT = "molt-trajectory-v1"


@dataclass
class Segment:
    ref: str
    tokens: torch.Tensor  # long [T]
    rollout_logp: torch.Tensor  # float32 [T]
    versions: torch.Tensor  # long [T]
    loss_mask: torch.Tensor  # float32 [T], 0/1
    routed_experts: torch.Tensor | None  # long [T, layers, top_k]: the experts that produced each token, -1: none
    teacher_logp: torch.Tensor | None  # float32 [T]: the teacher pool's logprob of each sampled token
    group: int
    episode: int
    segment: int
    reward: float
    images: list[dict]  # processed images (vision.load_image), in placeholder order


def load_segment(store_root: str, ref: str) -> Segment:
    """Load and check one file; any problem is a ValueError naming the ref."""
    path = Path(store_root) / ref
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:  # missing, truncated, not safetensors
        raise ValueError(f"trajectory {ref!r} ({path}) is unreadable: {e}") from None
    if "sha256" in meta:  # files without one (written by hand, e.g. in tests) have nothing to verify
        raw = path.read_bytes()
        data = raw[8 + int.from_bytes(raw[:8], "little"):]  # u64 header length | header | data
        actual = hashlib.sha256(data).hexdigest()
        if actual != meta["sha256"]:
            raise ValueError(f"trajectory {ref!r} ({path}) is corrupted: sha256 of its tensor data is {actual}, "
                             f"the file says {meta['sha256']}; not trained on")
    if meta.get("format") != FORMAT:
        raise ValueError(f"trajectory {ref!r}: metadata format is {meta.get('format')!r}, expected {FORMAT!r}")
    expected = {"tokens": torch.int32, "logprobs": torch.float32, "versions": torch.int32, "loss_mask": torch.uint8}
    for name, dtype in expected.items():
        t = tensors.get(name)
        if t is None or t.dtype != dtype or t.dim() != 1:
            raise ValueError(f"trajectory {ref!r}: tensor {name!r} must be {dtype} [T], got "
                             f"{None if t is None else (t.dtype, list(t.shape))}")
    T = tensors["tokens"].numel()
    if T < 2 or any(tensors[n].numel() != T for n in expected):
        raise ValueError(f"trajectory {ref!r}: tokens, logprobs, versions, loss_mask must have one equal length >= 2")
    if tensors["loss_mask"][0]:
        raise ValueError(f"trajectory {ref!r}: loss_mask[0] is set, but the first token has no context to predict it")
    teacher = tensors.get("teacher_logprobs")
    if teacher is not None and (teacher.dtype != torch.float32 or list(teacher.shape) != [T]):
        raise ValueError(f"trajectory {ref!r}: teacher_logprobs must be float32 [T={T}], got {teacher.dtype} "
                         f"{list(teacher.shape)}")
    routed = tensors.get("routed_experts")
    if routed is not None and (routed.dim() != 3 or routed.shape[0] != T):
        raise ValueError(f"trajectory {ref!r}: routed_experts must be [T={T}, layers, top_k], got {list(routed.shape)}")
    try:
        group, episode, segment, reward = int(meta["group"]), int(meta["episode"]), int(meta["segment"]), float(meta["reward"])
    except (KeyError, ValueError) as e:
        raise ValueError(f"trajectory {ref!r}: metadata needs integer group/episode/segment and float reward: {e}") from None
    try:
        image_refs = json.loads(meta.get("images", "[]"))
        assert isinstance(image_refs, list) and all(isinstance(r, str) for r in image_refs)
    except (ValueError, AssertionError):
        raise ValueError(f"trajectory {ref!r}: metadata images must be a JSON list of refs") from None
    images = [load_image(str(Path(store_root) / r), f"trajectory {ref!r}") for r in image_refs]
    return Segment(ref=ref, tokens=tensors["tokens"].long(), rollout_logp=tensors["logprobs"],
                   versions=tensors["versions"].long(), loss_mask=tensors["loss_mask"].float(),
                   routed_experts=None if routed is None else routed.long(), teacher_logp=teacher,
                   group=group, episode=episode, segment=segment, reward=reward, images=images)


def pad_right(rows: list[torch.Tensor], value=0) -> torch.Tensor:
    """N tensors [T_i, ...] -> [N, max T_i, ...], padded at the end."""
    shape = (len(rows), max(r.shape[0] for r in rows), *rows[0].shape[1:])
    out = torch.full(shape, value, dtype=rows[0].dtype, device=rows[0].device)
    for i, r in enumerate(rows):
        out[i, :r.shape[0]] = r
    return out
