// `--follow`: polls the run's progress query once a second and draws a live bar until the run ends
// (the caller then reads its result: the summary, or the reason it failed).
import { SingleBar } from 'cli-progress';
import type { WorkflowHandle } from '@temporalio/client';
import { progressQuery, type Progress, type trainRun } from '../workflows/train-run';

export async function follow(handle: WorkflowHandle<typeof trainRun>): Promise<void> {
  const bar = new SingleBar({
    format: 'step {value}/{total} {bar} reward {reward} | {tps} tok/s | groups {inflight} running, {ready} ready '
      + '| ETA {etaText} | {state}',
    hideCursor: true, noTTYOutput: true, notTTYSchedule: 10_000,
  });
  let started = false;
  try {
    for (;;) {
      const { status } = await handle.describe();
      if (status.name !== 'RUNNING') break;
      const p = await handle.query(progressQuery).catch(() => null); // e.g. no worker yet
      if (p) {
        const payload = barPayload(p);
        if (!started) { bar.start(p.totalSteps, p.step, payload); started = true; } else bar.update(p.step, payload);
      }
      await new Promise((r) => setTimeout(r, 1000));
    }
  } finally {
    if (started) bar.stop();
  }
}

function barPayload(p: Progress) {
  // ETA from the run's own pace: elapsed / steps done * steps left.
  const etaSeconds = p.step > 0 ? (p.elapsedSeconds / p.step) * (p.totalSteps - p.step) : null;
  return {
    reward: p.rewardMean === null ? '-' : p.rewardMean.toFixed(3),
    tps: Math.round(p.tokensPerSecond),
    inflight: p.inflight,
    ready: p.ready,
    etaText: etaSeconds === null ? '?' : formatSeconds(etaSeconds),
    state: p.waitingFor ? `waiting for the actor, held by run ${p.waitingFor}` : p.state,
  };
}

export function formatSeconds(s: number): string {
  if (s < 60) return `${Math.round(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.round(s % 60)).padStart(2, '0')}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
}
