// `npm run bench`: Molt against the plain loops it replaces, each figure beside a baseline measured
// in the same run (bench/*.ts):
//   1. orchestration overhead: the trainRun workflow vs a plain in-process loop over the same
//      activities, the same pool and fresh identical stacks, at two workloads and several pool sizes;
//   2. engine utilization and trained tokens/s: streaming pool vs synchronous generate-then-train;
//   3. partial rollouts: tokens discarded at refit, pause mode keep vs abort (+ regenerate);
//   4. orchestration scale: the real workflows with instant activities, 16..10,000 groups in flight;
//   5. engine and refit: bench/engine.py.
// Writes bench-out/report.md and bench-out/report.json.
//
//   npm run bench [-- --steps 8] [-- --smoke]     (--smoke: tiny sizes, checks the report is produced)
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { loadRecipe, REPO_ROOT } from '../agents/recipe';
import { efficiencyOf } from './efficiency';
import { plainLoop, RECIPE_DIR, temporalLoop, type LoopResult } from './loops';
import { partialRollouts, type PartialOptions, type PartialResult } from './partial';
import { orchestrationScale, type ScaleRow } from './scale';

const OUT_DIR = path.join(REPO_ROOT, 'bench-out');

interface Workload { name: string; overrides: Record<string, string>; pools: number[] } // pools: pool.inflight values to run

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) / 2)];

function engineBench(smoke: boolean): { markdown: string; json: unknown } {
  const out = path.join(OUT_DIR, 'engine.json');
  const res = spawnSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'), ['bench/engine.py', '--out', out, ...(smoke ? ['--smoke'] : [])],
    { cwd: REPO_ROOT, encoding: 'utf8', env: { ...process.env, OMP_NUM_THREADS: '1' } });
  if (res.status !== 0) throw new Error(`bench/engine.py failed:\n${res.stderr}`);
  return { markdown: res.stdout, json: JSON.parse(fs.readFileSync(out, 'utf8')) };
}

