"""The policy actor: an FSDP2-sharded model that trains on stored trajectories, behind HTTP.

    python -m torch.distributed.run --standalone --nproc-per-node=N gpu-services/actor.py \
        --model DIR --port P --state-dir DIR [--token T] [--dtype bfloat16] [--offload-optimizer] [--ref-model DIR]

Every rank loads the model and shards it (fully_shard on each decoder layer and the root). Rank 0 serves HTTP
and drives the others: each command is broadcast to all ranks, which execute it together, one at a time.

Exactly-once steps: <state-dir>/steps.jsonl records every applied (run_id, step) with its metrics, appended and
fsynced after the optimizer step. A repeated step answers the recorded metrics (replayed=true). The log always
describes the steps inside the current weights: it starts empty (the --model weights hold no steps); a checkpoint
carries the log of its weights, and /checkpoint/load replaces the log by it, so entries of steps after the
checkpoint's step are gone: those steps are no longer in the weights and must be trained again.

One run at a time, any run: the weights and the log are those of one run. Switching to another run loads that run's
checkpoint (/checkpoint/load) or, for a run without one, /reset (the --model weights, a fresh optimizer, an empty
log), so the log is always the log of the run in the weights.

--offload-optimizer uses FSDP2's CPUOffloadPolicy (parameters, gradients and optimizer state on the CPU, the
optimizer step there); on a CPU-only machine everything already lives there, so it changes nothing.
"""
import argparse
import contextlib
import functools
import json
import math
import os
import re
import shutil
import socket
import sys
import threading
import time
import traceback
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Callable

import httpx
import torch
import torch.distributed as dist
import uvicorn
from fastapi import HTTPException
from fastapi.responses import JSONResponse
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

import weight_transfer
from algorithm import (compute_advantages, entropy_from_logits, loss_divisor, policy_objective, sft_loss,
                       staleness_mask)
from common import (bad_request, check_model_dir, load_causal_lm, moe_routers, parse_dtype, read_safetensors,
                    service_app, token_from_env, write_error)
from contract import (ActorHealth, AlgoConfig, CheckpointRequest, CheckpointResponse, InitRequest, LogprobsRequest,
                      LogprobsResponse, NotInGroup, PushWeightsRequest, PushWeightsResponse, SftStepRequest,
                      TensorSpec, TrainStepRequest, TrainStepResponse, WeightReceiveRequest)
from trajectories import Segment, load_segment, pad_right
from vision import check_placeholders, load_image, vision_inputs

FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)  # rank 0's full state into all shards
HEARTBEAT_S = 60  # idle ranks wait for commands inside a collective, which times out (gloo: 30 min) unless fed
LOGPROBS_MICRO_BATCH_TOKENS = 8192


# ----------------------------------------------------------------------------- batching

def plan_micro_batches(lengths: list[int], world_size: int, rank: int, max_tokens: int) -> list[list[int]]:
    """This rank's micro-batches (lists of row indices). Rows go to the rank with the fewest tokens so far
    (longest first); a micro-batch holds rows while rows * longest <= max_tokens (a longer row gets its own).
    Every rank gets the same number of micro-batches, because FSDP's collectives run once per forward:
    a rank with fewer gets empty ones, which run a dummy forward (row 0) whose loss is multiplied by 0."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    load, rows_of = [0] * world_size, [[] for _ in range(world_size)]
    for i in order:
        r = load.index(min(load))
        rows_of[r].append(i)
        load[r] += lengths[i]

    def pack(rows):
        batches = []
        for i in rows:  # longest first, so batch[0] is the longest of its batch
            if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= max_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    packed = [pack(rows) for rows in rows_of]
    count = max(len(b) for b in packed)
    return packed[rank] + [[] for _ in range(count - len(packed[rank]))]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """logits [b,L,V], tokens [b,L] -> logp [b,L]: logp[:, t] = log p(tokens[t] | tokens < t) from logits[:, t-1];
    position 0 has no context and gets 0."""
    logits = logits[:, :-1].float()  # [b,L-1,V]
    picked = logits.gather(-1, tokens[:, 1:, None]).squeeze(-1)  # [b,L-1]
    logp = picked - torch.logsumexp(logits, dim=-1)
    return torch.cat([torch.zeros_like(logp[:, :1]), logp], dim=1)


def recorded_routes(segments: list[Segment], routers: list[torch.nn.Module]) -> torch.Tensor:
    """[N,T,layers,k]: the experts the engine recorded with each token, -1 where it recorded none (prompt and
    observation tokens, segments without routed_experts, tokens whose routing the engine could not return).
    Token t's record holds the experts of the forward that produced its logits, i.e. of input position t-1."""
    layers, k = len(routers), routers[0].top_k
    return pad_right([s.routed_experts if s.routed_experts is not None else
                      torch.full((s.tokens.numel(), layers, k), -1, dtype=torch.long) for s in segments], -1)


