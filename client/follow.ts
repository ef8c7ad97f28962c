// `--follow`: polls the run's progress query once a second and draws a live bar until the run ends
// (the caller then reads its result: the summary, or the reason it failed).
import { SingleBar } from 'cli-progress';
import type { WorkflowHandle } from '@temporalio/client';
import { sftProgressQuery, type SftProgress, type sftRun } from '../workflows/sft-run';
import { progressQuery, type Progress, type trainRun } from '../workflows/train-run';

export function follow(handle: WorkflowHandle<typeof trainRun>): Promise<void> {
  return followBar(handle, () => handle.query(progressQuery), (p: Progress) => ({
    reward: p.rewardMean === null ? '-' : p.rewardMean.toFixed(3), inflight: p.inflight, ready: p.ready,
    ...pace(p, p.state),
  }), 'step {value}/{total} {bar} reward {reward} | {tps} tok/s | groups {inflight} running, {ready} ready '
      + '| ETA {etaText} | {state}');
}

// The SFT warm start's line: step, loss of the last step, assistant tokens/s, ETA.
export function followSft(handle: WorkflowHandle<typeof sftRun>): Promise<void> {
  return followBar(handle, () => handle.query(sftProgressQuery), (p: SftProgress) => ({
    loss: p.loss === null ? '-' : p.loss.toFixed(4), ...pace(p, 'running'),
  }), 'sft step {value}/{total} {bar} loss {loss} | {tps} tok/s | ETA {etaText} | {state}');
}

// What both lines show: tokens/s, the ETA from the run's own pace (elapsed / steps done * steps left), and
// the state, unless the run waits for the actor.
function pace(p: Progress | SftProgress, state: string) {
  return {
    tps: Math.round(p.tokensPerSecond),
    etaText: p.step > 0 ? formatSeconds((p.elapsedSeconds / p.step) * (p.totalSteps - p.step)) : '?',
    state: p.waitingFor ? `waiting for the actor, held by run ${p.waitingFor}` : state,
  };
}

async function followBar<P extends { step: number; totalSteps: number }>(handle: WorkflowHandle, query: () => Promise<P>,
  payload: (p: P) => Record<string, unknown>, format: string): Promise<void> {
  const bar = new SingleBar({ format, hideCursor: true, noTTYOutput: true, notTTYSchedule: 10_000 });
  let started = false;
  try {
    for (;;) {
      const { status } = await handle.describe();
      if (status.name !== 'RUNNING') break;
      const p = await query().catch(() => null); // e.g. no worker yet
      if (p) {
        if (started) bar.update(p.step, payload(p));
        else { bar.start(p.totalSteps, p.step, payload(p)); started = true; }
      }
      await new Promise((r) => setTimeout(r, 1000));
    }
  } finally {
    if (started) bar.stop();
  }
}

export function formatSeconds(s: number): string {
  if (s < 60) return `${Math.round(s)}s`;
  if (s < 3600) return `${Math.floor(s / 60)}m${String(Math.round(s % 60)).padStart(2, '0')}s`;
  return `${Math.floor(s / 3600)}h${String(Math.floor((s % 3600) / 60)).padStart(2, '0')}m`;
}
