"""Weights & Biases logging of one run's per-step metrics, fed by the control worker (activities/metrics.ts).

    python gpu-services/wandb_log.py --run-id ID --dir RUN_DIR --project P [--entity E] [--mode online|offline]

Reads metrics.jsonl lines ({"step": n, "time": iso, ...}) on stdin and logs each with wandb.log(..., step=n); at the
end of input it finishes the wandb run. The wandb run id is the Molt run id with resume="allow", so a new worker
(or a logger restarted after an idle pause) goes on with the same wandb run; a step not above the last one logged
(a retried write) is skipped, as wandb would refuse it. Files go under RUN_DIR/wandb (offline: `wandb sync` them).
"""
import argparse
import json
import sys
from pathlib import Path

import wandb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--project", required=True)
    ap.add_argument("--entity")
    ap.add_argument("--mode", choices=["online", "offline"], default="online")
    args = ap.parse_args()
    config_file = Path(args.dir) / "config.json"
    config = json.loads(config_file.read_text())["config"] if config_file.exists() else {}
    run = wandb.init(id=args.run_id, name=args.run_id, project=args.project, entity=args.entity, mode=args.mode,
                     dir=args.dir, resume="allow", config=config)
    last = run.step - 1 if run.resumed else -1
    for line in sys.stdin:
        if not line.strip():
            continue
        row = json.loads(line)
        step = row.pop("step")
        row.pop("time", None)
        if step > last:
            run.log(row, step=step)
            last = step
    run.finish()


if __name__ == "__main__":
    main()