@contextlib.contextmanager
def moe_routing(model, routes: torch.Tensor | None, replay: bool):
    """MoE routing of one forward over [b,L] tokens, given routes [b,L,layers,k]: the recorded experts of each
    input position (-1: none). replay: a position with a record runs the recorded experts, in recorded order,
    instead of the router's own top-k; their scores are recomputed from the router logits (softmax, renormalized
    over the k when the router does that), so the router still gets its gradient (and the logits still feed an
    auxiliary loss). Positions without a record keep the router's own choice.
    Yields agree [b,L] bool, filled when the block ends: the router's own top-k equals the record (as a set) at
    every layer (False where there is no record)."""
    if routes is None:
        yield None
        return
    matches = []  # per layer [b*L] bool

    def hook_for(layer: int):
        def hook(module, _inputs, output):
            logits, scores, own = output  # [b*L, experts], [b*L, k], [b*L, k]
            recorded = routes[:, :, layer].reshape(-1, routes.shape[-1])  # [b*L, k]
            matches.append((own.sort(dim=-1).values == recorded.sort(dim=-1).values).all(dim=-1))
            if not replay:
                return output
            has = (recorded >= 0).all(dim=-1, keepdim=True)  # [b*L, 1]
            experts = torch.where(has, recorded, own)  # [b*L, k]
            picked = torch.softmax(logits.float(), dim=-1).gather(-1, experts)  # [b*L, k]
            # Qwen3-VL-MoE's router (Mixtral's too) always renormalizes and has no norm_topk_prob: without the
            # attribute, its own scores tell (renormalized ones sum to 1; bf16 rounding stays well under 1e-2)
            if getattr(module, "norm_topk_prob", ((scores.float().sum(dim=-1) - 1).abs() < 1e-2).all()):
                picked = picked / picked.sum(dim=-1, keepdim=True)
            return logits, torch.where(has, picked.to(scores.dtype), scores), experts
        return hook

    agree = torch.zeros(routes.shape[:2], dtype=torch.bool, device=routes.device)
    handles = [r.register_forward_hook(hook_for(i)) for i, r in enumerate(moe_routers(model))]
    try:
        yield agree
        agree |= torch.stack(matches).all(dim=0).view(agree.shape)
    finally:
        for h in handles:
            h.remove()


def check_routes(model, segments: list[Segment], replay: bool) -> None:
    """Recorded experts fit the model's routers: [T, layers, top_k], each token's row all ids in range or all -1."""
    routers = moe_routers(model)
    if replay and not routers:
        raise ValueError("algo.routing_replay is on but the model has no MoE routers")
    for s in segments:
        if s.routed_experts is None:
            continue
        _, layers, k = s.routed_experts.shape
        if not routers or layers != len(routers) or k != routers[0].top_k or s.routed_experts.min() < -1 or \
                s.routed_experts.max() >= routers[0].num_experts:
            fit = f"{len(routers)} routers of top {routers[0].top_k} over {routers[0].num_experts} experts" \
                if routers else "no MoE routers"
            raise ValueError(f"trajectory {s.ref!r}: routed_experts [T, {layers}, {k}] does not fit the model ({fit})")
        missing = (s.routed_experts < 0).flatten(1)  # [T, layers*k]
        if (missing.any(dim=1) & ~missing.all(dim=1)).any():
            raise ValueError(f"trajectory {s.ref!r}: routed_experts rows must be all expert ids or all -1 (no record)")


# ----------------------------------------------------------------------------- the actor (all ranks)

def remove_killed_saves(folder: Path) -> None:
    """Clear what saves killed midway left in folder: a .<name>.tmp-<pid> (half written) is deleted, a .<name>.old-<pid>
    (the checkpoint a save replaced) too, unless <name> is missing: killed between its two renames, the old one is the
    only whole copy, and it goes back. Each is a whole checkpoint's bytes. A save is the only writer of such names, and
    one actor at a time saves a run's checkpoints (the run claims it), so none of them is a save in progress."""
    for p in folder.glob(".*"):
        m = re.fullmatch(r"\.(.+)\.(tmp|old)-\d+", p.name)
        if not (m and p.is_dir()):
            continue
        if m[2] == "old" and not (folder / m[1]).exists():
            p.rename(folder / m[1])
        else:
            shutil.rmtree(p, ignore_errors=True)