async function main() {
  const argv = process.argv.slice(2);
  const smoke = argv.includes('--smoke');
  const stepsArg = argv.indexOf('--steps');
  const steps = String(stepsArg >= 0 ? Number(argv[stepsArg + 1]) : smoke ? 2 : 8);
  const reps = smoke ? 1 : 2; // plain and Temporal alternate, each `reps` times; medians are reported
  const workloads: Workload[] = smoke
    ? [{ name: 'smoke', overrides: { 'batch.groups': '2', group_size: '2' }, pools: [3] }]
    : [
      { name: 'embedded recipe (16 groups x 8, 3 tokens)', overrides: {}, pools: [24, 96] },
      // Heavier: 4x the episodes of 10x the tokens, so a plain step takes seconds on 2 cores.
      { name: 'heavier (32 groups x 16, 32 tokens)', overrides: { 'batch.groups': '32', group_size: '16', 'sampling.max_tokens': '32' }, pools: [48] },
    ];
  const partialOptions: PartialOptions = smoke
    ? { requests: 4, maxTokens: 64, refits: 2, intervalMs: 50 }
    : { requests: 32, maxTokens: 384, refits: 4, intervalMs: 500 };
  const scaleSizes = smoke ? [4, 8] : [16, 256, 1024, 4096, 10_000];
  fs.mkdirSync(OUT_DIR, { recursive: true });

  // The report is rewritten after each part, so a long run shows what it has so far.
  const report: Report = { orchestration: [], drain: null, utilization: [], partial: [], scale: [], engine: null };
  const save = () => {
    const markdown = render(report, partialOptions, smoke);
    fs.writeFileSync(path.join(OUT_DIR, 'report.md'), markdown);
    fs.writeFileSync(path.join(OUT_DIR, 'report.json'), JSON.stringify(report, null, 2));
    return markdown;
  };
  for (const w of workloads) {
    const config = (pool: number) => loadRecipe(RECIPE_DIR, { ...w.overrides, 'pool.inflight': String(pool), 'train.steps': steps, 'checkpoint.every': '1000' });
    for (const [i, pool] of w.pools.entries()) {
      const plains: LoopResult[] = [];
      const temporals: LoopResult[] = [];
      for (let rep = 1; rep <= reps; rep++) {
        console.error(`[bench] ${w.name}, ${pool} groups in flight, run ${rep}/${reps}: plain loop`);
        plains.push(await plainLoop(config(pool), 'streaming'));
        console.error(`[bench] ${w.name}, ${pool} groups in flight, run ${rep}/${reps}: Temporal loop`);
        temporals.push(await temporalLoop(config(pool)));
      }
      const n = Number(steps);
      const plainSeconds = median(plains.map((r) => r.seconds));
      const temporalSeconds = median(temporals.map((r) => r.seconds));
      report.orchestration.push({
        workload: w.name, inflight: pool, steps: n, runs: reps, plainMsPerStep: (plainSeconds * 1000) / n, temporalMsPerStep: (temporalSeconds * 1000) / n,
        addedMsPerStep: ((temporalSeconds - plainSeconds) * 1000) / n, ratio: temporalSeconds / plainSeconds,
        ratios: temporals.map((t, k) => t.seconds / plains[k].seconds),
        serverCpuPerStep: median(temporals.map((t) => t.cpu!.server)) / n, controlWorkerCpuPerStep: median(temporals.map((t) => t.cpu!.controlWorker)) / n,
        batchGroups: config(pool).batch.groups,
      });
      save();
      if (i > 0) continue;
      if (w === workloads[0]) {
        // The price of continue-as-new: the run drains its pool first (an activity cannot outlive
        // its run). Against the Temporal runs above, with continue-as-new after every n/2 steps.
        const every = Math.max(1, Math.floor(n / 2));
        const continueAsNew = Math.ceil(n / every) - 1;
        console.error(`[bench] ${w.name}: Temporal loop, continue-as-new every ${every} steps`);
        const drained = await temporalLoop(config(pool), every);
        report.drain = {
          workload: w.name, inflight: pool, steps: n, every, continueAsNew,
          msPerStep: (drained.seconds * 1000) / n, withoutMsPerStep: (temporalSeconds * 1000) / n,
          addedMsPerContinueAsNew: (drained.seconds - temporalSeconds) * 1000 / continueAsNew,
        };
        save();
      }
      // Streaming vs the synchronous baseline (the same config, batch.groups in flight, refilled
      // after each step), both with the engines on CPU 0 and the actor on CPU 1: on a cluster each
      // has its own GPU, and what streaming buys is generating while the actor trains.
      console.error(`[bench] ${w.name}: streaming and synchronous plain loops, engines and actor on their own CPUs`);
      const streaming = await plainLoop(config(pool), 'streaming', true);
      const sync = await plainLoop(config(pool), 'sync', true);
      report.utilization.push({
        workload: w.name, inflight: pool, streamingBusy: streaming.engineBusy!, syncBusy: sync.engineBusy!, busyRatio: streaming.engineBusy! / sync.engineBusy!,
        streamingTokensPerSecond: streaming.trainedTokens / streaming.seconds, syncTokensPerSecond: sync.trainedTokens / sync.seconds,
        throughputRatio: (streaming.trainedTokens / streaming.seconds) / (sync.trainedTokens / sync.seconds),
        ...(({ gen, train, ideal, efficiency, steadyEfficiency }) => ({ gen, train, ideal, efficiency, steadyEfficiency }))(efficiencyOf(streaming, sync)),
      });
      save();
    }
  }

  console.error('[bench] partial rollouts across refits: keep vs abort');
  report.partial = await partialRollouts(loadRecipe(RECIPE_DIR), partialOptions);
  save();
  // Steps per size: enough groups for a steady state; a size still running after the budget is cut off.
  // From 1,024 in flight a run continues as new (draining its pool) every ~4-8 steps of 512-2,048 groups:
  // 4 steps measured the ramp-up (671 trajectories/s at 10,000, against ~1,300 over 13 steps).
  report.scale = await orchestrationScale(scaleSizes, (inflight) => (smoke ? 3 : inflight <= 16 ? 10 : inflight <= 256 ? 6 : 12),
    (inflight) => (smoke ? 60 : Math.max(75, inflight / 15)));
  save();
  console.error('[bench] engine and refit: bench/engine.py');
  const engine = engineBench(smoke);
  report.engine = engine.json;
  report.engineMarkdown = engine.markdown;
  console.log(save());
}

