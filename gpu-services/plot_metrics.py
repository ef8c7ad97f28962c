"""Curves of a run's metrics.jsonl (one JSON object per step): a PNG with one panel (its own y axis) per
quantity, raw points faint and an exponential moving average over them, like TensorBoard's smoothing
(debiased: s_t = (w * m_{t-1} + (1 - w) * x_t) / (1 - w^t) with m the running mean; --smoothing 0 draws raw).

    python gpu-services/plot_metrics.py <metrics.jsonl> <out.png> [--smoothing 0.6] [--tensorboard DIR]

The PNG carries a text chunk "Series" (JSON: panel -> {metric: points}) naming what it draws. --tensorboard writes
the same scalars as TensorBoard event files (for runs recorded before the worker wrote them live).
"""
import argparse
import json
import math
import shutil
import sys

import matplotlib

matplotlib.use("Agg")  # no display
import matplotlib.pyplot as plt  # noqa: E402

# panel title -> the metric it draws (panels whose metric the file lacks are left out)
PANELS = {
    "reward mean": "rollout/reward_mean",
    "pass rate (reward >= 1)": "rollout/pass_rate",
    "eval greedy reward": "eval/greedy_reward",
    "policy loss": "pg_loss",
    "entropy": "entropy",
    "KL to reference": "kl",
    "grad norm": "grad_norm",
    "logprob gap, same version (max |actor - engine|)": "rollout_logp_max_abs_diff_same_version",
    "logprob gap, all tokens (max |actor - engine|)": "rollout_logp_max_abs_diff",
    "KL engine vs actor": "rollout_kl",
    "staleness (mean versions behind)": "rollout/staleness_mean",
    "throughput (tokens/s)": "rollout/tokens_per_s",
}


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def smooth(values: list[float], weight: float) -> list[float]:
    out, mean = [], 0.0
    for t, x in enumerate(values, 1):
        mean = weight * mean + (1 - weight) * x
        out.append(mean / (1 - weight**t) if weight > 0 else x)
    return out


def plot(rows: list[dict], out: str, smoothing: float = 0.6) -> dict:
    drawn = {}
    for title, name in PANELS.items():
        points = [(r["step"], r[name]) for r in rows if isinstance(r.get(name), (int, float)) and math.isfinite(r[name])]
        if points:
            drawn[title] = (name, points)
    cols = 3
    nrows = max(1, math.ceil(len(drawn) / cols))
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False)
    series = {}
    for ax, (title, (name, points)) in zip(axes.flat, drawn.items()):
        steps, values = zip(*points)
        ax.plot(steps, values, color="C0", alpha=0.25 if smoothing > 0 else 1, marker="." if len(points) < 30 else None)
        if smoothing > 0:
            ax.plot(steps, smooth(list(values), smoothing), color="C0")
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        series[title] = {name: len(points)}
    for ax in list(axes.flat)[len(drawn):]:
        ax.axis("off")
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
    ap.add_argument("--smoothing", type=float, default=0.6, help="moving-average weight in [0, 1); 0 draws raw points")
    ap.add_argument("--tensorboard", help="also write TensorBoard event files to this directory")
    args = ap.parse_args()
    rows = read_metrics(args.metrics)
    if not rows:
        sys.exit(f"{args.metrics}: no steps yet")
    if not 0 <= args.smoothing < 1:
        sys.exit(f"--smoothing {args.smoothing}: must be in [0, 1)")
    series = plot(rows, args.out, args.smoothing)
    if args.tensorboard:
        write_tensorboard(rows, args.tensorboard)
    print(json.dumps(series))


if __name__ == "__main__":
    main()
