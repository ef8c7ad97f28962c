// The learning benchmark: does the asynchronous loop learn as well per step as the synchronous one,
// and faster per second? Each task runs sync and async on the same seeds (alternating, each on a
// fresh stack, through Temporal as a user runs it), plus async with the engines slowed by a CPU
// quota and a deeper pool, so that the data is several versions stale.
//
//   npm run bench:learning [-- --seeds 3 --first-seed 0 --tasks copy,reverse --no-slow --steps N --out DIR --set algo.lr=3e-3,...]
//
// Writes bench-out/learning/report.json (every curve), report.md (the table) and curves.png.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { parseArgs } from 'node:util';
import { Client, Connection } from '@temporalio/client';
import { loadRecipe, REPO_ROOT, type RecipeConfig } from '../agents/recipe';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../workflows/train-run';
import { withStack } from './loops';

const TARGET = 0.9; // reward a run must reach (moving average of SMOOTH steps)
const MILESTONE = 0.7; // an earlier mark, for a task that may not reach TARGET within its steps
const SMOOTH = 10;
const COLLAPSE = 0.3; // a fall of the moving average by more than this from its running max

// The tasks: the embedded recipe, and reversal (the answer is the prompt's letters backwards: the
// policy must attend to other positions than for a copy).
const TASKS: Record<string, { recipe: string; overrides: Record<string, string> }> = {
  copy: { recipe: 'recipes/copy', overrides: {} },
  reverse: { recipe: 'recipes/copy', overrides: { 'env.reverse': 'true', name: 'reverse' } },
};

interface Variant { name: string; loop: 'sync' | 'async'; slow: boolean }
const VARIANTS: Variant[] = [
  { name: 'sync', loop: 'sync', slow: false },
  { name: 'async', loop: 'async', slow: false },
  // The engine process gets a quarter of one CPU, and the pool holds 4 batches: every group waits
  // through several steps, so its tokens are 3-6 versions old when trained.
  { name: 'async-slow', loop: 'async', slow: true },
];
const ENGINE_CPU_QUOTA = 0.25;

interface Curve {
  task: string; variant: string; seed: number; seconds: number;
  step: number[]; time: number[]; reward: number[]; entropy: number[]; gapSameVersion: number[];
  staleness: Record<string, number>; // versions behind -> sampled tokens, over the run
  masked: number; // trained-on tokens masked as too stale, over the run
}

async function runOnce(task: string, v: Variant, seed: number, extra: Record<string, string>): Promise<Curve> {
  const t = TASKS[task];
  const overrides: Record<string, string> = { ...t.overrides, ...extra, seed: String(seed), loop: v.loop };
  let config: RecipeConfig = loadRecipe(path.join(REPO_ROOT, t.recipe), overrides);
  if (v.slow) config = { ...config, pool: { inflight: 4 * config.batch.groups } };
  return withStack(config, true, async (stack) => {
    const release = v.slow ? capCpu(stack.processes.get('engine-0')!.pid!, ENGINE_CPU_QUOTA) : () => {};
    try {
      const client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
      const runId = `${task}-${v.name}-s${seed}`;
      const started = Date.now();
      await client.workflow.execute(trainRun, {
        workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control,
        args: [{ runId, recipeDir: path.join(REPO_ROOT, t.recipe), config }],
      });
      const seconds = (Date.now() - started) / 1000;
      await client.connection.close();
      const lines = fs.readFileSync(path.join(stack.storeRoot, runId, 'metrics.jsonl'), 'utf8').trim().split('\n')
        .map((l) => JSON.parse(l) as Record<string, number> & { time: string });
      const staleness: Record<string, number> = {};
      for (const l of lines) {
        for (const [k, n] of Object.entries(l)) {
          if (k.startsWith('staleness/')) staleness[k.slice(10)] = (staleness[k.slice(10)] ?? 0) + Number(n);
        }
      }
      return {
        task, variant: v.name, seed, seconds,
        step: lines.map((l) => l.step),
        time: lines.map((l) => (Date.parse(l.time) - started) / 1000),
        reward: lines.map((l) => l['rollout/reward_mean']),
        entropy: lines.map((l) => l.entropy),
        gapSameVersion: lines.map((l) => l.rollout_logp_max_abs_diff_same_version ?? 0),
        staleness,
        masked: lines.reduce((n, l) => n + (l.stale_masked ?? 0), 0),
      };
    } finally {
      release();
    }
  });
}

