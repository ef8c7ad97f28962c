#!/usr/bin/env -S npx tsx
// molt-client: start, follow, inspect and stop training runs (each run is workflow `molt-<runId>`).
import {
  Client, Connection, WorkflowExecutionAlreadyStartedError, WorkflowNotFoundError, WorkflowUpdateFailedError, type WorkflowHandle,
} from '@temporalio/client';
import { loadRecipe, RecipeError, resolveModelDir, type RecipeConfig } from '../agents/recipe';
import { checkpointUpdate, LIVE_SETTINGS, pauseUpdate, resumeUpdate, setUpdate, type ControlState, type Settings } from '../workflows/control';
import { progressQuery, runWorkflowId, trainRun, type Progress, type TrainRunSummary } from '../workflows/train-run';
import { RunNotFound, UsageError } from './errors';
import { evalCheckpoint } from './eval';
import { follow, formatSeconds } from './follow';
import { plotRun } from './plot';
import { scheduleCommand, SCHEDULE_USAGE } from './schedule';
import { hasSearchAttributes, runStartOptions } from './start-options';

const USAGE = `usage: molt-client <command>
  start <recipeDir> [--run-id ID] [--follow] [--dotted.key value ...]   start a run (e.g. --algo.lr 1e-6)
  dev <recipeDir> [--run-id ID] [--follow] [--dotted.key value ...]     local stack + run, until it ends
  status <runId>                                                        progress of a run
  list                                                                  all runs
  cancel <runId>                                                        graceful stop (finish step, checkpoint)
  pause <runId> | resume <runId>                                        hold / release training (rollouts fill one batch)
  set <runId> --algo.lr 1e-4 [--batch.groups 8 ...]                    change live settings from the next step
  checkpoint <runId>                                                    save a checkpoint now (after a step in progress)
  plot <runId> [--store DIR] [--out FILE.png]                           reward, loss, logprob mismatch, throughput curves
  eval <checkpointDir> <recipeDir> [--prompts N] [--samples N]        held-out evaluation of a checkpoint (greedy, pass@1, pass@n)
${SCHEDULE_USAGE}
live settings: ${Object.keys(LIVE_SETTINGS).join(', ')}
environment: MOLT_TEMPORAL_ADDRESS (default localhost:7233), MOLT_TEMPORAL_UI (default http://localhost:8233)`;

interface Temporal { client: Client; connection: Connection; uiUrl: string }

async function connect(address = process.env.MOLT_TEMPORAL_ADDRESS ?? 'localhost:7233', uiUrl = process.env.MOLT_TEMPORAL_UI ?? 'http://localhost:8233'): Promise<Temporal> {
  try {
    const connection = await Connection.connect({ address });
    return { client: new Client({ connection }), connection, uiUrl };
  } catch (err) {
    throw new Error(`cannot reach Temporal at ${address} (set MOLT_TEMPORAL_ADDRESS): ${(err as Error).message}`);
  }
}

// `<recipeDir> --run-id ID --follow --algo.lr 1e-6 --pool.inflight=8`
function parseArgs(argv: string[]) {
  const positional: string[] = [];
  const overrides: Record<string, string> = {};
  let runId: string | undefined;
  let followRun = false;
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (!arg.startsWith('--')) { positional.push(arg); continue; }
    const eq = arg.indexOf('=');
    const key = eq < 0 ? arg.slice(2) : arg.slice(2, eq);
    if (key === 'follow') { followRun = true; continue; }
    const value = eq < 0 ? argv[++i] : arg.slice(eq + 1);
    if (value === undefined) throw new UsageError(`--${key}: missing value`);
    if (key === 'run-id') runId = value; else overrides[key] = value;
  }
  if (runId !== undefined && !/^[A-Za-z0-9][A-Za-z0-9._-]*$/.test(runId)) {
    throw new UsageError(`--run-id: "${runId}" must be letters, digits, '.', '_' or '-' (it names a directory)`);
  }
  return { positional, overrides, runId, followRun };
}

