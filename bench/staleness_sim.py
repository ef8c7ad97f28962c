"""How does the loss learn from stale data? The copy/reverse task in one process, without the stack.

The loop's asynchrony reaches the loss only as staleness: each group was sampled by the policy of some
earlier version. This script samples every group from a snapshot k versions old, k drawn from a given
distribution (k = 0: the synchronous loop), and trains with the actor's own functions (algorithm.py:
staleness_mask, compute_advantages, rollout_correction, policy_objective; AdamW, clipping, one optimizer
step per batch, as actor.py). It isolates the algorithm from the loop: if it reproduces the stack's
curves, a fix can be tried on many seeds in minutes; bench:learning then checks it on the real stack.

  .venv/bin/python bench/staleness_sim.py --task reverse --seeds 0,1,2 --staleness 0 --staleness 1:.25,2:.6,3:.15
  (each --staleness is one configuration; --set key=value changes the algo config, as `molt-client start --set algo.`)
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu-services"))
from algorithm import compute_advantages, entropy_from_logits, loss_divisor, policy_objective, staleness_mask  # noqa: E402
from actor import token_logprobs  # noqa: E402
from contract import AlgoConfig  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPE = json.loads((ROOT / "recipes/copy/recipe.json").read_text())


def parse_staleness(text: str) -> tuple[list[int], list[float]]:
    """'0' -> always 0; '1:.25,2:.6,3:.15' -> that distribution of versions behind."""
    pairs = [p.split(":") for p in text.split(",")]
    ks = [int(p[0]) for p in pairs]
    ws = [float(p[1]) if len(p) > 1 else 1.0 for p in pairs]
    return ks, ws


def task_prompt(rng: random.Random, reverse: bool, letters: str, length: int) -> tuple[list[int], list[int]]:
    """Prompt bytes (the tiny model's tokenizer is byte-level) and the target bytes."""
    shown = "".join(rng.choice(letters) for _ in range(length))
    target = shown[::-1] if reverse else shown
    return list(f"{'reverse' if reverse else 'copy'} {shown}>".encode()), list(target.encode())


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A completion of `max_tokens` tokens at temperature 1 (the recipe's sampling) for each of n prompts of one
    length: ids and logprobs [n, max_tokens]."""
    x = torch.tensor(prompts)
    ids, logps = [], []
    for _ in range(max_tokens):
        logp = torch.log_softmax(model(input_ids=x).logits[:, -1].float(), dim=-1)  # [n,V]
        tok = torch.multinomial(logp.exp(), 1, generator=gen)  # [n,1]
        ids.append(tok)
        logps.append(logp.gather(1, tok))
        x = torch.cat([x, tok], dim=1)
    return torch.cat(ids, 1), torch.cat(logps, 1)


def run(model_dir: str, reverse: bool, seed: int, steps: int, staleness: str, algo: AlgoConfig,
        groups: int, group_size: int, log=None) -> list[dict]:
    torch.manual_seed(seed)
    # Prompts and staleness draw from their own streams: configurations of one seed see the same prompts
    rng, stale_rng, gen = random.Random(seed), random.Random(seed + 10_000), torch.Generator().manual_seed(seed)
    env = RECIPE["env"]
    max_tokens = RECIPE["sampling"]["max_tokens"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=algo.lr, betas=algo.betas, weight_decay=algo.weight_decay)
    ks, ws = parse_staleness(staleness)
    snapshots = {0: copy.deepcopy(model).eval()}  # version -> weights
    curve = []
    for step in range(1, steps + 1):
        version = step - 1  # the actor's version before this step
        # --- rollouts: each group from the snapshot k versions behind (not before version 0); the groups of one
        # version are sampled together (one forward per token for all of them)
        tasks = [(max(0, version - stale_rng.choices(ks, ws)[0]), *task_prompt(rng, reverse, env["letters"], env["length"]))
                 for _ in range(groups)]
        sampled = {}
        for v in sorted({t[0] for t in tasks}):
            mine = [g for g, t in enumerate(tasks) if t[0] == v]
            prompts = [tasks[g][1] for g in mine for _ in range(group_size)]
            ids, logp = sample(snapshots[v], prompts, max_tokens, gen)
            for j, g in enumerate(mine):
                sampled[g] = (ids[j * group_size:(j + 1) * group_size], logp[j * group_size:(j + 1) * group_size])
        rows, rewards, group_ids, versions = [], [], [], []
        for g, (v, prompt, target) in enumerate(tasks):
            ids, logp = sampled[g]
            for i in range(group_size):
                hits = sum(int(a == b) for a, b in zip(ids[i].tolist(), target))
                rows.append((prompt, ids[i], logp[i]))
                rewards.append(hits / len(target))
                group_ids.append(g)
                versions.append(v)
        # --- one optimizer step, as actor.train_step
        P = len(rows[0][0])
        tokens = torch.stack([torch.cat([torch.tensor(p), a]) for p, a, _ in rows])  # [B,T]
        B, T = tokens.shape
        loss_mask = torch.zeros(B, T)
        loss_mask[:, P:] = 1
        rollout_logp = torch.zeros(B, T)
        rollout_logp[:, P:] = torch.stack([lp for _, _, lp in rows])
        token_versions = torch.tensor(versions)[:, None].expand(B, T).where(loss_mask > 0, torch.tensor(-1))
        logits = model(input_ids=tokens).logits.float()  # [B,T,V]
        logp = token_logprobs(logits, tokens)  # [B,T]: log p(token t | < t)
        entropy = torch.cat([torch.zeros(B, 1), entropy_from_logits(logits[:, :-1])], 1)
        old_logp = logp.detach()
        mask = staleness_mask(token_versions, version, algo.max_staleness, loss_mask)
        r = torch.tensor(rewards)
        adv = compute_advantages(algo, r, torch.tensor(group_ids), mask)
        loss, m = policy_objective(algo, logp, old_logp, rollout_logp, adv, mask, loss_divisor(algo, mask), entropy=entropy)
        for g in opt.param_groups:
            g.update(lr=algo.lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), algo.grad_clip)
        opt.step()
        snapshots[step] = copy.deepcopy(model).eval()
        snapshots.pop(step - 8, None)
        n = m["tokens"].item()
        curve.append({"step": step, "reward": r.mean().item(), "entropy": m["entropy"].item() / n,
                      "staleness": version - sum(versions) / len(versions) if step > 1 else 0.0})
        if log and step % 50 == 0:
            ma = sum(c["reward"] for c in curve[-10:]) / len(curve[-10:])
            log(f"  step {step}: reward(10) {ma:.3f} entropy {curve[-1]['entropy']:.3f}")
    return curve


def summary(curve: list[dict]) -> dict:
    ma = [sum(c["reward"] for c in curve[max(0, i - 9):i + 1]) / len(curve[max(0, i - 9):i + 1]) for i in range(len(curve))]
    first = lambda t: next((curve[i]["step"] for i, v in enumerate(ma) if v >= t), None)  # noqa: E731
    return {"to_0.7": first(0.7), "to_0.9": first(0.9), "final": ma[-1], "entropy": curve[-1]["entropy"],
            "mean_staleness": sum(c["staleness"] for c in curve) / len(curve)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", choices=["copy", "reverse"], default="reverse")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--steps", type=int, default=RECIPE["train"]["steps"])
    ap.add_argument("--staleness", action="append", help="a configuration: 0, or k:p,k:p,... (repeatable)")
    ap.add_argument("--set", action="append", default=[], help="algo key=value (JSON value), for every configuration")
    ap.add_argument("--model", default=str(ROOT / ".molt/models/tiny"))
    ap.add_argument("--out", help="write every curve as JSON here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    algo_json = dict(RECIPE["algo"])
    for kv in args.set:
        k, v = kv.split("=", 1)
        algo_json[k.removeprefix("algo.")] = json.loads(v)
    algo = AlgoConfig(**algo_json)
    results = []
    for st in args.staleness or ["0", "1:.25,2:.6,3:.15"]:
        for seed in [int(s) for s in args.seeds.split(",")]:
            t0 = time.time()
            curve = run(args.model, args.task == "reverse", seed, args.steps, st, algo, RECIPE["batch"]["groups"],
                        RECIPE["group_size"], log=lambda s: print(s, file=sys.stderr, flush=True))
            s = summary(curve)
            results.append({"staleness": st, "seed": seed, "set": args.set, **s, "curve": curve})
            print(f"{args.task} staleness {st} {' '.join(args.set)} seed {seed}: to 0.7 {s['to_0.7']}, to 0.9 {s['to_0.9']}, "
                  f"final {s['final']:.3f}, entropy {s['entropy']:.3f}, mean staleness {s['mean_staleness']:.2f} "
                  f"({time.time() - t0:.0f} s)", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