// A CPU quota on one process (cgroup v1 or v2), as a slow engine node would be; returns the undo.
function capCpu(pid: number, cpus: number): () => void {
  const period = 100_000;
  const v1 = '/sys/fs/cgroup/cpu';
  const dir = fs.existsSync(v1) ? path.join(v1, `molt-bench-${pid}`) : `/sys/fs/cgroup/molt-bench-${pid}`;
  fs.mkdirSync(dir, { recursive: true });
  if (fs.existsSync(v1)) fs.writeFileSync(path.join(dir, 'cpu.cfs_quota_us'), String(Math.round(cpus * period)));
  else fs.writeFileSync(path.join(dir, 'cpu.max'), `${Math.round(cpus * period)} ${period}`);
  fs.writeFileSync(path.join(dir, 'cgroup.procs'), String(pid));
  return () => { try { fs.rmdirSync(dir); } catch { /* the process is gone with its stack: the group empties later */ } };
}

const movingAverage = (xs: number[], n = SMOOTH) => xs.map((_, i) => {
  const part = xs.slice(Math.max(0, i - n + 1), i + 1);
  return part.reduce((a, b) => a + b, 0) / part.length;
});

function summarize(c: Curve) {
  const ma = movingAverage(c.reward);
  const first = (level: number) => ma.findIndex((r, i) => i >= SMOOTH - 1 && r >= level);
  const [hit, mark] = [first(TARGET), first(MILESTONE)];
  let best = -Infinity;
  let worstFall = 0;
  for (const r of ma) { best = Math.max(best, r); worstFall = Math.max(worstFall, best - r); }
  const tokens = Object.values(c.staleness).reduce((a, b) => a + b, 0);
  const meanStaleness = Object.entries(c.staleness).reduce((a, [k, n]) => a + Number(k) * n, 0) / Math.max(1, tokens);
  const last = (xs: number[]) => xs.slice(-SMOOTH).reduce((a, b) => a + b, 0) / Math.min(SMOOTH, xs.length);
  return {
    task: c.task, variant: c.variant, seed: c.seed, steps: c.step.length, seconds: c.seconds,
    stepsToTarget: hit < 0 ? null : c.step[hit], secondsToTarget: hit < 0 ? null : c.time[hit],
    stepsToMilestone: mark < 0 ? null : c.step[mark], secondsToMilestone: mark < 0 ? null : c.time[mark],
    finalReward: last(c.reward), finalEntropy: last(c.entropy), maxGapSameVersion: Math.max(...c.gapSameVersion),
    worstFall, collapsed: worstFall > COLLAPSE, meanStaleness, staleness: c.staleness, masked: c.masked,
  };
}

// The async moving-average curve against the band of the sync seeds' curves, step by step.
function withinSyncBand(curves: Curve[], task: string, variant: string) {
  const sync = curves.filter((c) => c.task === task && c.variant === 'sync').map((c) => movingAverage(c.reward));
  const other = curves.filter((c) => c.task === task && c.variant === variant).map((c) => movingAverage(c.reward));
  if (!sync.length || !other.length) return null;
  const n = Math.min(...sync.map((s) => s.length), ...other.map((s) => s.length));
  let inside = 0;
  let below = 0;
  for (let i = 0; i < n; i++) {
    const lo = Math.min(...sync.map((s) => s[i]));
    const hi = Math.max(...sync.map((s) => s[i]));
    const mean = other.reduce((a, s) => a + s[i], 0) / other.length;
    if (mean >= lo && mean <= hi) inside++;
    else if (mean < lo) below++;
  }
  return { points: n, inside: inside / n, below: below / n };
}

function render(summaries: ReturnType<typeof summarize>[], bands: Record<string, ReturnType<typeof withinSyncBand>>): string {
  const f = (x: number | null, d = 0) => (x === null ? '-' : x.toFixed(d));
  const hist = (h: Record<string, number>) => {
    const total = Object.values(h).reduce((a, b) => a + b, 0);
    return Object.entries(h).sort(([a], [b]) => Number(a) - Number(b)).map(([k, n]) => `${k}:${(100 * n / total).toFixed(0)}%`).join(' ');
  };
  return [
    '# Learning: synchronous vs asynchronous loop', '',
    `Each row is one run through Temporal on a fresh stack. Reward = batch mean; "to ${TARGET}" = first step where the`,
    `${SMOOTH}-step moving average reaches ${TARGET}; final = mean of the last ${SMOOTH} steps; collapse = the moving average`,
    `fell by more than ${COLLAPSE} from its running max. async-slow: the engine capped at ${ENGINE_CPU_QUOTA} CPU and 4 batches in flight.`, '',
    `| task | loop | seed | steps | seconds | steps to ${MILESTONE} | seconds to ${MILESTONE} | steps to ${TARGET} | seconds to ${TARGET} | final reward | final entropy | max gap same version | mean staleness | staleness (versions: share of tokens) | stale-masked tokens | collapse |`,
    '|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---|',
    ...summaries.map((s) => `| ${s.task} | ${s.variant} | ${s.seed} | ${s.steps} | ${f(s.seconds)} | ${f(s.stepsToMilestone)} | ${f(s.secondsToMilestone)} | ${f(s.stepsToTarget)} | ${f(s.secondsToTarget)} | ${f(s.finalReward, 3)} | ${f(s.finalEntropy, 3)} | ${s.maxGapSameVersion.toExponential(1)} | ${f(s.meanStaleness, 2)} | ${hist(s.staleness)} | ${s.masked} | ${s.collapsed ? `yes (${f(s.worstFall, 2)})` : 'no'} |`),
    '', '## Async against the band of the sync seeds (moving average, step by step)', '',
    '| task | loop | steps compared | inside the sync band | below it |', '|---|---|---:|---:|---:|',
    ...Object.entries(bands).filter(([, b]) => b).map(([k, b]) => `| ${k.split('/')[0]} | ${k.split('/')[1]} | ${b!.points} | ${f(100 * b!.inside)}% | ${f(100 * b!.below)}% |`),
    '',
  ].join('\n');
}

