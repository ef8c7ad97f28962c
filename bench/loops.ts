// The training loop driven three ways against fresh, identical stacks (engines + actor): by the
// trainRun workflow through Temporal; by a plain in-process loop calling the very same activity
// functions with the same streaming pool (pool.inflight groups in flight, a step whenever
// batch.groups are ready; each step trains, refits and records its metrics line, as the workflow
// does); and by the same plain loop in synchronous mode (generate a batch, then
// train, then generate: batch.groups in flight, refilled only after the step's refit).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { MockActivityEnvironment } from '@temporalio/testing';
import { createActivities } from '../activities';
import { stepGroups, type GroupResult } from '../activities/types';
import { REPO_ROOT, resolveModelDir, type RecipeConfig } from '../agents/recipe';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../workflows/train-run';
import { startStack, stopStacksOnSignals, type Stack } from '../infra/stack';
import { treeCpuSeconds } from './scale';

export const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'copy');

export interface LoopResult {
  seconds: number; // from start to the last step's checkpoint
  trainedTokens: number; // generated tokens of the groups trained on
  engineBusy: number | null; // mean fraction of wall time each engine was generating (plain loops only)
  // Plain loops only, means per step: seconds waiting for the batch (sync: its whole generation) and
  // training + refitting it; CPU seconds of this process, of the engines and of the actor; idle
  // seconds of each core (/proc/stat) over the run.
  waitSeconds?: number; trainSeconds?: number;
  // Plain loops only: when each step ended (seconds from the start) and the tokens it trained.
  stepEnds?: number[]; stepTokens?: number[];
  cpuPerStep?: { node: number; engines: number; actor: number }; idlePerStep?: number[];
  // Temporal loop only: CPU seconds burnt while it ran by the Temporal dev server and by the worker
  // that runs the loop's workflow tasks (control + actor queues): the orchestration's own cost.
  cpu?: { server: number; controlWorker: number };
}

// `pinned`: the engines on CPU 0 and the actor on CPU 1, as each has its own GPU on a cluster
// (on a one-CPU machine, nothing is pinned).
// Ctrl-C on a bench stops its stack: without this the bench's node process exited alone and left the Temporal
// server, the engines and the actor running (they run in process groups of their own).
let stopsOnSignals = false;
export async function withStack<T>(config: RecipeConfig, workers: boolean, fn: (stack: Stack) => Promise<T>, pinned = false): Promise<T> {
  if (!stopsOnSignals) stopStacksOnSignals((signal) => console.error(`\n${signal}: stopping the bench's stack`));
  stopsOnSignals = true;
  const stack = await startStack({
    modelDir: resolveModelDir(config.model), stateDir: fs.mkdtempSync(path.join(os.tmpdir(), 'molt-bench-')),
    engines: config.engines.count, workers, quiet: true, ...(pinned && os.cpus().length >= 2 ? { cpus: { engines: '0', actor: '1' } } : {}),
  });
  try {
    return await fn(stack);
  } finally {
    await stack.stop();
    fs.rmSync(stack.stateDir, { recursive: true, force: true });
  }
}

// The whole run through Temporal; trained tokens from the run's metrics.jsonl.
// `continueAsNewAfterSteps`: continue as new (and so drain the pool) after that many steps of a run.
export async function temporalLoop(config: RecipeConfig, continueAsNewAfterSteps?: number): Promise<LoopResult> {
  return withStack(config, true, async (stack) => {
    const client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
    const runId = `bench-temporal-${Date.now()}`;
    const pids = { server: stack.processes.get('temporal')!.pid!, controlWorker: stack.processes.get('worker')!.pid! };
    const cpu0 = { server: treeCpuSeconds(pids.server), controlWorker: treeCpuSeconds(pids.controlWorker) };
    const started = performance.now();
    await client.workflow.execute(trainRun, {
      workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config, continueAsNewAfterSteps }],
    });
    const seconds = (performance.now() - started) / 1000;
    const cpu = { server: treeCpuSeconds(pids.server) - cpu0.server, controlWorker: treeCpuSeconds(pids.controlWorker) - cpu0.controlWorker };
    await client.connection.close();
    const lines = fs.readFileSync(path.join(stack.storeRoot, runId, 'metrics.jsonl'), 'utf8').trim().split('\n');
    const trainedTokens = lines.reduce((n, l) => n + (JSON.parse(l) as Record<string, number>)['rollout/tokens'], 0);
    return { seconds, trainedTokens, engineBusy: null, cpu };
  });
}

// Engine utilization seen from the client: an engine counts as generating while at least one
// /generate request to it is in flight, except while the loop holds it paused for a refit (the
// requests are held then, not generating). Busy fraction = busy time / wall time, per engine.
export class EngineMeter {
  private readonly inflight = new Map<string, number>();
  private readonly busyMs = new Map<string, number>();
  private readonly since = new Map<string, number>();
  private paused = false;
  private readonly started = performance.now();

  constructor(private readonly engines: string[]) {
    for (const e of engines) { this.inflight.set(e, 0); this.busyMs.set(e, 0); this.since.set(e, this.started); }
  }

  // Close the interval since the last change of engine e's state.
  private settle(e: string): void {
    const now = performance.now();
    if (this.inflight.get(e)! > 0 && !this.paused) this.busyMs.set(e, this.busyMs.get(e)! + now - this.since.get(e)!);
    this.since.set(e, now);
  }

  engineOf(url: string): string | undefined {
    return url.endsWith('/generate') ? this.engines.find((e) => url.startsWith(e)) : undefined;
  }

  change(e: string, delta: number): void { this.settle(e); this.inflight.set(e, this.inflight.get(e)! + delta); }
  setPaused(paused: boolean): void { for (const e of this.engines) this.settle(e); this.paused = paused; }

