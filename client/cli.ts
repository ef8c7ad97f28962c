#!/usr/bin/env -S npx tsx
// molt-client: start, follow, inspect and stop training runs (each run is workflow `molt-<runId>`).
// Parsing is commander's; a command is one `program.command(...)` block below (or a function of
// `program` in its own file, like schedule). Exit codes: 0 done, 1 a run failed or was not found,
// 2 bad input (usage, recipe config, agent module, a rejected value).
import * as fs from 'node:fs';
import * as path from 'node:path';
import {
  WorkflowExecutionAlreadyStartedError, WorkflowFailedError, WorkflowNotFoundError, WorkflowUpdateFailedError,
  type WorkflowHandle,
} from '@temporalio/client';
import { Command, CommanderError } from 'commander';
import { loadAgentRunner } from '../agents/contract';
import { loadRecipe, RecipeError, type RecipeConfig } from '../agents/recipe';
import {
  addEngineUpdate, checkEngineUrl, checkpointUpdate, drainEngineUpdate, enginesQuery, pauseUpdate, resumeUpdate, setUpdate,
  validateSettings, type ControlState, type Settings,
} from '../workflows/control';
import { sftRun } from '../workflows/sft-run';
import {
  progressQuery, runWorkflowId, TASK_QUEUES, trainRun, type Progress, type TrainRunSummary,
} from '../workflows/train-run';
import { connect, liveSettingsHelp, recipeKeysHelp, takeRecipeOverrides, type Temporal } from './command';
import { RunNotFound, UsageError } from './errors';
import { evalCheckpoint } from './eval';
import { follow, followSft, formatSeconds } from './follow';
import { gcRun, type Live } from './gc';
import { plotRun, storeCandidates } from './plot';
import { formatSamples, readSamples } from './samples';
import { addScheduleCommands } from './schedule';
import { addStackCommands, withDevStack } from './stack-commands';
import { hasSearchAttributes, runStartOptions } from './start-options';

function defaultRunId(config: RecipeConfig): string {
  const stamp = new Date().toISOString().replace(/[-:]/g, '').replace('T', '-').slice(0, 15); // 20260101-120000
  return `${config.name}-${stamp}`;
}

interface StartOptions { runId?: string; follow?: boolean; verbose?: boolean; printConfig?: boolean; dryRun?: boolean }

// The recipe with its overrides, and its agent module loaded and checked here, so that a bad
// path or a module without a valid AgentRunner is an error now, not a run that never trains.
async function resolveRecipe(recipeDir: string, overrides: Record<string, string>): Promise<RecipeConfig> {
  const config = loadRecipe(recipeDir, overrides);
  try {
    await loadAgentRunner(path.resolve(recipeDir, config.agent));
  } catch (err) {
    throw new RecipeError(`recipe ${recipeDir}: ${(err as Error).message}`);
  }
  return config;
}

async function startRun(temporal: Temporal, recipeDir: string, config: RecipeConfig, runId: string, followRun: boolean) {
  const workflowId = runWorkflowId(runId);
  let handle: WorkflowHandle<typeof trainRun>;
  try {
    handle = await temporal.client.workflow.start(trainRun, {
      workflowId, ...runStartOptions(recipeDir, config, runId, await hasSearchAttributes(temporal.connection, temporal.client.options.namespace)),
      workflowIdReusePolicy: 'REJECT_DUPLICATE', // a run id names its store directory and its steps at the actor
    });
  } catch (err) {
    if (err instanceof WorkflowExecutionAlreadyStartedError) {
      throw new UsageError(`run ${workflowId} already exists; pick another --run-id`);
    }
    throw err;
  }
  console.log(`run ${runId} started (workflow ${workflowId})`);
  console.log(`Temporal UI: ${temporal.uiUrl}/namespaces/${temporal.client.options.namespace}/workflows/${workflowId}`);
  if (!followRun) return;
  await follow(handle);
  console.log(describeSummary(await runResult(handle)));
}

