// `molt-client plot <runId>`: PNG curves of a run's metrics.jsonl, drawn by matplotlib in the venv
// (gpu-services/plot_metrics.py): one panel per quantity, smoothed. The worker writes TensorBoard
// events live (<run>/tensorboard, `tensorboard --logdir <store>` shows all runs); for a run recorded
// before it did, plot writes them from metrics.jsonl. The store is --store, else $MOLT_STORE, else
// the local stack's (.molt/stack/runs), else ./runs: the first that has the run.
import { execFile } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { metricsFile } from '../activities/metrics';
import { eventFile } from '../activities/tensorboard';
import { REPO_ROOT } from '../agents/recipe';
import { RunNotFound } from './errors';

// Where to look for a run's folder, in order (also `molt-client gc`).
export function storeCandidates(store?: string): string[] {
  return (store ? [store] : [process.env.MOLT_STORE, path.join(REPO_ROOT, '.molt', 'stack', 'runs'), 'runs'])
    .filter((s): s is string => !!s).map((s) => path.resolve(s));
}

export async function plotRun(
  runId: string, store?: string, out?: string, smoothing = 0.6,
): Promise<{ png: string; tensorboard: string }> {
  const files = storeCandidates(store).map((s) => metricsFile(s, runId));
  const file = files.find((f) => fs.existsSync(f));
  if (!file) throw new RunNotFound(`no metrics for run ${runId} (looked for ${files.join(', ')})`);
  const png = path.resolve(out ?? path.join(path.dirname(file), 'metrics.png'));
  const live = eventFile(path.dirname(file));
  const tensorboard = path.dirname(live);
  const args = [path.join(REPO_ROOT, 'gpu-services', 'plot_metrics.py'), file, png, '--smoothing', String(smoothing),
    ...(fs.existsSync(live) ? [] : ['--tensorboard', tensorboard])];
  await new Promise<void>((resolve, reject) => {
    execFile(path.join(REPO_ROOT, '.venv', 'bin', 'python'), args,
      (err, _stdout, stderr) => (err ? reject(new Error(`plot: ${stderr.trim() || err.message}`)) : resolve()));
  });
  return { png, tensorboard };
}