  busyFraction(): number {
    for (const e of this.engines) this.settle(e);
    const wall = performance.now() - this.started;
    return this.engines.reduce((a, e) => a + this.busyMs.get(e)! / wall, 0) / this.engines.length;
  }

  // Route this process's fetch through the meter (the router calls fetch); returns the undo.
  install(): () => void {
    const original = globalThis.fetch;
    globalThis.fetch = (async (input: string | URL | Request, init?: RequestInit) => {
      const engine = this.engineOf(input instanceof Request ? input.url : String(input));
      if (engine === undefined) return original(input, init);
      this.change(engine, +1);
      try { // until the whole body is in: the engine answers /generate when the generation is done
        const res = await original(input, init);
        return new Response(await res.arrayBuffer(), { status: res.status, statusText: res.statusText, headers: res.headers });
      } finally {
        this.change(engine, -1);
      }
    }) as typeof fetch;
    return () => { globalThis.fetch = original; };
  }
}

// Idle (+ iowait) seconds of each CPU since boot, from /proc/stat (in USER_HZ ticks, 100 a second); [] elsewhere.
function coreIdleSeconds(): number[] {
  if (!fs.existsSync('/proc/stat')) return [];
  return fs.readFileSync('/proc/stat', 'utf8').split('\n').filter((l) => /^cpu\d/.test(l))
    .map((l) => { const f = l.split(/\s+/).map(Number); return (f[4] + f[5]) / 100; });
}

// The same loop without Temporal: the same activity functions, the same pool and batch rule.
// 'sync': batch.groups in flight, refilled only once the step (train + refit) is done.
export async function plainLoop(config: RecipeConfig, mode: 'streaming' | 'sync', pinned = false): Promise<LoopResult> {
  return withStack(config, false, async (stack) => {
    const acts = createActivities({ engines: stack.engines, actor: stack.actor, token: stack.token, storeRoot: stack.storeRoot });
    const activity = new MockActivityEnvironment(); // an activity context outside a worker (heartbeats go nowhere)
    const runId = `bench-plain-${mode}-${Date.now()}`;
    await acts.writeRunConfig({ runId, recipeDir: RECIPE_DIR, config }); // the groups read it, as in a run
    const poolSize = mode === 'sync' ? config.batch.groups : config.pool.inflight;
    const ready: GroupResult[] = [];
    let inflight = 0;
    let nextGroup = 0;
    let trainedTokens = 0;
    let wake = () => {};
    const fill = () => {
      while (inflight < poolSize && ready.length < config.batch.groups) {
        inflight++;
        const input = { runId, groupIndex: nextGroup++ };
        void (new MockActivityEnvironment().run(acts.rolloutGroup, input) as Promise<GroupResult>).then((r) => {
          inflight--;
          ready.push(r);
          if (mode === 'streaming') fill();
          wake();
        });
      }
    };
    const meter = new EngineMeter(stack.engines);
    const uninstall = meter.install();
    const pids = [...stack.processes].filter(([name]) => name.startsWith('engine-') || name === 'actor');
    const serviceCpu = (prefix: string) => pids.filter(([n]) => n.startsWith(prefix)).reduce((s, [, p]) => s + treeCpuSeconds(p.pid!), 0);
    const cpu0 = { node: process.cpuUsage(), engines: serviceCpu('engine-'), actor: serviceCpu('actor'), idle: coreIdleSeconds() };
    let [waitMs, trainMs] = [0, 0];
    const [stepEnds, stepTokens]: number[][] = [[], []];
    try {
      const started = performance.now();
      fill();
      for (let step = 1; step <= config.train.steps; step++) {
        const waitFrom = performance.now();
        while (ready.length < config.batch.groups || (mode === 'sync' && inflight > 0)) await new Promise<void>((r) => { wake = r; });
        waitMs += performance.now() - waitFrom;
        const batch = ready.splice(0, config.batch.groups);
        trainedTokens += batch.reduce((n, g) => n + g.tokens, 0);
        if (mode === 'streaming') fill();
        const trainFrom = performance.now();
        await activity.run(acts.trainStep, { runId, step, groups: stepGroups(batch), algo: config.algo });
        meter.setPaused(true);
        await activity.run(acts.refit, { runId, version: step });
        meter.setPaused(false);
        trainMs += performance.now() - trainFrom;
        await activity.run(acts.recordMetrics, { runId, step, metrics: { 'rollout/tokens': batch.reduce((n, g) => n + g.tokens, 0) } });
        stepEnds.push((performance.now() - started) / 1000);
        stepTokens.push(batch.reduce((n, g) => n + g.tokens, 0));
        if (mode === 'sync' && step < config.train.steps) fill();
      }
      await activity.run(acts.checkpoint, { runId, step: config.train.steps });
      const seconds = (performance.now() - started) / 1000;
      const engineBusy = meter.busyFraction();
      const n = config.train.steps;
      const node = process.cpuUsage(cpu0.node);
      const cpuPerStep = {
        node: (node.user + node.system) / 1e6 / n, engines: (serviceCpu('engine-') - cpu0.engines) / n, actor: (serviceCpu('actor') - cpu0.actor) / n,
      };
      const idlePerStep = coreIdleSeconds().map((s, i) => (s - cpu0.idle[i]) / n);
      while (inflight > 0) await new Promise<void>((r) => { wake = r; }); // let the last groups finish before the stack stops
      return { seconds, trainedTokens, engineBusy, waitSeconds: waitMs / 1000 / n, trainSeconds: trainMs / 1000 / n, cpuPerStep, idlePerStep, stepEnds, stepTokens };
    } finally {
      uninstall();
    }
  }, pinned);
}
