// The SFT warm start (`molt-client sft <recipe>`): supervised steps on the recipe's demonstrations, on the
// same actor as RL. Each step is one `sftStep` activity (the demonstrations are tokenized there and kept in
// the step's manifest, so a restarted actor replays them); a checkpoint every `sft.checkpoint_every` steps
// and at the end. The last checkpoint is the run's output: an `init` for RL (`molt-client start --init`).
// Durable state is the step, the loss curve and the latest checkpoint; a crashed worker's activity is
// retried and applied once (the actor's step log), a long run continues as new. Each step's metrics go to
// <store>/<runId>/metrics.jsonl and TensorBoard, as an RL run's do.
import { condition, continueAsNew, defineQuery, proxyActivities, setHandler, workflowInfo } from '@temporalio/workflow';
import type { Activities } from '../activities';
import type { RecipeConfig } from '../agents/recipe';
import { ACTOR_ACTIVITY_OPTIONS, CONTROL_WRITE_OPTIONS } from './train-run';

export const sftProgressQuery = defineQuery<SftProgress>('sftProgress');

export interface SftProgress {
  step: number;
  totalSteps: number;
  loss: number | null; // of the last step: mean cross-entropy per assistant token
  losses: number[]; // one per step
  tokensPerSecond: number; // assistant tokens trained / elapsed time
  elapsedSeconds: number;
  checkpoint: { step: number; path: string } | null;
  waitingFor: string | null; // the run holding the actor
  lastMetrics: Record<string, number>;
}
type Carried = Omit<SftProgress, 'totalSteps' | 'tokensPerSecond' | 'elapsedSeconds' | 'waitingFor'>
  & { tokens: number; startedAt: number };
export interface SftRunInput { runId: string; recipeDir: string; config: RecipeConfig; carried?: Carried }

const { sftStep, checkpoint, claimActor } = proxyActivities<Activities>(ACTOR_ACTIVITY_OPTIONS);
// <store>/<runId>/metrics.jsonl and TensorBoard, one line per step (the loss curve), as trainRun writes them.
const { recordMetrics } = proxyActivities<Activities>(CONTROL_WRITE_OPTIONS);

export async function sftRun(input: SftRunInput): Promise<SftProgress> {
  const { runId, recipeDir, config } = input;
  const sft = config.sft;
  if (!sft) throw new Error(`recipe ${config.name} has no sft section`);
  const run: Carried = input.carried ?? { step: 0, loss: null, losses: [], checkpoint: null, lastMetrics: {}, tokens: 0, startedAt: Date.now() };
  let waitingFor: string | null = null;
  const progress = (): SftProgress => {
    const elapsedSeconds = (Date.now() - run.startedAt) / 1000;
    const { tokens: _t, startedAt: _s, ...rest } = run;
    return { ...rest, totalSteps: sft.steps, elapsedSeconds, tokensPerSecond: elapsedSeconds > 0 ? run.tokens / elapsedSeconds : 0, waitingFor };
  };
  setHandler(sftProgressQuery, progress);

  if (input.carried === undefined) { // the actor serves one run at a time: wait for it (as trainRun does)
    for (let poll = 10; ; poll = Math.min(60, poll * 2)) {
      const { heldBy } = await claimActor({ runId, step: 0, init: config.init });
      if (heldBy === null) break;
      waitingFor = heldBy;
      await condition(() => false, poll * 1000);
    }
    waitingFor = null;
  }
  const every = sft.checkpoint_every ?? config.checkpoint.every;
  while (run.step < sft.steps) {
    const step = run.step + 1;
    const res = await sftStep({ runId, step, recipeDir, config });
    Object.assign(run, { step, loss: res.metrics.loss, lastMetrics: res.metrics, tokens: run.tokens + res.metrics['tokens/trained'] });
    run.losses.push(res.metrics.loss);
    await recordMetrics({ runId, step, metrics: res.metrics });
    if (step % every === 0 || step === sft.steps) {
      const saved = await checkpoint({ runId, step });
      run.checkpoint = { step, path: saved.path };
    }
    if (workflowInfo().continueAsNewSuggested && run.step < sft.steps) {
      await continueAsNew<typeof sftRun>({ ...input, carried: run });
    }
  }
  return progress();
}
