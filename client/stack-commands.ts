// molt-client's local stacks: `dev` (a stack for one run, gone when the run ends), `up` / `down` /
// `ps` (a stack that stays, on Temporal's default ports, found by `start`, `list` and `status`
// without any setting), and `resume` of a run an earlier stack left.
import * as fs from 'node:fs';
import * as path from 'node:path';
import type { Client } from '@temporalio/client';
import { defaultPayloadConverter } from '@temporalio/common';
import type { Command } from 'commander';
import { REPO_ROOT, resolveModelDir, type RecipeConfig } from '../agents/recipe';
import { descendants, killTree, startStack, stopStacksOnSignals } from '../infra/stack';
import { runWorkflowId, trainRun, type TrainRunInput } from '../workflows/train-run';
import { connect, type Temporal } from './command';
import { RunNotFound, UsageError } from './errors';
import { hasSearchAttributes, runStartOptions } from './start-options';

export const LOCAL_STACK_DIR = path.join(REPO_ROOT, '.molt', 'local');
const stackFile = (stateDir: string) => path.join(stateDir, 'stack.json');

// What `up` leaves for `down` and `ps`: where the stack serves, and its processes.
interface StackRecord {
  temporalAddress: string; uiUrl: string | null; engines: string[]; actor: string; storeRoot: string; startedAt: string;
  processes: { name: string; pid: number; cmdline: string }[];
}

const cmdline = (pid: number) => {
  try { return fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').replace(/\0/g, ' ').trim(); } catch { return null; }
};
// Alive and still the process `up` started (a pid can be reused once it has exited).
const running = (p: StackRecord['processes'][number]) => cmdline(p.pid) === p.cmdline;

// `dev`: a stack for one run (fresh ports; the stack's Temporal database in .molt/stack keeps the
// history). Runs an earlier `dev` left are terminated at start (see endLeftoverRuns). Ctrl-C or
// SIGTERM at any moment, also during the start, stops every process of it (stopStacksOnSignals).
// The stack serves the recipe's model, engines, actor ranks and (unless withPools is false) pools.
export async function withDevStack<T>(
  config: RecipeConfig, fn: (temporal: Temporal) => Promise<T>, withPools = true): Promise<T> {
  stopStacksOnSignals((signal) => console.error(`\n${signal}: stopping the stack (molt-client resume <runId> continues the run on a later stack)`));
  const stack = await startStack({
    modelDir: resolveModelDir(config.model), engines: config.engines.count, actorWorldSize: config.actor.world_size,
    stateDir: process.env.MOLT_STACK_DIR, endLeftoverRuns: true,
    pools: Object.fromEntries(Object.entries(withPools ? config.pools ?? {} : {})
      .map(([name, p]) => [name, { ...p, modelDir: resolveModelDir(p.model) }])),
  });
  try {
    return await fn(await connect(stack.temporalAddress, stack.uiUrl ?? 'http://localhost:8233'));
  } finally {
    await stack.stop();
  }
}

export function addStackCommands(program: Command): void {
  const stateDirOption = ['--state-dir <dir>', 'the stack\'s state folder (Temporal database, store, logs)', LOCAL_STACK_DIR] as const;
  program.command('up')
    .description('start a local stack that stays: Temporal on localhost:7233 (UI 8233), engines, actor, workers')
    .option('--engines <n>', 'engine processes', '1')
    .option('--model <model>', 'the model the engines and the actor load (a name under .molt/models, or a folder)', 'tiny')
    .option('--port <port>', 'Temporal frontend port', '7233')
    .option('--ui-port <port>', 'Temporal Web UI port', '8233')
    .option(...stateDirOption)
    .action(up);
  program.command('down').description('stop the local stack of `up` (its runs and store stay)').option(...stateDirOption).action(down);
  program.command('ps').description('the processes of the local stack of `up`, their pids and URLs').option(...stateDirOption).action(ps);
  program.command('resume')
    .description('continue a run that an earlier stack left (terminated at the next stack\'s start), or that failed or was cancelled')
    .argument('<runId>')
    .action(async (runId: string) => {
      const temporal = await connect();
      await resumeRun(temporal.client, runId, await hasSearchAttributes(temporal.connection, temporal.client.options.namespace));
    });
}

interface UpOptions { engines: string; model: string; port: string; uiPort: string; stateDir: string }

async function up(o: UpOptions): Promise<void> {
  const { stateDir, record } = readRecord(o.stateDir);
  if (record && record.processes.some(running)) {
    console.log(`the local stack is already up (Temporal ${record.temporalAddress}); molt-client ps shows it`);
    return;
  }
  const port = Number(o.port);
  const uiPort = Number(o.uiPort);
  const engines = Number(o.engines);
  for (const [flag, value] of [['--port', port], ['--ui-port', uiPort], ['--engines', engines]] as const) {
    if (!Number.isInteger(value) || value <= 0) throw new UsageError(`${flag}: expected a positive integer`);
  }
  stopStacksOnSignals((signal) => console.error(`\n${signal}: stopping the stack`));
  const stack = await startStack({
    modelDir: resolveModelDir(o.model), stateDir, engines, temporal: { port, uiPort }, endLeftoverRuns: true,
  });
  const rec: StackRecord = {
    temporalAddress: stack.temporalAddress, uiUrl: stack.uiUrl, engines: stack.engines, actor: stack.actor,
    storeRoot: stack.storeRoot, startedAt: new Date().toISOString(),
    processes: [...stack.processes].map(([name, proc]) => ({ name, pid: proc.pid!, cmdline: cmdline(proc.pid!) ?? '' })),
  };
  fs.writeFileSync(stackFile(stateDir), `${JSON.stringify(rec, null, 2)}\n`);
  for (const proc of stack.processes.values()) proc.unref(); // they stay when this command exits
  console.log(`local stack up: Temporal ${stack.temporalAddress}, UI ${stack.uiUrl}, store ${stack.storeRoot}, logs ${path.join(stateDir, 'logs')}`);
  console.log('molt-client start <recipeDir> starts a run on it; molt-client down stops it');
}

async function down(o: { stateDir: string }): Promise<void> {
  const { stateDir, record } = readRecord(o.stateDir);
  const live = record?.processes.filter(running) ?? [];
  if (live.length === 0) {
    console.log('no local stack is up');
    fs.rmSync(stackFile(stateDir), { force: true });
    return;
  }
  // Every process of the stack, below the ones `up` started too (torchrun's ranks, tsx's node):
  // SIGTERM, and SIGKILL for any still there after 15 s.
  const all = live.flatMap((p) => [p.pid, ...descendants(p.pid)]);
  const exists = (pid: number) => {
    try { return !/\) Z /.test(fs.readFileSync(`/proc/${pid}/stat`, 'utf8')); } catch { return false; } // gone, or a zombie
  };
  for (const p of live) killTree(p.pid, 'SIGTERM');
  for (const deadline = Date.now() + 15_000; all.some(exists) && Date.now() < deadline;) await new Promise((r) => setTimeout(r, 200));
  for (const pid of all.filter(exists)) try { process.kill(pid, 'SIGKILL'); } catch { /* gone */ }
  fs.rmSync(stackFile(stateDir), { force: true });
  console.log(`local stack down (${live.map((p) => p.name).join(', ')} stopped); its runs stay in ${stateDir}`);
}

