"""Curves of bench/learning.ts: reward vs step and vs wall time, one panel pair per task, each loop
variant in its own colour (thin: each seed; thick: the mean over seeds, 10-step moving average).

    python bench/plot_learning.py report.json curves.png
"""
import json
import sys

import matplotlib

matplotlib.use("Agg")  # no display
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

COLORS = {"sync": "tab:blue", "async": "tab:orange", "async-slow": "tab:red"}


def smooth(xs, n=10):
    xs = np.asarray(xs, dtype=float)
    return np.array([xs[max(0, i - n + 1):i + 1].mean() for i in range(len(xs))])


def main(report_path: str, out: str) -> None:
    curves = json.load(open(report_path))["curves"]
    tasks = sorted({c["task"] for c in curves})
    fig, axes = plt.subplots(len(tasks), 2, figsize=(12, 4 * len(tasks)), squeeze=False)
    for row, task in enumerate(tasks):
        for variant, color in COLORS.items():
            runs = [c for c in curves if c["task"] == task and c["variant"] == variant]
            if not runs:
                continue
            for c in runs:
                axes[row][0].plot(c["step"], smooth(c["reward"]), color=color, alpha=0.35, lw=1)
                axes[row][1].plot(c["time"], smooth(c["reward"]), color=color, alpha=0.35, lw=1)
            n = min(len(c["step"]) for c in runs)
            mean = np.mean([smooth(c["reward"])[:n] for c in runs], axis=0)
            axes[row][0].plot(runs[0]["step"][:n], mean, color=color, lw=2.5, label=f"{variant} ({len(runs)} seeds)")
        for col, xlabel in enumerate(["step", "seconds"]):
            ax = axes[row][col]
            ax.set_title(f"{task}: reward vs {xlabel}")
            ax.set_xlabel(xlabel)
            ax.set_ylabel("batch reward (10-step moving average)")
            ax.set_ylim(0, 1)
            ax.axhline(0.9, color="grey", ls=":", lw=1)
            ax.grid(alpha=0.3)
        axes[row][0].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=90)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
