// metrics.jsonl: one JSON line per step, {"step": n, "time": iso, ...metrics}, appended under
// <storeRoot>/<runId>/. A retried write of a step already there writes nothing, and a line torn by
// a crash mid-append is cut off before the next one, so every step has exactly one whole line.
import { promises as fs } from 'node:fs';
import * as path from 'node:path';
import { writeError } from './store';
import type { EpisodeSample, ServiceEndpoints } from './types';

export interface RecordMetricsInput {
  runId: string; step: number; metrics: Record<string, number>;
  samples?: (EpisodeSample & { group: number })[]; // a few episodes of the step's batch, decoded
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
      await handle.appendFile(`${JSON.stringify({ step: input.step, time: new Date().toISOString(), ...input.metrics })}\n`);
      await handle.sync();
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

export async function readMetrics(storeRoot: string, runId: string): Promise<Record<string, number>[]> {
  const text = await fs.readFile(metricsFile(storeRoot, runId), 'utf8');
  return text.split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l));
}
