// Orchestration scale: the real workflow (trainRun and its activities) on a real Temporal dev server,
// with activities that do no model work — rolloutGroup returns a GroupResult at once, and the
// actor's activities answer at once — so what is measured is Temporal and the workflows alone:
// trajectories per second as the prompt groups in flight grow, history events per training step,
// and the CPU the worker (this process) and the server burn per step.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { Client } from '@temporalio/client';
import { TestWorkflowEnvironment } from '@temporalio/testing';
import { bundleWorkflowCode, DefaultLogger, Runtime, Worker } from '@temporalio/worker';
import type { Activities } from '../activities';
import type { GroupResult, RolloutGroupInput } from '../activities/types';
import { loadRecipe, REPO_ROOT, type RecipeConfig } from '../agents/recipe';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../workflows/train-run';
import { RECIPE_DIR } from './loops';

export interface ScaleRow {
  inflight: number; // prompt groups in flight (pool.inflight)
  batchGroups: number;
  steps: number; // steps done
  seconds: number; // wall time of the run (or up to the budget)
  finished: boolean; // false: cut off at the time budget
  trajectoriesPerSecond: number | null; // trained episodes / wall time between the first and the last step
  stepsPerSecond: number | null;
  eventsPerStep: number; // trainRun history events (all runs of its continue-as-new chain) / steps
  eventsPerGroup: number; // the same per group trained (events per step / batch.groups)
  historyBytesPerGroup: number; // trainRun history bytes per group trained
  workerCpuPerStep: number; // CPU seconds of this process (workflow + activity worker) per step
  serverCpuPerStep: number; // CPU seconds of the Temporal dev server per step
  coresBusy: number; // (worker + server CPU) / wall time of the whole run: 2 = both cores of this machine
  // (worker + server CPU) / episodes trained between the first and the last step, ms: the orchestration's cost of
  // one episode in the steady state (the whole run's CPU would count the ramp-up and the groups left in flight)
  cpuMsPerEpisode: number | null;
  shards: number; // rollout shard workflows the run started (workflows/rollout-pool.ts), all executions
  stepSeconds: number[]; // wall time of each step after the first: where the ramp-up ends
  executions: number; // the run's executions: each continue-as-new drained the pool first
}

// Fields of /proc/<pid>/stat after "(comm)", from field 3 (state) on; comm itself beside them.
function procStat(pid: number | string): { comm: string; fields: string[] } {
  const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
  return { comm: stat.slice(stat.indexOf('(') + 1, stat.lastIndexOf(')')), fields: stat.slice(stat.lastIndexOf(')') + 2).split(' ') };
}

// CPU seconds (user + system) of a process: fields 14 and 15, in clock ticks (USER_HZ = 100).
function cpuSeconds(pid: number): number {
  const { fields } = procStat(pid);
  return (Number(fields[11]) + Number(fields[12])) / 100;
}

// Every live process as pid -> parent pid (field 4).
function parents(): Map<number, number> {
  const parent = new Map<number, number>();
  for (const entry of fs.readdirSync('/proc').filter((e) => /^\d+$/.test(e))) {
    try { parent.set(Number(entry), Number(procStat(entry).fields[1])); } catch { /* exited meanwhile */ }
  }
  return parent;
}

// CPU seconds of a process and all its descendants (a worker runs as tsx -> node).
export function treeCpuSeconds(root: number): number {
  const children = new Map<number, number[]>();
  for (const [pid, ppid] of parents()) children.set(ppid, [...(children.get(ppid) ?? []), pid]);
  let total = 0;
  const todo = [root];
  while (todo.length) {
    const pid = todo.pop()!;
    try { total += cpuSeconds(pid); } catch { /* exited meanwhile */ }
    todo.push(...(children.get(pid) ?? []));
  }
  return total;
}

