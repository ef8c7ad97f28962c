// `npm run bench`: what Temporal costs. The same K training steps are driven twice against fresh,
// identical stacks (engines + actor): once by the trainRun workflow through Temporal, once by a
// plain in-process loop that calls the very same activity functions with the same streaming pool
// (pool.inflight groups in flight, a step whenever batch.groups are ready). Reported: ms per step
// of each, the added ms per step, and the ratio — for the embedded recipe and for a heavier
// workload whose plain step takes seconds. Then the engine benchmark (gpu-services/bench_engine.py).
// Writes bench-out/report.md and bench-out/report.json.
//
//   npm run bench [-- --steps 8] [-- --smoke]     (--smoke: tiny sizes, checks the report is produced)
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { MockActivityEnvironment } from '@temporalio/testing';
import { createActivities } from '../activities';
import type { GroupResult } from '../activities/types';
import { loadRecipe, REPO_ROOT, resolveModelDir, type RecipeConfig } from '../agents/recipe';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../workflows/train-run';
import { startStack, type Stack } from './stack';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'copy');
const OUT_DIR = path.join(REPO_ROOT, 'bench-out');

interface Workload { name: string; overrides: Record<string, string> }

async function withStack<T>(config: RecipeConfig, workers: boolean, fn: (stack: Stack) => Promise<T>): Promise<T> {
  const stack = await startStack({
    modelDir: resolveModelDir(config.model), stateDir: fs.mkdtempSync(path.join(os.tmpdir(), 'molt-bench-')),
    engines: config.engines.count, workers, quiet: true,
  });
  try {
    return await fn(stack);
  } finally {
    await stack.stop();
  }
}

// The whole run through Temporal; seconds from start to result.
async function temporalLoop(config: RecipeConfig): Promise<number> {
  return withStack(config, true, async (stack) => {
    const client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
    const runId = `bench-temporal-${Date.now()}`;
    const started = performance.now();
    await client.workflow.execute(trainRun, {
      workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config }],
    });
    const seconds = (performance.now() - started) / 1000;
    await client.connection.close();
    return seconds;
  });
}

// The same loop without Temporal: the same activity functions, the same pool and batch rule.
async function plainLoop(config: RecipeConfig): Promise<number> {
  return withStack(config, false, async (stack) => {
    const acts = createActivities({ engines: stack.engines, actor: stack.actor, token: stack.token, storeRoot: stack.storeRoot });
    const activity = new MockActivityEnvironment(); // an activity context outside a worker (heartbeats go nowhere)
    const runId = `bench-plain-${Date.now()}`;
    const ready: GroupResult[] = [];
    let inflight = 0;
    let nextGroup = 0;
    let wake = () => {};
    const fill = () => {
      while (inflight < config.pool.inflight && ready.length < config.batch.groups) {
        inflight++;
        const input = { runId, groupIndex: nextGroup++, recipeDir: RECIPE_DIR, config };
        void (new MockActivityEnvironment().run(acts.rolloutGroup, input) as Promise<GroupResult>).then((r) => {
          inflight--;
          ready.push(r);
          fill();
          wake();
        });
      }
    };
    const started = performance.now();
    fill();
    for (let step = 1; step <= config.train.steps; step++) {
      while (ready.length < config.batch.groups) await new Promise<void>((r) => { wake = r; });
      const batch = ready.splice(0, config.batch.groups);
      fill();
      await activity.run(acts.trainStep, { runId, step, refs: batch.flatMap((g) => g.refs), algo: config.algo });
      await activity.run(acts.refit, { runId, version: step });
    }
    await activity.run(acts.checkpoint, { runId, step: config.train.steps });
    const seconds = (performance.now() - started) / 1000;
    while (inflight > 0) await new Promise<void>((r) => { wake = r; }); // let the last groups finish before the stack stops
    return seconds;
  });
}

function engineBench(smoke: boolean): { markdown: string; json: unknown } {
  if (smoke) return { markdown: '(engine benchmark skipped in --smoke)\n', json: null };
  const out = path.join(OUT_DIR, 'engine.json');
  const res = spawnSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'), ['gpu-services/bench_engine.py', '--model', resolveModelDir('tiny'), '--out', out],
    { cwd: REPO_ROOT, encoding: 'utf8', env: { ...process.env, OMP_NUM_THREADS: '1' } });
  if (res.status !== 0) throw new Error(`bench_engine.py failed:\n${res.stderr}`);
  return { markdown: res.stdout, json: JSON.parse(fs.readFileSync(out, 'utf8')) };
}

async function main() {
  const argv = process.argv.slice(2);
  const smoke = argv.includes('--smoke');
  const stepsArg = argv.indexOf('--steps');
  const steps = String(stepsArg >= 0 ? Number(argv[stepsArg + 1]) : smoke ? 2 : 10);
  const workloads: Workload[] = smoke
    ? [{ name: 'smoke', overrides: { 'train.steps': steps, 'batch.groups': '2', 'pool.inflight': '3', group_size: '2' } }]
    : [
      { name: 'embedded recipe (16 groups x 8, 3 tokens)', overrides: { 'train.steps': steps } },
      // Heavier: 8x the episodes and 16 tokens each, so a plain step takes seconds on 2 cores.
      { name: 'heavier (32 groups x 16, 16 tokens)', overrides: { 'train.steps': steps, 'batch.groups': '32', 'pool.inflight': '48', group_size: '16', 'sampling.max_tokens': '16' } },
    ];
  fs.mkdirSync(OUT_DIR, { recursive: true });
  const rows = [];
  for (const w of workloads) {
    const config = loadRecipe(RECIPE_DIR, { ...w.overrides, 'checkpoint.every': '1000' });
    console.error(`[bench] ${w.name}: plain loop`);
    const plain = await plainLoop(config);
    console.error(`[bench] ${w.name}: Temporal loop`);
    const temporal = await temporalLoop(config);
    const n = config.train.steps;
    rows.push({
      workload: w.name, steps: n, plainMsPerStep: (plain * 1000) / n, temporalMsPerStep: (temporal * 1000) / n,
      addedMsPerStep: ((temporal - plain) * 1000) / n, ratio: temporal / plain,
    });
  }
  const engine = engineBench(smoke);
  const f = (x: number) => x.toFixed(0);
  const markdown = [
    '# Molt benchmarks', '',
    '## Orchestration: Temporal loop vs plain in-process loop (same activities, same pool, fresh stacks)', '',
    '| workload | steps | plain ms/step | Temporal ms/step | added ms/step | ratio |', '|---|---:|---:|---:|---:|---:|',
    ...rows.map((r) => `| ${r.workload} | ${r.steps} | ${f(r.plainMsPerStep)} | ${f(r.temporalMsPerStep)} | ${f(r.addedMsPerStep)} | ${r.ratio.toFixed(2)} |`),
    '', '## Engine and refit (gpu-services/bench_engine.py)', '', engine.markdown,
  ].join('\n');
  fs.writeFileSync(path.join(OUT_DIR, 'report.md'), markdown);
  fs.writeFileSync(path.join(OUT_DIR, 'report.json'), JSON.stringify({ orchestration: rows, engine: engine.json }, null, 2));
  console.log(markdown);
}

main().catch((err) => { console.error(err); process.exit(1); });
