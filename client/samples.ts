// `molt-client samples <runId>`: a few decoded episodes of each trained step (prompt, completion,
// reward), from <store>/<runId>/samples.jsonl, to see what the policy is learning, not just a number.
import * as fs from 'node:fs';
import { samplesFile } from '../activities/metrics';
import { RunNotFound } from './errors';
import { storeCandidates } from './plot';

export interface SampleLine { step: number; group: number; episode: number; reward: number; prompt: string; completion: string }

// From the first store that has the run (storeCandidates: --store, $MOLT_STORE, .molt/stack/runs, ./runs).
export function readSamples(runId: string, store?: string): SampleLine[] {
  const files = storeCandidates(store).map((s) => samplesFile(s, runId));
  const file = files.find((f) => fs.existsSync(f));
  if (!file) throw new RunNotFound(`no samples for run ${runId} (looked for ${files.join(', ')})`);
  return fs.readFileSync(file, 'utf8').split('\n').filter((l) => l.trim()).map((l) => JSON.parse(l) as SampleLine);
}

// The samples of the last `steps` steps (or of one step), oldest first, one block per step.
export function formatSamples(lines: SampleLine[], o: { steps?: number; step?: number } = {}): string {
  const steps = [...new Set(lines.map((l) => l.step))].sort((a, b) => a - b);
  const shown = o.step !== undefined ? steps.filter((s) => s === o.step) : steps.slice(-(o.steps ?? 3));
  if (shown.length === 0) return o.step !== undefined ? `no samples of step ${o.step}` : 'no samples yet';
  const show = (text: string) => JSON.stringify(text); // newlines and control characters stay visible
  return shown.map((step) => [
    `step ${step}`,
    ...lines.filter((l) => l.step === step).map((l) =>
      `  group ${l.group} episode ${l.episode}  reward ${l.reward.toFixed(3)}\n    prompt:     ${show(l.prompt)}\n    completion: ${show(l.completion)}`),
  ].join('\n')).join('\n');
}