interface Report {
  orchestration: {
    workload: string; inflight: number; steps: number; runs: number; plainMsPerStep: number; temporalMsPerStep: number; addedMsPerStep: number; ratio: number;
    ratios: number[]; serverCpuPerStep: number; controlWorkerCpuPerStep: number; batchGroups: number;
  }[];
  drain: { workload: string; inflight: number; steps: number; every: number; continueAsNew: number; msPerStep: number; withoutMsPerStep: number; addedMsPerContinueAsNew: number } | null;
  utilization: {
    workload: string; inflight: number; streamingBusy: number; syncBusy: number; busyRatio: number;
    streamingTokensPerSecond: number; syncTokensPerSecond: number; throughputRatio: number;
    gen: number; train: number; ideal: number; efficiency: number; steadyEfficiency: number;
  }[];
  partial: PartialResult[];
  scale: ScaleRow[];
  engine: unknown;
  engineMarkdown?: string;
}

function render(report: Report, partialOptions: PartialOptions, smoke: boolean): string {
  const f = (x: number | null, d = 0) => (x === null || Number.isNaN(x) ? '-' : x.toFixed(d)); // NaN: too few steps
  const [keep, abort] = report.partial;
  return [
    '# Molt benchmarks', '',
    '## 1. Orchestration overhead: Temporal loop vs plain in-process loop (same activities, same pool, fresh stacks)', '',
    'Plain and Temporal runs alternate; the figures are medians over the runs. CPU: seconds burnt per step, while the Temporal loop ran, by the Temporal dev server and by the worker running the loop\'s workflow tasks (they share the 2 cores with the engines and the actor).', '',
    '| workload | groups in flight | steps | runs | plain ms/step | Temporal ms/step | added ms/step | ratio | ratio of each run | server CPU s/step | control worker CPU s/step | per group trained: server + worker CPU ms |',
    '|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|',
    ...report.orchestration.map((r) => `| ${r.workload} | ${r.inflight} | ${r.steps} | ${r.runs} | ${f(r.plainMsPerStep)} | ${f(r.temporalMsPerStep)} | ${f(r.addedMsPerStep)} | ${f(r.ratio, 2)} | ${r.ratios.map((x) => f(x, 2)).join(', ')} | ${f(r.serverCpuPerStep, 3)} | ${f(r.controlWorkerCpuPerStep, 3)} | ${f((r.serverCpuPerStep * 1000) / r.batchGroups, 1)} + ${f((r.controlWorkerCpuPerStep * 1000) / r.batchGroups, 1)} |`),
    ...(report.drain ? ['', `Continue-as-new drains the pool first (${report.drain.workload}, ${report.drain.inflight} in flight): with continue-as-new every ${report.drain.every} steps (${report.drain.continueAsNew} in ${report.drain.steps} steps) ${f(report.drain.msPerStep)} ms/step against ${f(report.drain.withoutMsPerStep)} without, ${f(report.drain.addedMsPerContinueAsNew)} ms per continue-as-new. A real run continues as new when Temporal suggests it: every few thousand history events.`] : []),
    '', '## 2. Engine utilization: streaming pool vs synchronous (generate, then train, then generate), plain loops, same config', '',
    'Engines pinned to CPU 0 and the actor to CPU 1 in both (on a cluster each has its own GPU). Busy = fraction of wall time each engine has a /generate request in flight, refit pauses excluded (measured client-side). Ideal = the sync rate x (gen + train) / max(gen, train), gen and train being the sync loop\'s own mean seconds per batch generated and per step trained + refit; efficiency = streaming / ideal; steady: the same over the steps after the second, without the pool\'s fill (bench/efficiency.ts runs this part alone).', '',
    '| workload | groups in flight | busy streaming | busy sync | ratio | trained tok/s streaming | trained tok/s sync | ratio | sync gen / train s | ideal tok/s | efficiency | steady efficiency |',
    '|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|',
    ...report.utilization.map((r) => `| ${r.workload} | ${r.inflight} | ${f(r.streamingBusy, 2)} | ${f(r.syncBusy, 2)} | ${f(r.busyRatio, 2)} | ${f(r.streamingTokensPerSecond)} | ${f(r.syncTokensPerSecond)} | ${f(r.throughputRatio, 2)} | ${f(r.gen, 2)} / ${f(r.train, 2)} | ${f(r.ideal)} | ${f(r.efficiency, 2)} | ${f(r.steadyEfficiency, 2)} |`),
    '', `## 3. Partial rollouts: ${partialOptions.requests} generations of ${partialOptions.maxTokens} tokens, a refit every ${partialOptions.intervalMs} ms (at most ${partialOptions.refits})`, '',
    'abort is the baseline without partial rollouts: an aborted generation is regenerated from scratch.', '',
    '| pause mode | refits | useful tokens | discarded tokens | regenerated | most versions in one generation | seconds |', '|---|---:|---:|---:|---:|---:|---:|',
    ...report.partial.map((r) => `| ${r.mode} | ${r.refits} | ${r.usefulTokens} | ${r.discardedTokens} | ${r.regenerated} | ${r.maxVersionsInOne} | ${f(r.seconds, 2)} |`),
    ...(keep && abort ? ['', `Discarded: ${keep.discardedTokens} with keep vs ${abort.discardedTokens} with abort; time abort/keep ${f(abort.seconds / keep.seconds, 2)}.`] : []),
    '', '## 4. Orchestration scale: real workflows on the dev server, instant activities (no model work), batch = in flight / 2 (at most 2,048 groups)', '',
    'Past 256 groups in flight the pool runs the rest in rollout shards (child workflows of 256 groups each, workflows/rollout-pool.ts); the run\'s history counts its own events only.', '',
    'Trajectories/s over the steps after the first; a size cut off at its time budget is measured on the steps it did. Each of the run\'s executions after the first began with a continue-as-new, which drained the pool: the long steps.', '',
    '| groups in flight | rollout shards | run executions | steps done | finished | seconds | trajectories/s | steps/s | run history events/step | run events/group trained | run history bytes/group trained | worker CPU s/step | server CPU s/step | CPU ms/episode (server + worker) | cores busy | seconds of each step after the first |',
    '|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|',
    ...report.scale.map((r) => `| ${r.inflight} | ${r.shards} | ${r.executions} | ${r.steps} | ${r.finished ? 'yes' : 'no'} | ${f(r.seconds)} | ${f(r.trajectoriesPerSecond)} | ${f(r.stepsPerSecond, 2)} | ${f(r.eventsPerStep)} | ${f(r.eventsPerGroup, 1)} | ${f(r.historyBytesPerGroup)} | ${f(r.workerCpuPerStep, 2)} | ${f(r.serverCpuPerStep, 2)} | ${f(r.cpuMsPerEpisode, 2)} | ${f(r.coresBusy, 2)} | ${r.stepSeconds.map((x) => x.toFixed(1)).join(' ')} |`),
    '', '## 5. Engine and refit (bench/engine.py)', '', report.engineMarkdown ?? '(not run yet)\n',
  ].join('\n');
}

main().catch((err) => { console.error(err); process.exit(1); });