function defaultRunId(config: RecipeConfig): string {
  const stamp = new Date().toISOString().replace(/[-:]/g, '').replace('T', '-').slice(0, 15); // 20260101-120000
  return `${config.name}-${stamp}`;
}

async function startRun(temporal: Temporal, recipeDir: string, config: RecipeConfig, runId: string, followRun: boolean): Promise<TrainRunSummary | null> {
  const workflowId = runWorkflowId(runId);
  let handle: WorkflowHandle<typeof trainRun>;
  try {
    handle = await temporal.client.workflow.start(trainRun, {
      workflowId, ...runStartOptions(recipeDir, config, runId, await hasSearchAttributes(temporal.connection)),
      workflowIdReusePolicy: 'REJECT_DUPLICATE', // a run id names its store directory and its steps at the actor
    });
  } catch (err) {
    if (err instanceof WorkflowExecutionAlreadyStartedError) throw new UsageError(`run ${workflowId} already exists; pick another --run-id`);
    throw err;
  }
  console.log(`run ${runId} started (workflow ${workflowId})`);
  console.log(`Temporal UI: ${temporal.uiUrl}/namespaces/default/workflows/${workflowId}`);
  if (!followRun) return null;
  const summary = await follow(handle);
  if (summary) console.log(describeSummary(summary));
  return summary;
}

function describeSummary(s: TrainRunSummary): string {
  return [
    `run ${s.runId} ${s.stopped ? 'stopped' : 'finished'} after ${s.steps} steps (policy version ${s.version})`,
    `  reward mean (last step): ${s.rewardMean?.toFixed(4) ?? '-'}`,
    `  reward per step: ${rewardCurve(s.rewardHistory)}`,
    `  checkpoint: ${s.checkpoint ?? 'none'}`,
    `  dropped groups: ${s.dropped.stale} stale, ${s.dropped.empty} empty`,
    `  last metrics: ${JSON.stringify(s.lastMetrics)}`,
  ].join('\n');
}

// The reward curve as one line of block characters (0 to 1 mapped onto 8 heights), at most 60
// wide: each character is the mean of its share of the steps. Min and max are printed beside it.
function rewardCurve(history: number[], width = 60): string {
  if (history.length === 0) return '-';
  const buckets = Math.min(width, history.length);
  const means = Array.from({ length: buckets }, (_, b) => {
    const part = history.slice(Math.floor((b * history.length) / buckets), Math.floor(((b + 1) * history.length) / buckets));
    return part.reduce((a, x) => a + x, 0) / part.length;
  });
  const lo = Math.min(...means);
  const hi = Math.max(...means);
  const blocks = '▁▂▃▄▅▆▇█';
  const line = means.map((m) => blocks[hi > lo ? Math.round(((m - lo) / (hi - lo)) * 7) : 0]).join('');
  return `${line}  (${lo.toFixed(3)} .. ${hi.toFixed(3)})`;
}

function describeProgress(p: Progress): string {
  return [
    `  state: ${p.state}, step ${p.step}/${p.totalSteps}, policy version ${p.version}`,
    `  reward mean (last step): ${p.rewardMean?.toFixed(4) ?? '-'}, ${Math.round(p.tokensPerSecond)} tokens/s, elapsed ${formatSeconds(p.elapsedSeconds)}`,
    `  reward per step: ${rewardCurve(p.rewardHistory)}`,
    `  groups: ${p.inflight} running, ${p.ready} ready; dropped ${p.dropped.stale} stale, ${p.dropped.empty} empty`,
    `  ${p.paused ? 'PAUSED; ' : ''}settings: ${describeSettings(p.settings)}`,
    `  last metrics: ${JSON.stringify(p.lastMetrics)}`,
  ].join('\n');
}

const describeSettings = (settings: Record<string, number>) => Object.entries(settings).map(([k, v]) => `${k}=${v}`).join(' ');