// The run's summary, or an error with the reason it failed, was terminated or timed out.
async function runResult(handle: WorkflowHandle<typeof trainRun>): Promise<TrainRunSummary> {
  try {
    return await handle.result();
  } catch (err) {
    if (!(err instanceof WorkflowFailedError)) throw err;
    const { status } = await handle.describe();
    throw new Error(`run ${handle.workflowId} ended: ${status.name}: ${err.cause?.message ?? err.message}`);
  }
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

// The reward curve as one line of block characters, at most 60 wide: each character is the mean of
// its share of the steps. The scale is fixed at [0, 1] (rewards of most recipes), widened only to
// take rewards outside it, and printed: a flat curve must look flat, not be stretched min to max.
function rewardCurve(history: number[], width = 60): string {
  if (history.length === 0) return '-';
  const buckets = Math.min(width, history.length);
  const means = Array.from({ length: buckets }, (_, b) => {
    const from = Math.floor((b * history.length) / buckets);
    const part = history.slice(from, Math.floor(((b + 1) * history.length) / buckets));
    return part.reduce((a, x) => a + x, 0) / part.length;
  });
  const lo = Math.min(0, ...means);
  const hi = Math.max(1, ...means);
  const blocks = '▁▂▃▄▅▆▇█';
  const line = means.map((m) => blocks[Math.round(((m - lo) / (hi - lo)) * 7)]).join('');
  return `${line}  (scale ${lo} .. ${hi}; min ${Math.min(...means).toFixed(3)}, max ${Math.max(...means).toFixed(3)})`;
}

function describeProgress(p: Progress): string {
  return [
    `  state: ${p.state}, step ${p.step}/${p.totalSteps}, policy version ${p.version}`,
    `  reward mean (last step): ${p.rewardMean?.toFixed(4) ?? '-'}, ${Math.round(p.tokensPerSecond)} tokens/s, ` +
      `elapsed ${formatSeconds(p.elapsedSeconds)}`,
    `  reward per step: ${rewardCurve(p.rewardHistory)}`,
    `  groups: ${p.inflight} running, ${p.ready} ready; dropped ${p.dropped.stale} stale, ${p.dropped.empty} empty`,
    `  ${p.paused ? 'PAUSED; ' : ''}settings: ${describeSettings(p.settings)}`,
    ...Object.entries(p.pools ?? {}).map(([name, pool]) => `  pool ${name}: ${pool.model} x${pool.count} (${pool.backend}), `
      + `${p.lastMetrics[`pool/${name}/calls`] ?? 0} calls in the last step`),
    `  last metrics: ${JSON.stringify(p.lastMetrics)}`,
  ].join('\n');
}

const describeSettings = (settings: Record<string, number>) =>
  Object.entries(settings).map(([k, v]) => `${k}=${v}`).join(' ');

// Sends a control update to a running run; a rejected update (validator) is a UsageError.
async function control<R>(runId: string, send: (handle: WorkflowHandle<typeof trainRun>) => Promise<R>): Promise<R> {
  const { handle, description } = await existingRun(await connect(), runId);
  if (description.status.name !== 'RUNNING') {
    throw new RunNotFound(`run ${handle.workflowId} is not running (${description.status.name})`);
  }
  try {
    return await send(handle);
  } catch (err) {
    if (err instanceof WorkflowUpdateFailedError) {
      throw new UsageError(`run ${runId}: ${err.cause?.message ?? err.message}`);
    }
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

const printControl = (runId: string, s: ControlState) =>
  console.log(`run ${runId}: ${s.paused ? 'paused' : 'training'}; ${describeSettings(s.settings)}`);

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

const RUN_ID = /^[A-Za-z0-9][A-Za-z0-9._-]*$/;
function checkRunId(runId: string | undefined): void {
  if (runId !== undefined && !RUN_ID.test(runId)) {
    throw new UsageError(`--run-id: "${runId}" must be letters, digits, '.', '_' or '-' (it names a directory)`);
  }
}

// Recipe overrides (`--algo.lr 1e-4`) of the commands marked withOverrides, taken out of argv
// before parsing, read by the actions. To any other command they are unknown options.
const overrides: Record<string, string> = {};
const takesOverrides = new Set<Command>();
const withOverrides = (command: Command) => { takesOverrides.add(command); return command; };

const program = new Command('molt-client')
  .description('Train LLM agents with RL on Temporal: start, follow, inspect and steer runs.')
  .addHelpText('after', `
Environment: Temporal's own (TEMPORAL_ADDRESS, default localhost:7233; TEMPORAL_NAMESPACE; TEMPORAL_API_KEY;
TEMPORAL_TLS_*; TOML profiles in TEMPORAL_CONFIG_FILE, TEMPORAL_PROFILE), MOLT_TEMPORAL_UI (default http://localhost:8233).
Run \`molt-client <command> --help\` for a command's options; \`start --help\` lists every recipe key.`)
  .showHelpAfterError('(run with --help for usage)')
  .exitOverride(); // inherited by the commands below: parse errors reach main, which exits 2

for (const name of ['start', 'dev'] as const) {
  withOverrides(program.command(name))
    .description(name === 'start'
      ? 'start a run of a recipe on the Temporal server (TEMPORAL_ADDRESS or a profile)'
      : 'start a local stack (Temporal dev server + UI, engines, actor, workers), run the recipe to its end, '
        + 'stop the stack')
    .argument('<recipeDir>', 'folder with recipe.json and its agent module')
    .option('--run-id <id>', 'name of the run (default <recipe name>-<date>-<time>); it names the store directory')
    .option('--follow', name === 'start' ? 'draw a live progress bar until the run ends' : 'always on for dev')
    .option('--print-config', 'print the resolved recipe config as JSON and start nothing')
    .option('--dry-run', 'check the recipe and its agent module, print what would start, start nothing')
    .option('-v, --verbose', 'print the resolved recipe config before starting')
    .addHelpText('after', () => `\n${recipeKeysHelp()}`)
    .action(async (recipeDir: string, opts: StartOptions) => {
      checkRunId(opts.runId);
      if (opts.printConfig) {
        console.log(JSON.stringify(loadRecipe(recipeDir, overrides), null, 2));
        return;
      }
      const config = await resolveRecipe(recipeDir, overrides);
      const runId = opts.runId ?? defaultRunId(config);
      if (opts.verbose || opts.dryRun) console.log(`recipe config:\n${JSON.stringify(config, null, 2)}`);
      if (opts.dryRun) {
        console.log(`dry run: run ${runId} of ${path.resolve(recipeDir)} (agent ${config.agent} loads); nothing started`);
        return;
      }
      if (name === 'start') return startRun(await connect(), recipeDir, config, runId, !!opts.follow);
      // dev: a local stack (Temporal dev server + UI, engines, actor, worker) for this one run.
      await withDevStack(config, (temporal) => startRun(temporal, recipeDir, config, runId, true));
    });
}

// `sft`: the SFT warm start on the recipe's demonstrations (workflows/sft-run.ts), followed to its end; its last
// checkpoint is printed, to start RL from (`start --init <dir>`).
withOverrides(program.command('sft'))
  .description('SFT warm start on the recipe\'s demonstrations (recipe key sft); prints the checkpoint to start RL from')
  .argument('<recipeDir>', 'folder with recipe.json (with an sft section) and its agent module')
  .option('--run-id <id>', 'name of the run (default <recipe name>-sft-<date>-<time>)')
  .option('--dev', 'on a local stack started for this run (as `dev`)')
  .action(async (recipeDir: string, opts: { runId?: string; dev?: boolean }) => {
    checkRunId(opts.runId);
    const config = await resolveRecipe(recipeDir, overrides);
    if (!config.sft) throw new RecipeError(`recipe config: ${recipeDir}: no sft section (e.g. "sft": {"steps": 100})`);
    const runId = opts.runId ?? defaultRunId({ ...config, name: `${config.name}-sft` });
    const go = async (temporal: Temporal) => {
      const handle = await temporal.client.workflow.start(sftRun, {
        workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, workflowIdReusePolicy: 'REJECT_DUPLICATE',
        args: [{ runId, recipeDir: path.resolve(recipeDir), config }], staticSummary: `SFT ${config.name}`,
      });
      console.log(`run ${runId} started (SFT, workflow ${handle.workflowId})`);
      await followSft(handle);
      const done = await handle.result();
      console.log(`SFT ${runId}: ${done.step} steps, loss ${done.losses[0]?.toFixed(4)} -> ${done.loss?.toFixed(4)}`);
      console.log(`checkpoint: ${done.checkpoint?.path}`);
    };
    if (!opts.dev) return go(await connect());
    await withDevStack(config, go, false); // SFT calls no pools
  });

program.command('status')
  .description('state, progress, reward curve and last metrics of a run; the reason if it failed (exit 1)')
  .argument('<runId>')
  .action(async (runId: string) => {
    const temporal = await connect();
    const { handle, description } = await existingRun(temporal, runId);
    const status = description.status.name;
    console.log(`run ${runId}: ${status}, started ${description.startTime.toISOString()}`);
    if (status === 'RUNNING') {
      const progress = await queryProgress(temporal, handle);
      console.log(progress ? describeProgress(progress) : '  progress unavailable (is a molt-control worker running?)');
    } else if (status !== 'CONTINUED_AS_NEW') {
      console.log(describeSummary(await runResult(handle))); // throws the reason of a run that did not complete
    }
  });

program.command('list')
  .description('all runs, with step and reward of the running ones')
  .action(async () => {
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
  });

program.command('cancel')
  .description('graceful stop: the run finishes its current step, checkpoints and stops')
  .argument('<runId>')
  .action(async (runId: string) => {
    await control(runId, (h) => h.cancel());
    console.log(`stop requested for run ${runId}: it finishes its current step, checkpoints and stops`);
  });

for (const [name, description, update] of [
  ['pause', 'hold training: no new step starts (rollouts fill one batch); `unpause` goes on', pauseUpdate],
  ['unpause', 'release a paused run: training goes on', resumeUpdate],
] as const) {
  program.command(name).description(description).argument('<runId>')
    .action(async (runId: string) => printControl(runId, await control(runId, (h) => h.executeUpdate(update))));
}

withOverrides(program.command('set'))
  .description('change live settings of a running run from its next step, e.g. set <runId> --algo.lr 1e-4')
  .argument('<runId>')
  .addHelpText('after', () => `\nLive settings (checked as in recipe.json):\n${liveSettingsHelp()}`)
  .action(async (runId: string) => {
    if (Object.keys(overrides).length === 0) throw new UsageError(`set: nothing to set, e.g. --algo.lr 1e-4`);
    const settings = parseSettings(overrides);
    try {
      validateSettings(settings); // the workflow's update validator checks the same, with the same words
    } catch (err) {
      throw new UsageError(`run ${runId}: ${(err as Error).message}`);
    }
    printControl(runId, await control(runId, (h) => h.executeUpdate(setUpdate, { args: [settings] })));
  });

program.command('checkpoint')
  .description('save a checkpoint now (after a step in progress)')
  .argument('<runId>')
  .action(async (runId: string) => {
    const saved = await control(runId, (h) => h.executeUpdate(checkpointUpdate));
    console.log(`run ${runId}: checkpoint of step ${saved.step} at ${saved.path}`);
  });

// Engines join and leave a running run. `add` answers once the engine holds the run's weights and
// takes groups; `drain` once the groups that could use it have finished (it gets no weights after).
const engines = program.command('engines').description('the engines of a running run: list, add, drain');
engines.command('list').argument('<runId>').action(async (runId: string) => {
  const s = await control(runId, (h) => h.query(enginesQuery));
  for (const [state, urls] of [['serving', s.serving], ['draining', s.draining]] as const) for (const url of urls) console.log(`${url}\t${state}`);
  console.log(`run ${runId}: ${s.serving.length} serving, ${s.draining.length} draining, policy version ${s.version}`);
});
engines.command('add').description('the engine gets the current weights, then takes new groups').argument('<runId>').argument('<url>')
  .action(async (runId: string, url: string) => {
    try { checkEngineUrl(url); } catch (err) { throw new UsageError((err as Error).message); }
    const r = await control(runId, (h) => h.executeUpdate(addEngineUpdate, { args: [url] }));
    console.log(`run ${runId}: engine ${url} serves from version ${r.version} (joined in ${r.seconds.toFixed(1)} s)`);
  });
engines.command('drain').description('no new groups for the engine; returns when its groups have finished').argument('<runId>').argument('<url>')
  .action(async (runId: string, url: string) => {
    const r = await control(runId, (h) => h.executeUpdate(drainEngineUpdate, { args: [url] }));
    console.log(`run ${runId}: engine ${url} left at version ${r.version} after ${r.seconds.toFixed(1)} s (${r.groups} groups finished on it)`);
  });

// plot, gc and samples read a run's folder in the store.
const storeOption = ['--store <dir>', 'the trajectory store (default $MOLT_STORE, else .molt/stack/runs, else ./runs)'] as const;
program.command('plot')
  .description('reward, loss, logprob mismatch and throughput curves of a run (PNG), and TensorBoard events')
  .argument('<runId>').option(...storeOption)
  .option('--out <file.png>', 'where to write the PNG (default <run>/metrics.png)')
  .action(async (runId: string, opts: { store?: string; out?: string }) => {
    const { png, tensorboard } = await plotRun(runId, opts.store, opts.out);
    console.log(`wrote ${png}\nTensorBoard events in ${tensorboard}`);
  });

program.command('gc')
  .description('delete what a run no longer needs from the store, as each of its checkpoints does: step manifests and '
    + 'trajectories of the steps inside the last checkpoint (but its last store.keep_steps), journals and groups no step '
    + 'will train, checkpoints beyond store.keep_checkpoints')
  .argument('<runId>').option(...storeOption)
  .option('--keep-steps <n>', 'override store.keep_steps of the run\'s config.json')
  .option('--keep-checkpoints <n>', 'override store.keep_checkpoints (a number, or "all")')
  .option('--ended', 'the run is not running: do not ask Temporal (e.g. a run of a dev stack that is gone)')
  .action(async (runId: string, opts: { store?: string; keepSteps?: string; keepCheckpoints?: string; ended?: boolean }) => {
    const storeRoot = storeCandidates(opts.store).find((s) => fs.existsSync(path.join(s, runId)));
    if (!storeRoot) throw new RunNotFound(`no folder for run ${runId} in ${storeCandidates(opts.store).join(', ')}`);
    const count = (flag: string, value: string, min: number) => {
      if (!/^\d+$/.test(value) || Number(value) < min) throw new UsageError(`${flag}: "${value}" must be an integer >= ${min}`);
      return Number(value);
    };
    const keepSteps = opts.keepSteps === undefined ? undefined : count('--keep-steps', opts.keepSteps, 0);
    const keepCheckpoints = opts.keepCheckpoints === undefined ? undefined
      : opts.keepCheckpoints === 'all' ? null : count('--keep-checkpoints', opts.keepCheckpoints, 1);
    // A running run names what it may still train; one Temporal does not know is refused unless --ended.
    let live: Live | 'ended' = 'ended';
    if (!opts.ended) {
      const temporal = await connect().catch((e) => { throw new Error(`${(e as Error).message}; if run ${runId} has ended, pass --ended`); });
      const { handle, description } = await existingRun(temporal, runId).catch((e) => {
        throw e instanceof RunNotFound ? new RunNotFound(`${e.message}; if it has ended (e.g. on another stack), pass --ended`) : e;
      });
      if (description.status.name === 'RUNNING') {
        const p = await queryProgress(temporal, handle);
        if (!p) throw new Error(`run ${runId} is running but does not answer (is a molt-control worker up?): nothing deleted`);
        live = { checkpointStep: p.checkpoint?.step ?? null, liveFrom: p.liveFrom };
      }
    }
    const { policy, removed } = await gcRun(storeRoot, runId, live, { keepSteps, keepCheckpoints });
    const mb = (removed.bytes / 1e6).toFixed(1);
    console.log(`run ${runId}: removed ${removed.files} files and folders (${mb} MB) from ${path.join(storeRoot, runId)}; `
      + `kept the steps after ${policy.keepAfterStep}${live === 'ended' ? '' : ` and groups from ${policy.liveFrom}`}`);
  });

withOverrides(program.command('eval'))
  .description('held-out evaluation of a checkpoint on a local engine: greedy reward, pass@1, pass@n')
  .argument('<checkpointDir>')
  .argument('<recipeDir>')
  .option('--prompts <n>', 'held-out prompts (eval.prompts)')
  .option('--samples <n>', 'samples per prompt (eval.samples)')
  .action(async (checkpointDir: string, recipeDir: string, opts: { prompts?: string; samples?: string }) => {
    const r = await evalCheckpoint(checkpointDir, recipeDir, {
      ...overrides, ...(opts.prompts !== undefined ? { 'eval.prompts': opts.prompts } : {}),
      ...(opts.samples !== undefined ? { 'eval.samples': opts.samples } : {}),
    });
    console.log(`${checkpointDir}: ${r.prompts} held-out prompts, ${r.samples} samples each`);
    console.log(`  greedy reward ${r.greedy_reward?.toFixed(4) ?? '-'}, ` +
      `sample reward mean ${r.sample_reward_mean.toFixed(4)}`);
    console.log(`  pass@1 ${r['pass@1'].toFixed(4)}, pass@${r.samples} ${r['pass@n'].toFixed(4)} ` +
      `(a sample passes when its reward >= 1), ${r.failed} episodes failed`);
  });

program.command('samples')
  .description('decoded episodes of the last trained steps: prompt, completion, reward (<store>/<runId>/samples.jsonl)')
  .argument('<runId>').option(...storeOption)
  .option('--steps <n>', 'how many of the last steps to show', '3')
  .option('--step <n>', 'show this step only')
  .action((runId: string, opts: { store?: string; steps: string; step?: string }) => {
    const step = opts.step === undefined ? undefined : Number(opts.step);
    console.log(formatSamples(readSamples(runId, opts.store), { steps: Number(opts.steps), step }));
  });

addScheduleCommands(program, { overrides, withOverrides });
addStackCommands(program);

async function main(args: string[]): Promise<void> {
  let command = program;
  let depth = 0; // the words that name the command: `start`, `schedule create`
  for (let sub; (sub = command.commands.find((c) => c.name() === args[depth])); depth++) command = sub;
  if (takesOverrides.has(command)) {
    const taken = takeRecipeOverrides(args.slice(depth));
    Object.assign(overrides, taken.overrides);
    args = [...args.slice(0, depth), ...taken.argv];
  }
  await program.parseAsync(args, { from: 'user' });
}

main(process.argv.slice(2)).then(
  () => process.exit(0),
  (err) => {
    if (err instanceof CommanderError) process.exit(err.exitCode === 0 ? 0 : 2); // commander printed it
    console.error(err instanceof Error ? err.message : String(err));
    process.exit(err instanceof RecipeError || err instanceof UsageError ? 2 : 1);
  },
);