class Actor:
    def __init__(self, args):
        self.args = args
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
        self.dtype = parse_dtype(args.dtype)
        self.model = self.sharded(args.model)
        weight_transfer.flatten(self.model)  # on one rank, a push sends buckets from the weights, with no packing copy
        # weights no step changes (--freeze-vision): a push to engines that have them already leaves them out
        self.frozen = {n for n, p in self.model.named_parameters(remove_duplicate=False) if not p.requires_grad}
        self.send_buffers: list[torch.Tensor] = []  # rank 0: where buckets are packed, kept across pushes
        self.ref = self.sharded(args.ref_model).requires_grad_(False) if args.ref_model else None
        # lr, betas and weight decay are set from the request's algo at every step
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=AlgoConfig().lr)
        self.version, self.last_step, self.run_id = 0, 0, None
        self.init_path = None  # the directory the current run started from (/init), kept in its checkpoints
        self.lock = threading.Lock()  # rank 0: one command at a time
        self.log_path = Path(args.state_dir) / "steps.jsonl"
        self.step_log: dict[tuple[str, int], dict] = {}
        self.log_behind = False  # the file lacks steps of step_log (a write failed): rewrite it whole next time

    def sharded(self, path: str):
        """fp32 master weights; on GPU, --dtype sets the compute dtype (FSDP2 mixed precision, fp32 reductions)."""
        model = load_causal_lm(path, torch.float32, self.device)
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)
        offload = CPUOffloadPolicy() if self.args.offload_optimizer and self.device.type == "cuda" else OffloadPolicy()
        visual = getattr(model.model, "visual", None)  # a vision-language model's vision tower
        if visual is not None and self.args.freeze_vision:
            visual.requires_grad_(False)  # no gradients, so AdamW leaves it as it is
        layers = getattr(model.model, "language_model", model.model).layers
        for layer in [*layers, *(visual.blocks if visual is not None else [])]:
            fully_shard(layer, mp_policy=mp, offload_policy=offload)
        fully_shard(model, mp_policy=mp, offload_policy=offload)
        return model

    # --- commands: rank 0 broadcasts (name, args); every rank runs the method; rank 0 uses the result

    def run(self, name: str, *args, **rank0_only):
        """Rank 0, with self.lock held."""
        if self.world_size > 1:
            dist.broadcast_object_list([(name, args)], src=0)
        return getattr(self, name)(*args, **rank0_only)

    def follow(self):
        """Ranks > 0: execute commands forever."""
        while True:
            box = [None]
            dist.broadcast_object_list(box, src=0)
            name, args = box[0]
            try:
                getattr(self, name)(*args)
            except Exception:
                traceback.print_exc()

    def noop(self):
        pass

    def heartbeat(self):
        while True:
            time.sleep(HEARTBEAT_S)
            with self.lock:
                self.run("noop")

    # --- forward passes

    def micro_batch(self, tokens: torch.Tensor, lengths: list[int], rows: list[int]) -> torch.Tensor:
        """tokens [N,T] -> [b,L] for these rows, L = their longest. Right padding needs no attention mask: with
        causal attention no real token sees the padding after it."""
        return tokens[rows or [0], :max(lengths[i] for i in rows or [0])].to(self.device)

    @staticmethod
    def forward(model, x: torch.Tensor, rows: list[int], images: list[list[dict]] | None) -> torch.Tensor:
        """Logits [b,L,V] of micro-batch x (these rows; images[i]: row i's stored processed images, fed as stored:
        the model places them at the placeholders and computes the M-RoPE positions, as the engine did)."""
        extra = vision_inputs(model, x, [im for i in rows or [0] for im in images[i]]) if images else {}
        return model(input_ids=x, **extra).logits

    @torch.no_grad()
    def batch_logprobs(self, model, tokens: torch.Tensor, lengths: list[int], plan: list[list[int]],
                       routes: torch.Tensor | None = None, replay: bool = False,
                       images: list[list[dict]] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logprobs [N,T] of all rows: each rank computes its rows, a sum over ranks fills in the rest.
        routes [N,T,layers,k]: MoE experts recorded per input position (see moe_routing), replayed if replay;
        then also returns agree [N,T] (1.0 where the model's own top-k equals the record at every layer)."""
        out = torch.zeros(tokens.shape, dtype=torch.float32, device=self.device)
        agree = None if routes is None else torch.zeros(tokens.shape, dtype=torch.float32, device=self.device)
        for rows in plan:
            x = self.micro_batch(tokens, lengths, rows)
            with moe_routing(model, None if routes is None else routes[rows or [0], :x.shape[1]], replay) as same:
                logp = token_logprobs(self.forward(model, x, rows, images), x)
            if rows:
                out[rows, :x.shape[1]] = logp
                if same is not None:
                    agree[rows, :x.shape[1]] = same.float()
        if self.world_size > 1:
            dist.all_reduce(out)
            if agree is not None:
                dist.all_reduce(agree)
        return out, agree

    def logprobs(self, token_ids: list[list[int]], images: list[list[dict]] | None = None) -> list[list[float]]:
        tokens = pad_right([torch.tensor(t, dtype=torch.long) for t in token_ids])
        lengths = [len(t) for t in token_ids]
        plan = plan_micro_batches(lengths, self.world_size, self.rank, LOGPROBS_MICRO_BATCH_TOKENS)
        out = self.batch_logprobs(self.model, tokens, lengths, plan, images=images)[0].cpu()
        return [out[i, :n].tolist() for i, n in enumerate(lengths)]

    # --- one optimizer step

    def train_step(self, run_id: str, step: int, algo_json: dict, segments: list[Segment], load_s: float) -> dict:
        t_start = time.time()
        algo = AlgoConfig(**algo_json)
        dev = self.device
        lengths = [s.tokens.numel() for s in segments]
        tokens = pad_right([s.tokens for s in segments])  # [N,T]
        rollout_logp = pad_right([s.rollout_logp for s in segments]).to(dev)  # [N,T]
        versions = pad_right([s.versions for s in segments], -1).to(dev)  # [N,T]
        sampled = pad_right([s.loss_mask for s in segments]).to(dev)  # [N,T] 0/1
        # MoE: the experts the engine recorded with each token [N,T,layers,k] (-1: none), shifted to the input
        # position where they ran (token t's logits come from position t-1), the last position has none
        routers, routes = moe_routers(self.model), None
        recorded = sampled  # [N,T] sampled tokens with a record of their experts
        if routers and (algo.routing_replay or any(s.routed_experts is not None for s in segments)):
            by_token = recorded_routes(segments, routers).to(dev)
            routes = torch.cat([by_token[:, 1:], torch.full_like(by_token[:, :1], -1)], dim=1)
            recorded = sampled * (by_token >= 0).flatten(2).all(dim=-1)  # [N,T] sampled tokens with a record
        # replay never trains a token through guessed experts: sampled tokens without a record are masked
        trainable = recorded if algo.routing_replay else sampled
        plan = plan_micro_batches(lengths, self.world_size, self.rank, algo.micro_batch_tokens)

        # current weights, before the update
        images = [s.images for s in segments] if any(s.images for s in segments) else None
        old_logp, agree = self.batch_logprobs(self.model, tokens, lengths, plan, routes, algo.routing_replay, images)
        ref_logp = self.batch_logprobs(self.ref, tokens, lengths, plan, images=images)[0] if self.ref is not None else None
        t_old = time.time()

        mask = staleness_mask(versions, self.version, algo.max_staleness, trainable)  # [N,T] tokens that train
        staleness = (self.version - versions)[sampled > 0]  # versions behind, per sampled token
        # Invariant 3 is about tokens sampled at the actor's own version: their rollout logprobs must equal ours.
        fresh = (mask > 0) & (versions == self.version)  # [N,T]
        teacher_logp = None  # [N,T] the teacher pool's logprobs of the sampled tokens, when every segment has them
        if all(s.teacher_logp is not None for s in segments):
            teacher_logp = pad_right([s.teacher_logp for s in segments]).to(dev)
        advantages = episode_advantages(algo, segments, mask, old_logp, ref_logp, teacher_logp)  # [N,T]
        total_tokens = max(mask.sum().item(), 1.0)  # token means of the metrics, over all ranks
        divisor = loss_divisor(algo, mask)  # [N,1] from the whole step: every rank has the batch

        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor] = {}
        for rows in plan:
            x = self.micro_batch(tokens, lengths, rows)  # [b,L]
            L, idx = x.shape[1], rows or [0]
            with moe_routing(self.model, None if routes is None else routes[idx, :L], algo.routing_replay):
                logits = self.forward(self.model, x, rows, images)  # [b,L,V]
            logp = token_logprobs(logits, x)  # [b,L]
            entropy = entropy_from_logits(logits[:, :-1])  # [b,L-1]: entropy of the distribution of token t
            entropy = torch.cat([torch.zeros_like(entropy[:, :1]), entropy], dim=1)
            if algo.entropy_coef == 0:
                entropy = entropy.detach()
            loss, metrics = policy_objective(
                algo, logp, old_logp[idx, :L], rollout_logp[idx, :L], advantages[idx, :L], mask[idx, :L], divisor[idx],
                entropy=entropy, ref_logp=None if ref_logp is None else ref_logp[idx, :L])
            # FSDP averages gradients over ranks; the step's loss is the SUM of the ranks' losses, so scale by
            # world size. A dummy micro-batch (no rows) only keeps the collectives in step: weight 0.
            weight = float(self.world_size) if rows else 0.0
            (loss * weight).backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0) + v * (1.0 if rows else 0.0)
        keys = sorted(sums)
        totals = torch.stack([sums[k].float() for k in keys])
        if self.world_size > 1:
            dist.all_reduce(totals)
        sums = dict(zip(keys, totals.tolist()))
        t_fb = time.time()

        grad_norm = self.apply_gradients(algo, step, run_id)
        t_end = time.time()

        trained = sums["tokens"]
        rewards = torch.tensor(list({(s.group, s.episode): s.reward for s in segments}.values()))  # one per episode
        metrics = {
            "loss": sums["loss"],  # the step's loss, the sum of every micro-batch's and rank's share
            **{name: sums[key] / total_tokens for name, key in [
                ("pg_loss", "pg_loss"), ("entropy", "entropy"), ("kl", "kl"), ("clip_frac", "clip_frac"),
                ("is_masked_frac", "is_masked"), ("ratio", "ratio"), ("rollout_kl", "rollout_kl")]},
            "rollout_logp_max_abs_diff": ((old_logp - rollout_logp).abs() * mask).max().item(),
            "rollout_logp_mean_abs_diff": ((old_logp - rollout_logp).abs() * mask).sum().item() / total_tokens,
            "rollout_logp_max_abs_diff_same_version": ((old_logp - rollout_logp).abs() * fresh).max().item(),
            "grad_norm": grad_norm,
            "optimizer_skipped": float(not math.isfinite(grad_norm)),
            "stale_masked": (trainable.sum() - mask.sum()).item(),
            "tokens/trained": trained,
            "tokens/sampled": sampled.sum().item(),
            "tokens/total": float(sum(lengths)),
            "sequences": float(len(segments)),
            "episodes": float(rewards.numel()),
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(correction=0).item(),
            "lr": algo.lr,
            "time/load": load_s,
            "time/old_logprobs": t_old - t_start,
            "time/forward_backward": t_fb - t_old,
            "time/optimizer": t_end - t_fb,
            "time/total": load_s + t_end - t_start,
        }
        if teacher_logp is not None:  # the student's reverse KL to the teacher, k1 per sampled token
            metrics["distill/reverse_kl"] = (((old_logp - teacher_logp) * sampled).sum() / sampled.sum().clamp(min=1)).item()
        if routes is not None:
            # fraction of recorded sampled tokens whose own top-k (actor, current weights) equals the engine's at
            # every layer; the agreement at input position t-1 is token t's
            agree_by_token = torch.cat([torch.zeros_like(agree[:, :1]), agree[:, :-1]], dim=1)  # [N,T]
            metrics["routing/agreement"] = ((agree_by_token * recorded).sum() / recorded.sum().clamp(min=1)).item()
            metrics["routing/unrecorded"] = (sampled.sum() - recorded.sum()).item()
            metrics["routing/unrecorded_masked"] = (sampled.sum() - trainable.sum()).item()
        for value, count in zip(*torch.unique(staleness, return_counts=True)):
            metrics[f"staleness/{int(value)}"] = float(count)
        return metrics

    def sft_step(self, run_id: str, step: int, algo_json: dict, token_ids: list[list[int]],
                 masks: list[list[int]]) -> dict:
        """One supervised step on demonstrations (the SFT warm start): same model, optimizer and micro-batching as
        train_step, loss sft_loss on the masked (assistant) tokens."""
        t_start = time.time()
        algo = AlgoConfig(**algo_json)
        lengths = [len(t) for t in token_ids]
        tokens = pad_right([torch.tensor(t, dtype=torch.long) for t in token_ids])  # [N,T]
        mask = pad_right([torch.tensor(m, dtype=torch.float32) for m in masks]).to(self.device)  # [N,T]
        total = max(mask.sum().item(), 1.0)
        plan = plan_micro_batches(lengths, self.world_size, self.rank, algo.micro_batch_tokens)
        self.optimizer.zero_grad(set_to_none=True)
        sums = torch.zeros(2, device=self.device)  # loss, argmax hits on masked tokens
        for rows in plan:
            x = self.micro_batch(tokens, lengths, rows)  # [b,L]
            m = mask[rows or [0], :x.shape[1]] * (1.0 if rows else 0.0)  # a dummy micro-batch trains nothing
            logits = self.model(input_ids=x).logits  # [b,L,V]
            loss = sft_loss(token_logprobs(logits, x), m, total)
            (loss * self.world_size).backward()  # FSDP averages gradients over ranks
            hits = (logits[:, :-1].argmax(-1) == x[:, 1:]).float() * m[:, 1:]
            sums += torch.stack([loss.detach(), hits.sum() / total])
        if self.world_size > 1:
            dist.all_reduce(sums)
        grad_norm = self.apply_gradients(algo, step, run_id)
        return {"loss": sums[0].item(), "token_accuracy": sums[1].item(), "grad_norm": grad_norm,
                "optimizer_skipped": float(not math.isfinite(grad_norm)), "tokens/trained": total,
                "tokens/total": float(sum(lengths)), "sequences": float(len(lengths)), "lr": algo.lr,
                "time/total": time.time() - t_start}

    def apply_gradients(self, algo: AlgoConfig, step: int, run_id: str) -> float:
        """Clip, step with algo's lr, betas and weight decay (skipped when the gradient norm is not finite), and
        make the weights step `step` of the run."""
        for g in self.optimizer.param_groups:
            g.update(lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), algo.grad_clip)
        grad_norm = (grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm).item()
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version, self.last_step, self.run_id = step, step, run_id
        return grad_norm

    # --- weights out

    def push_weights(self, buckets: list[list[str]], ready: Callable[[], dist.ProcessGroup] | None = None) -> int:
        """All ranks gather each bucket's full tensors (a collective); rank 0 broadcasts them to the engines, gathering
        the next buckets while earlier ones are on the wire. Rank 0's ready() waits for the engines to be in the
        transfer group and returns it (EnginesLink.start): the state dict (~2 ms at 33.7M) is taken meanwhile. After
        a failure rank 0 still gathers the rest, so the other ranks' gathers stay in step."""
        state = self.model.state_dict()
        gathered = ([full_tensor(state[n]).to(self.dtype) for n in names] for names in buckets)
        try:
            group = ready() if ready is not None else None
            try:
                return weight_transfer.send_buckets(group, gathered, self.send_buffers) if group is not None else 0
            except Exception as e:
                raise RuntimeError(f"weight broadcast failed: {e}") from None
        finally:
            for _ in gathered:
                pass

    def save_checkpoint(self, path: str) -> None:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # full tensors on rank 0 only
        weights = get_model_state_dict(self.model, options=options)
        optim = get_optimizer_state_dict(self.model, self.optimizer, options=options)
        if self.rank != 0:
            return
        final = Path(path)
        remove_killed_saves(final.parent)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        try:
            self._write_checkpoint(tmp, weights, optim)
        except Exception as e:  # e.g. a full disk: leave nothing half-written behind, and say which disk
            shutil.rmtree(tmp, ignore_errors=True)
            raise write_error(e, final) from e
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    def _write_checkpoint(self, tmp: Path, weights: dict, optim: dict) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        tied = tied_output_name(self.model)
        save_file({k: v.contiguous() for k, v in weights.items() if k != tied}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        self.model.config.save_pretrained(tmp)
        for f in Path(self.args.model).iterdir():  # tokenizer, chat template, generation config
            if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")) and \
                    f.name not in ("config.json", "optimizer.pt", "trainer_state.json", "steps.jsonl"):
                shutil.copy2(f, tmp / f.name)
        with open(tmp / "optimizer.pt", "wb") as fh:  # a Python file: torch keeps its OSError (e.g. ENOSPC)
            torch.save(optim, fh)
        (tmp / "trainer_state.json").write_text(json.dumps(
            {"run_id": self.run_id, "step": self.last_step, "version": self.version, "init": self.init_path}))
        # the step log, so a fresh actor loading this still replays its steps (from memory: the file may be behind)
        (tmp / "steps.jsonl").write_text("".join(json.dumps(e) + "\n" for e in self.step_log.values()))
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())

    def load_checkpoint(self, trainer_state: dict, weights: dict | None = None, optim: dict | None = None,
                        ref_weights: dict | None = None) -> None:
        """All ranks; rank 0 passes the full state read from disk and broadcasts it into every rank's shards.
        ref_weights (rank 0: None unless the run started from an init dir) go into the reference model."""
        set_model_state_dict(self.model, weights or {}, options=FROM_RANK0)
        set_optimizer_state_dict(self.model, self.optimizer, optim or {}, options=FROM_RANK0)
        self.load_ref(ref_weights, trainer_state.get("init"))
        self.run_id, self.last_step, self.version = trainer_state["run_id"], trainer_state["step"], trainer_state["version"]
        self.init_path = trainer_state.get("init")

    def init_weights(self, run_id: str | None, path: str | None, weights: dict | None = None) -> None:
        """All ranks: start run_id at step 0 from the weights of an HF directory (policy and reference model),
        with a fresh optimizer: the moments of another run (or none, for a plain HF model) do not carry over.
        Without run_id and path (/reset): the --model weights, and the reference model back to --ref-model's."""
        self.load_ref(dict(weights or {}), path)  # a copy: loading replaces the dict's tensors by shards
        set_model_state_dict(self.model, weights or {}, options=FROM_RANK0)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=AlgoConfig().lr)
        self.run_id, self.last_step, self.version, self.init_path = run_id, 0, 0, path

    def load_ref(self, weights: dict | None, init: str | None) -> None:
        """All ranks: the KL reference is the run's starting point: its init dir, else --ref-model as loaded."""
        if self.ref is None or init is None and self.init_path is None:
            return  # no reference, or it already holds --ref-model's weights
        if init is None:
            weights = read_weights(self.ref, self.args.ref_model) if self.rank == 0 else {}
        set_model_state_dict(self.ref, weights or {}, options=FROM_RANK0)

    # --- the step log (rank 0)

    def set_log(self, entries: list[dict]) -> None:
        """Replace the step log (atomically) by entries: those of the steps inside the current weights."""
        self.step_log = {(e["run_id"], e["step"]): e for e in entries}
        tmp = self.log_path.with_suffix(".tmp")
        try:
            with open(tmp, "w") as f:
                f.writelines(json.dumps(e) + "\n" for e in entries)
                f.flush()
                os.fsync(f.fileno())
            tmp.rename(self.log_path)
            self.log_behind = False
        except OSError as e:
            tmp.unlink(missing_ok=True)
            self.log_behind = True
            raise write_error(e, self.log_path) from e

    def append_log(self, entry: dict) -> None:
        """In memory first: the step is in the weights now, so a retry must be answered, not trained again, even
        when the file write fails (a full disk); the file is then rewritten whole at the next step."""
        self.step_log[(entry["run_id"], entry["step"])] = entry
        if self.log_behind:
            return self.set_log(list(self.step_log.values()))
        try:
            with open(self.log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
        except OSError as e:  # the file may end in a torn line: rewrite it next time
            self.log_behind = True
            raise write_error(e, self.log_path) from e


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    if not isinstance(t, DTensor):
        return t
    # on one rank the shard is the whole tensor: full_tensor() would return it too, after ~0.1 ms of dispatch
    return t.to_local() if t.device_mesh.size() == 1 else t.full_tensor()


def tied_output_name(model) -> str | None:
    """The output embedding's weight name when it is tied to the input embedding (saved once, under the input's name)."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return None
    out = model.get_output_embeddings()
    return next((f"{n}.weight" for n, m in model.named_modules() if m is out), None)


def input_embedding_name(model) -> str:
    emb = model.get_input_embeddings()
    return next(f"{n}.weight" for n, m in model.named_modules() if m is emb)


def episode_advantages(algo: AlgoConfig, segments: list[Segment], mask: torch.Tensor, old_logp: torch.Tensor,
                       ref_logp: torch.Tensor | None, teacher_logp: torch.Tensor | None = None) -> torch.Tensor:
    """Advantages [N,T] per segment row, computed over episodes: the segments of one episode (group, episode) are
    joined in segment order into one row, so an episode is one sample of its group (counted once) and returns
    flow across its segments; the result is split back into segment rows. on_policy_distill's teacher is the
    teacher pool's scores stored with the trajectories (teacher_logp), else the reference model (--ref-model)."""
    episodes: dict[tuple[int, int], list[int]] = {}
    for i in sorted(range(len(segments)), key=lambda i: segments[i].segment):
        episodes.setdefault((segments[i].group, segments[i].episode), []).append(i)
    keys = list(episodes)
    lengths = [segments[i].tokens.numel() for i in range(len(segments))]

    def joined(x: torch.Tensor) -> torch.Tensor:  # [N,T] segment rows -> [E, T_episode] episode rows
        return pad_right([torch.cat([x[i, :lengths[i]] for i in episodes[k]]) for k in keys])

    rewards = torch.tensor([segments[episodes[k][0]].reward for k in keys], dtype=torch.float32, device=mask.device)
    group_ids = torch.tensor([k[0] for k in keys], dtype=torch.long, device=mask.device)
    if algo.advantage == "on_policy_distill" and teacher_logp is not None:
        extra = dict(teacher_logp=joined(teacher_logp), student_logp=joined(old_logp))
    elif ref_logp is None:
        extra = {}
    elif algo.advantage == "on_policy_distill":
        extra = dict(teacher_logp=joined(ref_logp), student_logp=joined(old_logp))
    else:
        extra = dict(logp_minus_ref=joined(old_logp - ref_logp))
    adv = compute_advantages(algo, rewards, group_ids, joined(mask), **extra)  # [E, T_episode]
    out = torch.zeros_like(mask)
    for e, k in enumerate(keys):
        offset = 0
        for i in episodes[k]:
            out[i, :lengths[i]] = adv[e, offset:offset + lengths[i]]
            offset += lengths[i]
    return out


# ----------------------------------------------------------------------------- HTTP (rank 0)

class EnginesLink:
    """Rank 0's end of the weight transfer group (weight_transfer.py), kept from one push to the next while the
    engines pushed to stay the same, so a refit costs no rendezvous. Other engines (one added, drained or missed), a
    failed push, or an engine that does not hold the group (it restarted) make a new one."""

    def __init__(self, args, backend: str, token: str | None):
        self.args, self.backend = args, backend
        self.http = httpx.Client(timeout=None, headers={"Authorization": f"Bearer {token}"} if token else {})
        self.urls: list[str] | None = None  # the engines of the group, in rank order
        self.store = self.group = None
        self.pool: ThreadPoolExecutor | None = None  # a thread per engine's answer and one for the rendezvous
        self.id, self.port, self.seq = "", 0, 0
        self.complete = False  # the engines hold every tensor of the actor's weights, frozen ones included

    def close(self) -> None:
        if self.group is not None:
            self.group.shutdown()
        if self.pool is not None:
            self.pool.shutdown(wait=False)
        self.urls, self.store, self.group, self.pool, self.complete = None, None, None, None, False

    def receive(self, url: str, body: WeightReceiveRequest) -> int:
        try:
            r = self.http.post(f"{url}/weights/receive", content=body.model_dump_json(),
                               headers={"Content-Type": "application/json"})
        except httpx.HTTPError as e:
            raise RuntimeError(f"engine {url}: {type(e).__name__}: {e}") from None
        if r.status_code == 409:
            raise NotInGroup(f"engine {url}: {r.json()['error']}")
        if r.status_code != 200:
            raise RuntimeError(f"engine {url} answered {r.status_code}: {r.text[:500]}")
        return r.json()["version"]

    def start(self, urls: list[str], specs: list[list[TensorSpec]], version: int) \
            -> tuple[list[Future], Callable[[], dist.ProcessGroup]]:
        """Asks each engine to receive `specs` as `version`; returns their answers, and ready(), which returns the
        group once all of them wait for the broadcast (an engine answers only after receiving, so an answer before
        then is a failure) and raises NotInGroup when an engine lacks the kept group."""
        fresh, world, server = self.urls != urls, 1 + len(urls), None
        if fresh:
            self.close()
            server = weight_transfer.listen(self.args.host)  # where the HTTP API listens, not every interface
            self.id, self.port = uuid.uuid4().hex, server.getsockname()[1]
            self.pool = ThreadPoolExecutor(world)  # kept with the group: a new one costs ~0.2 ms a push
        self.seq += 1
        answers = [self.pool.submit(self.receive, url, WeightReceiveRequest(
            master_addr=self.args.advertise_host, master_port=self.port, world_size=world, rank=i + 1,
            backend=self.backend, buckets=specs, version=version, group=self.id, join=fresh, seq=self.seq))
            for i, url in enumerate(urls)]
        joined = self.pool.submit(weight_transfer.open_group, self.args.host, self.port, world, 0, self.backend,
                                  server=server) if fresh else None
        return answers, lambda: self._ready(fresh, world, answers, joined, urls)

    def _ready(self, fresh: bool, world: int, answers: list[Future], joined: Future | None,
               urls: list[str]) -> dist.ProcessGroup:
        if fresh:
            done, _ = wait([joined, *answers], return_when=FIRST_COMPLETED)
            failure = next((f.exception() for f in done if f.exception()), None)
        else:  # the kept group: each engine checks in through the store, or answers NotInGroup at once
            deadline, failure = time.time() + weight_transfer.TIMEOUT_S, None
            while failure is None and not weight_transfer.check_in(self.store, self.seq, world):
                failure = next((a.exception() or RuntimeError("answered early") for a in answers if a.done()), None)
                if failure is None and time.time() > deadline:
                    failure = TimeoutError(f"engines did not check in within {weight_transfer.TIMEOUT_S} s")
                time.sleep(0.0002)
            self.store.set(f"go/{self.seq}", "0" if failure else "1")  # those that checked in return, or receive
        if failure is not None:
            self.close()
            raise failure if isinstance(failure, NotInGroup) else \
                RuntimeError(f"engines did not join the weight transfer group: {failure}")
        if fresh:
            self.store, self.group = joined.result()
            self.urls = urls
        return self.group


def build_app(actor: Actor, token: str | None):
    app = service_app("molt-actor", token)
    args = actor.args

    @app.exception_handler(Exception)
    async def failed(_request, exc: Exception):
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/health")
    def health() -> ActorHealth:
        return ActorHealth(version=actor.version, last_step=actor.last_step, run_id=actor.run_id,
                           world_size=actor.world_size, model=args.model)

    def once(run_id: str, step: int, train: Callable[[], dict]) -> TrainStepResponse:
        """Exactly once: an applied (run_id, step) answers its recorded metrics; the next step is trained (train()
        checks its input and returns the metrics) and recorded; any other step is a 409."""
        with actor.lock:
            done = actor.step_log.get((run_id, step))
            if done is not None:
                return TrainStepResponse(run_id=run_id, step=step, version=done["version"], replayed=True,
                                         metrics=done["metrics"])
            if step != actor.last_step + 1 or (actor.last_step > 0 and run_id != actor.run_id):
                raise HTTPException(409, f"step {step} of run {run_id!r} is neither applied nor next: the actor "
                                         f"holds step {actor.last_step} of run {actor.run_id!r} and can only apply "
                                         f"step {actor.last_step + 1} of that run")
            metrics = train()
            actor.append_log({"run_id": run_id, "step": step, "version": actor.version, "metrics": metrics})
            return TrainStepResponse(run_id=run_id, step=step, version=actor.version, replayed=False, metrics=metrics)

    @app.post("/train_step")
    def train_step(req: TrainStepRequest) -> TrainStepResponse:
        def train() -> dict:
            algo = req.algo
            t0 = time.time()
            with bad_request():
                segments = [load_segment(req.store_root, ref) for ref in req.trajectories]
                check_routes(actor.model, segments, algo.routing_replay)
                for s in segments:
                    check_placeholders(actor.model, s.tokens.tolist(), s.images, f"trajectory {s.ref!r}")
            scored = all(s.teacher_logp is not None for s in segments)
            if actor.ref is None and (algo.kl_coef > 0 or algo.advantage == "on_policy_distill" and not scored):
                raise HTTPException(400, f"algo.kl_coef={algo.kl_coef} / advantage={algo.advantage!r} needs a "
                                         f"reference model (start the actor with --ref-model) or, for distillation, "
                                         f"trajectories scored by a teacher pool (recipe key `teacher`)")
            return actor.run("train_step", req.run_id, req.step, algo.model_dump(), segments, time.time() - t0)
        return once(req.run_id, req.step, train)

    @app.post("/sft_step")
    def sft_step(req: SftStepRequest) -> TrainStepResponse:
        vocab = actor.model.config.vocab_size
        for i, e in enumerate(req.examples):
            if min(e.tokens) < 0 or max(e.tokens) >= vocab:
                raise HTTPException(400, f"examples[{i}].tokens must be ids in [0, {vocab})")
        return once(req.run_id, req.step, lambda: actor.run("sft_step", req.run_id, req.step, req.algo.model_dump(),
                                                            [e.tokens for e in req.examples],
                                                            [e.mask for e in req.examples]))

    @app.post("/logprobs")
    def logprobs(req: LogprobsRequest) -> LogprobsResponse:
        vocab = actor.model.get_input_embeddings().num_embeddings
        if req.images and len(req.images) != len(req.token_ids):
            raise HTTPException(400, f"images has {len(req.images)} rows, token_ids {len(req.token_ids)}")
        with bad_request():
            images = [[load_image(p, f"images[{i}]") for p in paths] for i, paths in enumerate(req.images)]
            for i, ids in enumerate(req.token_ids):
                if not ids or min(ids) < 0 or max(ids) >= vocab:
                    raise ValueError(f"token_ids[{i}] must be non-empty ids in [0, {vocab})")
                check_placeholders(actor.model, ids, images[i] if images else [], f"token_ids[{i}]")
        with actor.lock:
            return LogprobsResponse(logprobs=actor.run("logprobs", req.token_ids, images or None))

    link = EnginesLink(args, "nccl" if actor.device.type == "cuda" else "gloo", token)

    @functools.cache  # names and shapes stay (other weights loaded into the actor have this architecture)
    def plans(skip_frozen: bool, bucket_bytes: int) -> list[list[TensorSpec]]:
        """The buckets of a push: in state-dict order, names as in the HF state dict, DTensors at full shapes. A tied
        output embedding is the input one on the engine too (vLLM skips its name), so it goes once."""
        tied = tied_output_name(actor.model)
        skip = actor.frozen if skip_frozen else set()
        return weight_transfer.plan_buckets(
            ((n, torch.empty(t.shape, dtype=actor.dtype, device="meta"))
             for n, t in actor.model.state_dict().items() if n != tied and n not in skip), bucket_bytes)

    def push(urls: list[str], req: PushWeightsRequest) -> tuple[int, bool]:
        """Returns the bytes sent and whether a new group was made."""
        kept = link.urls == urls
        specs = plans(kept and link.complete, req.bucket_bytes)  # a frozen tensor cannot have changed since then
        answers, ready = link.start(urls, specs, req.version)
        sent = actor.run("push_weights", [[s.name for s in b] for b in specs], ready=ready)
        while (versions := weight_transfer.done_versions(link.store, link.seq, answers)) is None:
            time.sleep(0.0002)
        if any(v != req.version for v in versions):
            raise RuntimeError(f"engines answered versions {versions}, expected {req.version}")
        link.complete = True
        return sent, not kept

    @app.post("/push_weights")
    def push_weights(req: PushWeightsRequest) -> PushWeightsResponse:
        with actor.lock:
            t0 = time.time()
            urls = [e.url.rstrip("/") for e in req.engines]
            try:
                try:
                    sent, new_group = push(urls, req)
                except NotInGroup:  # an engine restarted since the last push: a new group, with every tensor
                    sent, new_group = push(urls, req)
            except Exception as e:
                link.close()
                raise HTTPException(502, f"weight push failed: {e}")
            return PushWeightsResponse(version=req.version, bytes=sent, seconds=time.time() - t0, new_group=new_group)

    @app.post("/checkpoint/save")
    def checkpoint_save(req: CheckpointRequest) -> CheckpointResponse:
        with actor.lock:
            actor.run("save_checkpoint", req.path)
            return CheckpointResponse(path=req.path, step=actor.last_step, version=actor.version)

    def other_weights(command: str, *args, log: list[dict], **rank0_only) -> None:
        """Put other weights in (an actor command); the step log becomes theirs (log)."""
        actor.run(command, *args, **rank0_only)
        link.complete = False  # the next push sends the frozen tensors too
        actor.set_log(log)

    @app.post("/checkpoint/load")
    def checkpoint_load(req: CheckpointRequest) -> CheckpointResponse:
        with actor.lock:
            with bad_request():
                trainer_state, weights, optim, log, ref = read_checkpoint(actor, req.path)
            other_weights("load_checkpoint", trainer_state, log=log, weights=weights, optim=optim, ref_weights=ref)
            return CheckpointResponse(path=req.path, step=actor.last_step, version=actor.version)

    @app.post("/reset")
    def reset() -> ActorHealth:
        """Back to the --model weights and a fresh optimizer: a run without a checkpoint starts from here."""
        with actor.lock:
            other_weights("init_weights", None, None, log=[], weights=read_weights(actor.model, args.model))
        return health()

    @app.post("/init")
    def init(req: InitRequest) -> CheckpointResponse:
        """Start run req.run_id at step 0 from any HF model dir or Molt checkpoint (its weights only)."""
        with actor.lock:
            with bad_request("init dir "):
                weights = read_weights(actor.model, req.path)
            other_weights("init_weights", req.run_id, req.path, log=[], weights=weights)
            return CheckpointResponse(path=req.path, step=0, version=0)

    return app


def read_weights(model, path: str) -> dict:
    """Rank 0: the full weights of an HF safetensors directory, checked against the model (names and shapes, so
    another architecture or vocabulary is refused); a ValueError names the directory."""
    try:
        weights = read_safetensors(path)
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"{path!r} is not loadable: {e}") from None
    tied = tied_output_name(model)
    if tied is not None and input_embedding_name(model) in weights:
        weights.setdefault(tied, weights[input_embedding_name(model)])
    expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}  # DTensors: full shapes
    got = {n: tuple(t.shape) for n, t in weights.items()}
    if got != expected:
        diff = sorted(set(got.items()) ^ set(expected.items()))[:5]
        raise ValueError(f"{path!r} does not fit the model: differing (name, shape) e.g. {diff}")
    return weights