async function main() {
  const { values } = parseArgs({ options: {
    seeds: { type: 'string', default: '3' }, 'first-seed': { type: 'string', default: '0' }, tasks: { type: 'string', default: 'copy,reverse' },
    'no-slow': { type: 'boolean', default: false }, steps: { type: 'string' }, variants: { type: 'string' },
    out: { type: 'string', default: path.join(REPO_ROOT, 'bench-out', 'learning') },
    set: { type: 'string', default: '' }, // recipe overrides for every run: key=value,key=value
    merge: { type: 'string' }, // report.json files of runs made apart (e.g. in parallel): one report of them all
  } });
  const OUT = path.resolve(values.out!);
  const extra = Object.fromEntries(values.set!.split(',').filter(Boolean).map((kv) => kv.split('=') as [string, string]));
  if (values.steps !== undefined) extra['train.steps'] = values.steps;
  const seeds = [...Array(Number(values.seeds)).keys()].map((i) => i + Number(values['first-seed']));
  const tasks = values.tasks!.split(',');
  for (const t of tasks) if (!TASKS[t]) throw new Error(`unknown task ${t} (${Object.keys(TASKS).join(', ')})`);
  const wanted = values.variants?.split(',') ?? VARIANTS.map((v) => v.name);
  const variants = VARIANTS.filter((v) => wanted.includes(v.name) && !(v.slow && values['no-slow']));
  fs.mkdirSync(OUT, { recursive: true });
  const curves: Curve[] = [];
  const save = () => {
    const summaries = curves.map(summarize);
    const bands: Record<string, ReturnType<typeof withinSyncBand>> = {};
    for (const t of tasks) for (const v of variants) if (v.loop === 'async') bands[`${t}/${v.name}`] = withinSyncBand(curves, t, v.name);
    fs.writeFileSync(path.join(OUT, 'report.json'), JSON.stringify({ summaries, bands, curves }, null, 1));
    fs.writeFileSync(path.join(OUT, 'report.md'), render(summaries, bands));
  };
  if (values.merge) {
    for (const file of values.merge.split(',')) curves.push(...(JSON.parse(fs.readFileSync(file, 'utf8')) as { curves: Curve[] }).curves);
    curves.sort((a, b) => a.task.localeCompare(b.task) || a.seed - b.seed || a.variant.localeCompare(b.variant));
    save();
  }
  for (const task of values.merge ? [] : tasks) {
    for (const seed of seeds) {
      // Sync and async of one seed back to back, so that both see the machine in the same state.
      for (const v of variants.filter((x) => task === 'copy' || !x.slow)) {
        console.error(`[bench:learning] ${task} ${v.name} seed ${seed}`);
        curves.push(await runOnce(task, v, seed, extra));
        save();
        const s = summarize(curves[curves.length - 1]);
        console.error(`[bench:learning]   ${s.steps} steps in ${s.seconds.toFixed(0)} s, final reward ${s.finalReward.toFixed(3)}, ` +
          `to ${TARGET}: ${s.stepsToTarget ?? '-'} steps / ${s.secondsToTarget?.toFixed(0) ?? '-'} s`);
      }
    }
  }
  execFileSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'),
    [path.join(REPO_ROOT, 'bench', 'plot_learning.py'), path.join(OUT, 'report.json'), path.join(OUT, 'curves.png')], { stdio: 'inherit' });
  console.log(fs.readFileSync(path.join(OUT, 'report.md'), 'utf8'));
}

main().catch((err) => { console.error(err); process.exit(1); });