// Sends a control update to a running run; a rejected update (validator) is a UsageError.
async function control<R>(runId: string, send: (handle: WorkflowHandle<typeof trainRun>) => Promise<R>): Promise<R> {
  const { handle, description } = await existingRun(await connect(), runId);
  if (description.status.name !== 'RUNNING') throw new RunNotFound(`run ${handle.workflowId} is not running (${description.status.name})`);
  try {
    return await send(handle);
  } catch (err) {
    if (err instanceof WorkflowUpdateFailedError) throw new UsageError(`run ${runId}: ${err.cause?.message ?? err.message}`);
    throw err;
  }
}

function parseSettings(overrides: Record<string, string>): Settings {
  const settings: Record<string, number> = {};
  for (const [key, value] of Object.entries(overrides)) {
    const number = Number(value);
    if (value.trim() === '' || !Number.isFinite(number)) throw new UsageError(`--${key}: "${value}" is not a number`);
    settings[key] = number;
  }
  return settings as Settings;
}

const printControl = (runId: string, s: ControlState) => console.log(`run ${runId}: ${s.paused ? 'paused' : 'training'}; ${describeSettings(s.settings)}`);

// A handle on an existing run, or RunNotFound.
async function existingRun(temporal: Temporal, runId: string) {
  const handle = temporal.client.workflow.getHandle<typeof trainRun>(runWorkflowId(runId));
  try {
    return { handle, description: await handle.describe() };
  } catch (err) {
    if (err instanceof WorkflowNotFoundError) throw new RunNotFound(`no run ${handle.workflowId}`);
    throw err;
  }
}

// The progress query needs a worker; without one it would wait, so it gets a few seconds.
function queryProgress(temporal: Temporal, handle: WorkflowHandle<typeof trainRun>): Promise<Progress | null> {
  return temporal.connection.withDeadline(Date.now() + 5000, () => handle.query(progressQuery)).catch(() => null);
}