def read_checkpoint(actor: Actor, path: str) -> tuple[dict, dict, dict, list[dict], dict | None]:
    """Rank 0: trainer state, full weights, optimizer state, step log of a checkpoint dir, checked against the
    model, and the weights of the run's init dir (None without one) for the reference model. The log keeps the
    checkpoint's run and steps <= its step: later steps are not in these weights."""
    p = Path(path)
    try:
        weights = read_weights(actor.model, path)
        trainer_state = json.loads((p / "trainer_state.json").read_text())
        optim = torch.load(p / "optimizer.pt", weights_only=True)
        log = [json.loads(line) for line in (p / "steps.jsonl").read_text().splitlines() if line.strip()]
    except (OSError, ValueError, RuntimeError) as e:
        raise ValueError(f"checkpoint {path!r} is not loadable: {e}") from None
    init = trainer_state.get("init")
    ref = read_weights(actor.ref, init) if init is not None and actor.ref is not None else None
    log = [e for e in log if e["run_id"] == trainer_state["run_id"] and e["step"] <= trainer_state["step"]]
    return trainer_state, weights, optim, log, ref


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--token", default=token_from_env())
    p.add_argument("--state-dir", required=True)
    p.add_argument("--dtype", default="float32", help="compute dtype (bfloat16 on GPU); master weights are fp32")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--ref-model", default=None, help="frozen reference for KL terms (e.g. the initial model)")
    p.add_argument("--freeze-vision", action="store_true", help="vision-language models: train the language model only")
    p.add_argument("--advertise-host", default=None, help="address engines use to reach this host (weight push)")
    args = p.parse_args()
    if args.advertise_host is None:
        args.advertise_host = args.host if args.host not in ("0.0.0.0", "::") else socket.getfqdn()
    try:
        for path in [args.model] + ([args.ref_model] if args.ref_model else []):
            check_model_dir(path)
        parse_dtype(args.dtype)
    except ValueError as e:
        sys.exit(f"actor: {e}")
    Path(args.state_dir).mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")

    actor = Actor(args)
    if actor.rank != 0:
        actor.follow()
        return
    actor.set_log([])  # the weights of --model hold no steps
    threading.Thread(target=actor.heartbeat, daemon=True).start()
    uvicorn.run(build_app(actor, args.token), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
