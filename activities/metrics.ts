// metrics.jsonl: one JSON line per step, {"step": n, "time": iso, ...metrics}, appended under
// <storeRoot>/<runId>/. A retried write of a step already there writes nothing, and a line torn by
// a crash mid-append is cut off before the next one, so every step has exactly one whole line.
// The line is the record; after it, the same figures go where users look, as the run goes:
// TensorBoard events (<run>/tensorboard, activities/tensorboard.ts) and, if the recipe asks,
// Weights & Biases. A worker lost between the line and those misses that step there, nothing else.
import { spawn, type ChildProcess } from 'node:child_process';
import { promises as fs } from 'node:fs';
import * as path from 'node:path';
import { REPO_ROOT, type RecipeConfig } from '../agents/recipe';
import { writeError } from './store';
import { appendScalars } from './tensorboard';
import type { EpisodeSample, ServiceEndpoints } from './types';

export interface RecordMetricsInput {
  runId: string; step: number; metrics: Record<string, number>;
  samples?: (EpisodeSample & { group: number })[]; // a few episodes of the step's batch, decoded
  wandb?: RecipeConfig['wandb']; // log to Weights & Biases too
  last?: boolean; // the run's last step: its wandb run is finished
}

export function metricsFile(storeRoot: string, runId: string): string {
  return path.join(storeRoot, runId, 'metrics.jsonl');
}

export function samplesFile(storeRoot: string, runId: string): string {
  return path.join(storeRoot, runId, 'samples.jsonl');
}

const TAIL_BYTES = 1 << 16; // more than one line

export async function recordMetrics(endpoints: ServiceEndpoints, input: RecordMetricsInput): Promise<{ written: boolean }> {
  const file = metricsFile(endpoints.storeRoot, input.runId);
  try {
    await fs.mkdir(path.dirname(file), { recursive: true });
    const handle = await fs.open(file, 'a+');
    try {
      const { size } = await handle.stat();
      const start = Math.max(0, size - TAIL_BYTES);
      const tail = Buffer.alloc(size - start);
      await handle.read(tail, 0, tail.length, start);
      const text = tail.toString('utf8');
      const whole = text.lastIndexOf('\n') + 1; // bytes after this belong to a torn line (a crash, a full disk)
      if (whole < text.length) await handle.truncate(start + Buffer.byteLength(text.slice(0, whole)));
      const lastLine = text.slice(0, whole).trimEnd().split('\n').pop();
      const lastStep = lastLine ? (JSON.parse(lastLine) as { step: number }).step : 0;
      if (lastStep >= input.step) return { written: false }; // a retry: this step is already there
      const line = JSON.stringify({ step: input.step, time: new Date().toISOString(), ...input.metrics });
      await handle.appendFile(`${line}\n`);
      await handle.sync();
      await appendScalars(path.dirname(file), input.step, input.metrics);
      if (input.wandb) wandbLog(path.dirname(file), input, line);
      // Samples are for reading: written after the step's metrics line, so a retry never doubles them
      // (a crash in between loses that step's samples, nothing else).
      const lines = (input.samples ?? []).map((s) => JSON.stringify({ step: input.step, ...s })).join('\n');
      if (lines) await fs.appendFile(samplesFile(endpoints.storeRoot, input.runId), `${lines}\n`);
      return { written: true };
    } finally {
      await handle.close();
    }
  } catch (e) {
    throw writeError(e, file);
  }
}

// Weights & Biases: one Python logger per run in this worker (gpu-services/wandb_log.py, the venv's
// wandb), fed the metrics lines on stdin. It is closed (the wandb run finished) after the last step,
// or after WANDB_IDLE_MS without a step (a paused or cancelled run; a later step opens it again, and
// wandb resumes the same run id). Logging is best effort: a logger that fails is reported in the
// worker's log and never fails the step.
const WANDB_IDLE_MS = 10 * 60_000;
const wandbLoggers = new Map<string, { child: ChildProcess; idle?: NodeJS.Timeout; exited: Promise<void> }>();

function wandbLog(runDir: string, input: RecordMetricsInput, line: string): void {
  const settings = input.wandb!;
  let logger = wandbLoggers.get(input.runId);
  if (!logger) {
    const args = [path.join(REPO_ROOT, 'gpu-services', 'wandb_log.py'), '--run-id', input.runId, '--dir', runDir,
      '--project', settings.project, '--mode', settings.mode, ...(settings.entity ? ['--entity', settings.entity] : [])];
    const child = spawn(path.join(REPO_ROOT, '.venv', 'bin', 'python'), args,
      { stdio: ['pipe', 'ignore', 'inherit'], env: { WANDB_SILENT: 'true', ...process.env } });
    const exited = new Promise<void>((resolve) => child.once('close', (code) => {
      if (code) console.error(`wandb logger of run ${input.runId} exited with code ${code}`);
      wandbLoggers.delete(input.runId);
      resolve();
    }));
    child.once('error', (e) => console.error(`wandb logger of run ${input.runId}: ${e.message}`));
    child.stdin!.on('error', () => undefined); // a logger that died: its exit is reported above
    logger = { child, exited };
    wandbLoggers.set(input.runId, logger);
  }
  clearTimeout(logger.idle);
  logger.child.stdin!.write(`${line}\n`);
  if (input.last) closeWandb(input.runId);
  else logger.idle = setTimeout(() => closeWandb(input.runId), WANDB_IDLE_MS).unref();
}

// Ends a run's logger (the wandb run is finished); resolves once it has exited.
export function closeWandb(runId: string): Promise<void> {
  const logger = wandbLoggers.get(runId);
  if (!logger) return Promise.resolve();
  clearTimeout(logger.idle);
  logger.child.stdin!.end();
  return logger.exited;
}

export async function readMetrics(storeRoot: string, runId: string): Promise<Record<string, number>[]> {
  const text = await fs.readFile(metricsFile(storeRoot, runId), 'utf8');
  return text.split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l));
}
