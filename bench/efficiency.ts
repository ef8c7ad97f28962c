// Async efficiency (part 2 of bench/run.ts alone, for one workload): the streaming loop's trained
// tokens/s against the ideal overlap of the synchronous loop measured in the same run,
//   ideal = sync tokens/s x (gen + train) / max(gen, train),
// gen and train being the sync loop's own mean generation time per batch and train + refit time per
// step. Engines on CPU 0, actor on CPU 1; streaming and sync alternate `--reps` times, medians shown.
// Also at the steady rate, the same ratio over the steps after the first WARM_STEPS: a run of days sees
// the streaming loop there, while a short one pays for filling its pool, groups generated and never
// trained by its last step (up to pool.inflight in flight and batch.groups ready: up to 40 groups against
// the 128 trained in 8 steps of the 3x-generation workload).
//
//   npx tsx bench/efficiency.ts [--workload heavier|gen3x] [--steps 6] [--reps 2] [--streaming-only]
import { loadRecipe } from '../agents/recipe';
import { plainLoop, RECIPE_DIR, type LoopResult } from './loops';

// heavier: bench/run.ts's heavier workload. gen3x: 96 sampled tokens per episode on half the episodes,
// so the engines' decode steps (sequential, 3x as many) outweigh the actor's one forward + backward.
export const WORKLOADS: Record<string, Record<string, string>> = {
  heavier: { 'batch.groups': '32', group_size: '16', 'sampling.max_tokens': '32', 'pool.inflight': '48' },
  gen3x: { 'batch.groups': '16', group_size: '16', 'sampling.max_tokens': '96', max_context: '128', 'pool.inflight': '24' },
};

export interface Efficiency {
  streamingTokensPerSecond: number; syncTokensPerSecond: number; gen: number; train: number; ideal: number; efficiency: number;
  steadyStreaming: number; steadySync: number; steadyIdeal: number; steadyEfficiency: number; // NaN with too few steps
}

export const WARM_STEPS = 2;
// Tokens trained per second from the end of step WARM_STEPS to the end of the last step.
const steadyRate = (r: LoopResult) => {
  const [ends, tokens] = [r.stepEnds!, r.stepTokens!];
  return tokens.slice(WARM_STEPS).reduce((a, b) => a + b, 0) / (ends[ends.length - 1] - ends[WARM_STEPS - 1]);
};

export const efficiencyOf = (streaming: LoopResult, sync: LoopResult): Efficiency => {
  const [s, y] = [streaming.trainedTokens / streaming.seconds, sync.trainedTokens / sync.seconds];
  const [gen, train] = [sync.waitSeconds!, sync.trainSeconds!];
  const overlap = (gen + train) / Math.max(gen, train);
  const [steadyStreaming, steadySync] = [steadyRate(streaming), steadyRate(sync)];
  return {
    streamingTokensPerSecond: s, syncTokensPerSecond: y, gen, train, ideal: y * overlap, efficiency: s / (y * overlap),
    steadyStreaming, steadySync, steadyIdeal: steadySync * overlap, steadyEfficiency: steadyStreaming / (steadySync * overlap),
  };
};

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor((xs.length - 1) / 2)];

async function main() {
  const arg = (name: string, fallback: string) => {
    const i = process.argv.indexOf(`--${name}`);
    return i >= 0 ? process.argv[i + 1] : fallback;
  };
  const workload = arg('workload', 'heavier');
  if (!WORKLOADS[workload]) throw new Error(`--workload ${workload}: expected one of ${Object.keys(WORKLOADS).join(', ')}`);
  const config = loadRecipe(RECIPE_DIR, { ...WORKLOADS[workload], 'train.steps': arg('steps', '6'), 'checkpoint.every': '1000' });
  const rows: Efficiency[] = [];
  const show = (mode: string, r: LoopResult) => console.error(`[efficiency] ${mode}: ${(r.trainedTokens / r.seconds).toFixed(0)} tok/s, `
    + `${(r.seconds / config.train.steps).toFixed(2)} s/step, wait ${r.waitSeconds!.toFixed(2)} s, train+refit ${r.trainSeconds!.toFixed(2)} s, `
    + `busy ${r.engineBusy!.toFixed(2)}; CPU s/step node ${r.cpuPerStep!.node.toFixed(2)} engines ${r.cpuPerStep!.engines.toFixed(2)} `
    + `actor ${r.cpuPerStep!.actor.toFixed(2)}; idle s/step per core ${r.idlePerStep!.map((x) => x.toFixed(2)).join(' ')}`);
  for (let rep = 1; rep <= Number(arg('reps', '2')); rep++) {
    const streaming = await plainLoop(config, 'streaming', true);
    show('streaming', streaming);
    if (process.argv.includes('--streaming-only')) continue; // e.g. to profile this process
    const sync = await plainLoop(config, 'sync', true);
    show('sync', sync);
    const e = efficiencyOf(streaming, sync);
    rows.push(e);
    console.error(`[efficiency] ${workload} run ${rep}: streaming ${e.streamingTokensPerSecond.toFixed(0)} / ideal ${e.ideal.toFixed(0)} `
      + `(sync ${e.syncTokensPerSecond.toFixed(0)}, gen ${e.gen.toFixed(2)} s, train ${e.train.toFixed(2)} s) = ${e.efficiency.toFixed(3)}; `
      + `steady (after step ${WARM_STEPS}): ${e.steadyStreaming.toFixed(0)} / ${e.steadyIdeal.toFixed(0)} (sync ${e.steadySync.toFixed(0)}) = ${e.steadyEfficiency.toFixed(3)}`);
  }
  if (!rows.length) return;
  const m = (k: keyof Efficiency) => median(rows.map((r) => r[k]));
  console.log(JSON.stringify({ workload, runs: rows.length, median: Object.fromEntries(Object.keys(rows[0]).map((k) => [k, m(k as keyof Efficiency)])), rows }));
}

if (require.main === module) main().catch((err) => { console.error(err); process.exit(1); });