function ps(o: { stateDir: string }): void {
  const { record } = readRecord(o.stateDir);
  if (!record) {
    console.log('no local stack is up (molt-client up starts one)');
    return;
  }
  console.log(`local stack since ${record.startedAt}: Temporal ${record.temporalAddress}, UI ${record.uiUrl ?? '-'}, store ${record.storeRoot}`);
  const urls: Record<string, string> = { actor: record.actor, ...Object.fromEntries(record.engines.map((u, i) => [`engine-${i}`, u])) };
  for (const p of record.processes) console.log(`  ${p.name}\tpid ${p.pid}\t${running(p) ? 'running' : 'EXITED'}\t${urls[p.name] ?? ''}`);
}

// The --state-dir folder, and what `up` left there (null: nothing, or not readable).
function readRecord(dir: string): { stateDir: string; record: StackRecord | null } {
  const stateDir = path.resolve(dir);
  try {
    return { stateDir, record: JSON.parse(fs.readFileSync(stackFile(stateDir), 'utf8')) as StackRecord };
  } catch {
    return { stateDir, record: null };
  }
}

// A run that is no longer running (terminated when a later stack started, failed, cancelled) goes
// on as a new execution of its workflow with the input of its last one, marked `resumed`: the
// workflow then picks up its step and groups from the store (activities/actor.ts, resumePoint).
async function resumeRun(client: Client, runId: string, searchable: boolean): Promise<void> {
  const handle = client.workflow.getHandle<typeof trainRun>(runWorkflowId(runId));
  const description = await handle.describe().catch(() => { throw new RunNotFound(`no run ${handle.workflowId}`); });
  if (description.status.name === 'RUNNING') throw new UsageError(`run ${runId} is running (a paused one goes on with unpause)`);
  if (description.status.name === 'COMPLETED') {
    const summary = await handle.result();
    if (!summary.stopped) throw new UsageError(`run ${runId} finished all its ${summary.steps} steps: nothing to resume`);
  }
  const history = await handle.fetchHistory();
  const started = history.events?.[0]?.workflowExecutionStartedEventAttributes;
  const payload = started?.input?.payloads?.[0];
  if (!payload) throw new Error(`run ${runId}: its history has no start input`);
  const input = defaultPayloadConverter.fromPayload<TrainRunInput>(payload);
  const options = runStartOptions(input.recipeDir, input.config, runId, searchable);
  await client.workflow.start(trainRun, {
    ...options, workflowId: handle.workflowId, workflowIdReusePolicy: 'ALLOW_DUPLICATE',
    args: [{ ...input, runId, resumed: true }],
  });
  console.log(`run ${runId} resumed (it was ${description.status.name}); it goes on from its last step in the store`);
}