// The dev server the test environment started: our child whose command is the temporal binary.
function serverPid(): number {
  for (const [pid, ppid] of parents()) {
    try { if (ppid === process.pid && procStat(pid).comm === 'temporal') return pid; } catch { /* exited meanwhile */ }
  }
  throw new Error('scale bench: the Temporal dev server process was not found');
}

// Activities with the real signatures and no work behind them.
// When each step was recorded, and the CPU seconds (this process + the server) by then.
interface StepMark { at: number; cpu: number }
function instantActivities(stepMarks: StepMark[], cpuNow: () => number): Activities {
  let version = 0;
  const configs = new Map<string, RecipeConfig>(); // as writeRunConfig left them: the real activity reads <run>/config.json
  return {
    async rolloutGroup(input: RolloutGroupInput): Promise<GroupResult> {
      const config = configs.get(input.runId)!;
      const g = config.group_size;
      return {
        groupIndex: input.groupIndex, episodes: Array.from({ length: g }, (_, e) => e), segments: Array(g).fill(1),
        rewards: Array(g).fill(0.5), failed: 0, tokens: g * config.sampling.max_tokens, minVersion: version, maxVersion: version, seconds: 0,
      };
    },
    async trainStep(input) { return { step: input.step, version: input.step, replayed: false, metrics: { pg_loss: 0 } }; },
    async sftStep(input) { return { step: input.step, version: input.step, replayed: false, metrics: { loss: 0 } }; },
    async refit(input) { version = input.version; return { version: input.version, seconds: 0, bytes: 0 }; },
    async checkpoint(input) { return { path: `/nowhere/step-${input.step}`, step: input.step }; },
    async claimActor() { return { heldBy: null }; },
    async resumePoint() { return { step: 0, nextGroupIndex: 0, checkpoint: null }; },
    async recordMetrics(input) { stepMarks[input.step] = { at: performance.now(), cpu: cpuNow() }; return { written: true }; },
    async writeRunConfig(input) { configs.set(input.runId, input.config); },
    async evaluate(input) { // not called: the bench recipe has eval.every 0
      return { step: input.step, prompts: 0, samples: 0, greedy_reward: null, sample_reward_mean: 0, 'pass@1': 0, 'pass@n': 0, failed: 0, version_min: version, version_max: version };
    },
  };
}

