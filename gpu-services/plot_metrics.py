"""Curves of a run's metrics.jsonl (one JSON object per step): a PNG of reward, loss, logprob
mismatch and throughput, and the same scalars as TensorBoard event files.

    python gpu-services/plot_metrics.py <metrics.jsonl> <out.png> [--tensorboard DIR]

The PNG carries a text chunk "Series" (JSON: panel -> {metric: points}) naming what it draws.
"""
import argparse
import json
import shutil
import sys

import matplotlib

matplotlib.use("Agg")  # no display
import matplotlib.pyplot as plt  # noqa: E402

# panel title -> metrics drawn in it (those present in the file)
PANELS = {
    "reward": ["rollout/reward_mean", "rollout/pass_rate"],
    "loss": ["pg_loss", "entropy", "kl"],
    "logprob mismatch (engine vs actor)": ["rollout_kl", "rollout_logp_max_abs_diff"],
    "throughput (tokens/s)": ["rollout/tokens_per_s"],
}


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot(rows: list[dict], out: str) -> dict:
    series = {}
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (title, names) in zip(axes.flat, PANELS.items()):
        series[title] = {}
        for name in names:
            points = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float))]
            if not points:
                continue
            steps, values = zip(*points)
            ax.plot(steps, values, label=name, marker="." if len(points) < 30 else None)
            series[title][name] = len(points)
        ax.set_title(title)
        ax.set_xlabel("step")
        if series[title]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, metadata={"Series": json.dumps(series)})
    plt.close(fig)
    return series


def write_tensorboard(rows: list[dict], logdir: str) -> None:
    from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

    shutil.rmtree(logdir, ignore_errors=True)  # rewritten from the JSONL each time: no duplicate points
    writer = SummaryWriter(logdir)
    for r in rows:
        for name, value in r.items():
            if name != "step" and isinstance(value, (int, float)):
                writer.add_scalar(name, value, r["step"])
    writer.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("metrics")
    ap.add_argument("out")
    ap.add_argument("--tensorboard", help="also write TensorBoard event files to this directory")
    args = ap.parse_args()
    rows = read_metrics(args.metrics)
    if not rows:
        sys.exit(f"{args.metrics}: no steps yet")
    series = plot(rows, args.out)
    if args.tensorboard:
        write_tensorboard(rows, args.tensorboard)
    print(json.dumps(series))


if __name__ == "__main__":
    main()
