"""Teach the tiny model a task by a few supervised steps and save it as an HF model directory: the teacher of
recipes/distill and the judge of recipes/judge (same architecture and tokenizer, other weights).

    python recipes/distill/make_teacher.py --model .molt/models/tiny --out DIR [--task copy|judge] [--steps 400]
    (recipes/judge: --task judge --steps 2000 --lr 1e-3 on a 1.08M model, see README)

copy:   `copy abd>` -> `abd` (the embedded task, recipes/copy)
judge:  `judge abd=abc>` -> `2`, the number of positions where the answer (left) matches the target (right)
Byte vocabulary: a token id is the byte value (the tiny model's tokenizer, no BOS), so ids are built without it.
"""
import argparse
import random
import shutil
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM


def example(task: str, rng: random.Random, letters: str, any_char: bool = False) -> tuple[str, str]:
    target = "".join(rng.choice(letters) for _ in range(3))
    if task == "copy":
        return f"copy {target}>", target
    # answers with 0..3 matching positions, equally often
    matches = rng.randint(0, 3)
    keep = set(rng.sample(range(3), matches))
    # a mismatch is another of the letters, or (with any_char, half the time) any printable character: a policy
    # early in training answers with arbitrary bytes, and the judge must score those 0 too
    others = letters if not any_char or rng.random() < 0.5 else "".join(chr(i) for i in range(33, 127))
    answer = "".join(c if i in keep else rng.choice([x for x in others if x != c]) for i, c in enumerate(target))
    return f"judge {answer}={target}>", str(matches)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the tiny model directory (architecture, tokenizer, start weights)")
    p.add_argument("--out", required=True)
    p.add_argument("--task", choices=["copy", "judge"], default="copy")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--letters", default="abcd")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    for step in range(args.steps):
        # judge: letters only for the first 60% of the steps, then any character too. Mixed from the start, the
        # model learns "a stray character means a low score" and stops there (accuracy 0.6 after 2000 steps).
        any_char = step >= 0.6 * args.steps
        pairs = [example(args.task, rng, args.letters, any_char) for _ in range(args.batch)]
        ids = torch.tensor([list((q + a).encode()) for q, a in pairs])  # [B, L]: one length per task
        answer = len(pairs[0][1])
        logits = model(input_ids=ids).logits[:, -answer - 1:-1]  # [B, answer, V]: the answer's predictions
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, -answer:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            acc = (logits.argmax(-1) == ids[:, -answer:]).float().mean().item()
            print(f"step {step} loss {loss.item():.4f} accuracy {acc:.3f}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in Path(args.model).iterdir():  # tokenizer and chat template
        if f.is_file() and f.name.startswith(("tokenizer", "generation_config")):
            shutil.copy2(f, out / f.name)


if __name__ == "__main__":
    main()