async function main(argv: string[]): Promise<void> {
  const [command, ...rest] = argv;
  const args = parseArgs(rest);
  switch (command) {
    case 'start':
    case 'dev': {
      const [recipeDir] = args.positional;
      if (!recipeDir) throw new UsageError(`${command}: missing <recipeDir>\n${USAGE}`);
      const config = loadRecipe(recipeDir, args.overrides);
      const runId = args.runId ?? defaultRunId(config);
      console.log(`recipe config:\n${JSON.stringify(config, null, 2)}`);
      if (command === 'start') {
        await startRun(await connect(), recipeDir, config, runId, args.followRun);
        return;
      }
      // dev: a local stack (Temporal dev server + UI, engines, actor, worker) for this one run.
      const { startStack } = await import('../infra/stack');
      const stack = await startStack({ modelDir: resolveModelDir(config.model), engines: config.engines.count, actorWorldSize: config.actor.world_size });
      process.once('SIGINT', () => {
        console.error('\nstopping the stack (the run stays in the stack\'s Temporal database)');
        stack.stop().finally(() => process.exit(130));
      });
      try {
        const uiUrl = stack.uiUrl ?? 'http://localhost:8233';
        await startRun(await connect(stack.temporalAddress, uiUrl), recipeDir, config, runId, true);
      } finally {
        await stack.stop();
      }
      return;
    }
    case 'status': {
      const [runId] = args.positional;
      if (!runId) throw new UsageError(`status: missing <runId>\n${USAGE}`);
      const temporal = await connect();
      const { handle, description } = await existingRun(temporal, runId);
      console.log(`run ${runId}: ${description.status.name}, started ${description.startTime.toISOString()}`);
      if (description.status.name === 'COMPLETED') {
        console.log(describeSummary(await handle.result()));
      } else if (description.status.name === 'RUNNING') {
        const progress = await queryProgress(temporal, handle);
        console.log(progress ? describeProgress(progress) : '  progress unavailable (is a molt-control worker running?)');
      }
      return;
    }
    case 'list': {
      const temporal = await connect();
      let count = 0;
      for await (const run of temporal.client.workflow.list({ query: `WorkflowType = 'trainRun'` })) {
        if (run.status.name === 'CONTINUED_AS_NEW') continue; // earlier links of a chain; the latest is listed
        count++;
        let line = `${run.workflowId.replace(/^molt-/, '')}\t${run.status.name}\tstarted ${run.startTime.toISOString()}`;
        if (run.status.name === 'RUNNING') {
          const p = await queryProgress(temporal, temporal.client.workflow.getHandle<typeof trainRun>(run.workflowId));
          if (p) line += `\tstep ${p.step}/${p.totalSteps}\treward ${p.rewardMean?.toFixed(3) ?? '-'}`;
        }
        console.log(line);
      }
      if (count === 0) console.log('no runs');
      return;
    }
    case 'cancel': {
      const [runId] = args.positional;
      if (!runId) throw new UsageError(`cancel: missing <runId>\n${USAGE}`);
      const { handle, description } = await existingRun(await connect(), runId);
      if (description.status.name !== 'RUNNING') throw new RunNotFound(`run ${handle.workflowId} is not running (${description.status.name})`);
      await handle.cancel();
      console.log(`stop requested for run ${runId}: it finishes its current step, checkpoints and stops`);
      return;
    }
    case 'pause':
    case 'resume':
    case 'set':
    case 'checkpoint': {
      const [runId] = args.positional;
      if (!runId) throw new UsageError(`${command}: missing <runId>\n${USAGE}`);
      if (command === 'checkpoint') {
        const saved = await control(runId, (h) => h.executeUpdate(checkpointUpdate));
        console.log(`run ${runId}: checkpoint of step ${saved.step} at ${saved.path}`);
        return;
      }
      if (command === 'set' && Object.keys(args.overrides).length === 0) throw new UsageError(`set: nothing to set, e.g. --algo.lr 1e-4\n${USAGE}`);
      const update = command === 'pause' ? pauseUpdate : command === 'resume' ? resumeUpdate : null;
      const state = await control(runId, (h) => (update ? h.executeUpdate(update) : h.executeUpdate(setUpdate, { args: [parseSettings(args.overrides)] })));
      printControl(runId, state);
      return;
    }
    case 'plot': {
      const [runId] = args.positional;
      if (!runId) throw new UsageError(`plot: missing <runId>\n${USAGE}`);
      const { png, tensorboard } = await plotRun(runId, args.overrides.store, args.overrides.out);
      console.log(`wrote ${png}\nTensorBoard events in ${tensorboard}`);
      return;
    }
    case 'eval': {
      const [checkpointDir, recipeDir] = args.positional;
      if (!checkpointDir || !recipeDir) throw new UsageError(`eval: missing <checkpointDir> <recipeDir>\n${USAGE}`);
      const r = await evalCheckpoint(checkpointDir, recipeDir, args.overrides);
      console.log(`${checkpointDir}: ${r.prompts} held-out prompts, ${r.samples} samples each`);
      console.log(`  greedy reward ${r.greedy_reward?.toFixed(4) ?? '-'}, sample reward mean ${r.sample_reward_mean.toFixed(4)}`);
      console.log(`  pass@1 ${r['pass@1'].toFixed(4)}, pass@${r.samples} ${r['pass@n'].toFixed(4)} (a sample passes when its reward >= 1), ${r.failed} episodes failed`);
      return;
    }
    case 'schedule':
      await scheduleCommand(await connect(), args);
      return;
    default:
      throw new UsageError(command ? `unknown command "${command}"\n${USAGE}` : USAGE);
  }
}

main(process.argv.slice(2)).then(
  () => process.exit(0),
  (err) => {
    console.error(err instanceof Error ? err.message : String(err));
    process.exit(err instanceof RecipeError || err instanceof UsageError ? 2 : 1);
  },
);