export async function orchestrationScale(sizes: number[], steps: (inflight: number) => number, budgetSeconds: (inflight: number) => number): Promise<ScaleRow[]> {
  Runtime.install({ logger: new DefaultLogger('WARN') }); // the workers' state changes would drown the bench's own lines
  const env = await TestWorkflowEnvironment.createLocal({ server: { executable: { type: 'existing-path', path: path.join(REPO_ROOT, '.venv', 'bin', 'temporal') } } });
  const server = serverPid();
  const stepMarks: StepMark[] = [];
  const cpuNow = () => { const c = process.cpuUsage(); return (c.user + c.system) / 1e6 + cpuSeconds(server); };
  const activities = instantActivities(stepMarks, cpuNow);
  const common = { connection: env.nativeConnection, namespace: env.namespace ?? 'default', shutdownGraceTime: '1 second' as const };
  const workflowBundle = await bundleWorkflowCode({ workflowsPath: path.join(REPO_ROOT, 'workflows', 'index.ts') });
  // As infra/worker.ts sets them up: one optimizer step at a time on the actor queue.
  const workers = await Promise.all([
    Worker.create({ ...common, taskQueue: TASK_QUEUES.control, workflowBundle, activities: { recordMetrics: activities.recordMetrics, writeRunConfig: activities.writeRunConfig } }),
    Worker.create({ ...common, taskQueue: TASK_QUEUES.rollout, activities: { rolloutGroup: activities.rolloutGroup } }),
    Worker.create({ ...common, taskQueue: TASK_QUEUES.actor, activities, maxConcurrentActivityTaskExecutions: 1 }),
  ]);
  const running = workers.map((w) => w.run());
  const client: Client = env.client;
  const rows: ScaleRow[] = [];
  try {
    for (const inflight of sizes) {
      const batchGroups = Math.min(inflight / 2, 2048); // a step's results fit one Temporal payload (agents/live-settings.ts)
      const n = steps(inflight);
      const config = loadRecipe(RECIPE_DIR, { 'pool.inflight': String(inflight), 'batch.groups': String(batchGroups), 'train.steps': String(n), 'checkpoint.every': '1000' });
      const runId = `scale-${inflight}-${Date.now()}`;
      console.error(`[bench] orchestration scale: ${inflight} groups in flight, ${n} steps`);
      stepMarks.length = 1; // stepMarks[0] unused: steps count from 1
      const cpu0 = { worker: process.cpuUsage(), server: cpuSeconds(server) };
      const started = performance.now();
      const handle = await client.workflow.start(trainRun, { workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config }] });
      // A size that has not finished within the budget is cut off there and measured on the steps it did.
      const finished = await Promise.race([handle.result().then(() => true), new Promise<false>((r) => setTimeout(() => r(false), budgetSeconds(inflight) * 1000))]);
      if (!finished) await handle.terminate('orchestration scale bench: time budget spent');
      const runSeconds = (performance.now() - started) / 1000; // the CPU figures cover the whole run
      const cpu = process.cpuUsage(cpu0.worker);
      const workerCpu = (cpu.user + cpu.system) / 1e6;
      const serverCpu = cpuSeconds(server) - cpu0.server;
      const done = stepMarks.length - 1; // steps recorded (stepMarks[s] = when step s was recorded)
      const wall = (stepMarks[done]?.at - stepMarks[1]?.at) / 1000; // steady state: the first step's ramp-up left out
      const runs = [];
      for await (const w of client.workflow.list({ query: `WorkflowId = '${runWorkflowId(runId)}'` })) runs.push(w);
      // From the server's count (a fetched history of thousands of groups can pass gRPC's 4 MB per message).
      const described = await Promise.all(runs.map((w) => client.workflow.getHandle(w.workflowId, w.runId).describe()));
      const runEvents = described.reduce((a, d) => a + d.historyLength, 0);
      const runBytes = described.reduce((a, d) => a + (d.historySize ?? 0), 0);
      const shards = new Set<string>();
      for await (const w of client.workflow.list({ query: `WorkflowType = 'rolloutShard'` })) {
        if (w.workflowId.startsWith(`${runWorkflowId(runId)}-shard-`)) shards.add(w.workflowId);
      }
      const steadyEpisodes = (done - 1) * batchGroups * config.group_size;
      rows.push({
        inflight, batchGroups, steps: Math.max(done, 0), seconds: runSeconds, finished,
        // null when fewer than 2 steps were done within the budget: no steady state to measure
        trajectoriesPerSecond: done >= 2 ? ((done - 1) * batchGroups * config.group_size) / wall : null,
        stepsPerSecond: done >= 2 ? (done - 1) / wall : null,
        eventsPerStep: runEvents / Math.max(done, 1), eventsPerGroup: runEvents / Math.max(done, 1) / batchGroups,
        historyBytesPerGroup: runBytes / Math.max(done, 1) / batchGroups,
        workerCpuPerStep: workerCpu / Math.max(done, 1), serverCpuPerStep: serverCpu / Math.max(done, 1), coresBusy: (workerCpu + serverCpu) / runSeconds,
        cpuMsPerEpisode: done >= 2 ? ((stepMarks[done].cpu - stepMarks[1].cpu) * 1000) / steadyEpisodes : null, shards: shards.size,
        executions: runs.length, stepSeconds: stepMarks.slice(2, done + 1).map((m, i) => (m.at - stepMarks[i + 1].at) / 1000),
      });
    }
  } finally {
    for (const w of workers) w.shutdown();
    await Promise.all(running);
    await env.teardown();
  }
  return rows;
}
