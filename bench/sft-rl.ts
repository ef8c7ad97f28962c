// Does something other than copying learn? (issue 16 item 4) For each recipe: an SFT warm start on its
// demonstrations (workflow sftRun), then RL from that checkpoint (trainRun with `init`), each on a fresh
// local stack through Temporal. The held-out exact-answer rate is measured on the SFT checkpoint (before RL)
// and on the final RL checkpoint: EVAL prompts from the recipe's held-out split, one greedy and one sampled
// episode each, on the stack's engine loaded with the checkpoint (POST /weights/load), with the recipe's format
// penalty set to 0 so that a reward is 1 for the exact answer and 0 otherwise. Standard errors: sqrt(p(1-p)/n).
//
//   npx tsx bench/sft-rl.ts [--recipes tool-calc,math] [--model tiny|DIR] [--sft-steps 800] [--rl-steps 30]
//                           [--eval 256] [--out docs/learning] [--set key=value,...] [--keep DIR] [--sft-from CKPT]
//
// --keep DIR copies the SFT run's checkpoints and the final RL checkpoint to DIR/<recipe>-sft and DIR/<recipe>-rl
// (the stack's folder is deleted at the end); --sft-from CKPT skips SFT and starts from that checkpoint (one that
// --keep kept), so that a long warm start is paid once for several RL runs.
//
// Writes <out>/agentic-report.md, agentic-report.json and agentic-sft-loss.png.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { parseArgs } from 'node:util';
import { Client, Connection } from '@temporalio/client';
import { MockActivityEnvironment } from '@temporalio/testing';
import { EVAL_GROUP_BASE } from '../activities/evaluate';
import { episodeRunner, loadRecipeAgent } from '../activities/rollout';
import { AgentError, deriveSeed } from '../agents/env-runner';
import { callService, ServiceError } from '../activities/gpu-client';
import { loadRecipe, REPO_ROOT, type RecipeConfig } from '../agents/recipe';
import { EngineRouter } from '../agents/router';
import type { Stack } from '../infra/stack';
import { sftRun } from '../workflows/sft-run';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../workflows/train-run';
import { withStack } from './loops';

// Per recipe (docs/learning/agentic-report.md has the runs): easier problems than recipe.json's (one template,
// small operands: the warm start of a ~1M-parameter model learns to read them in some hundred steps), a high SFT
// learning rate, and for tool-calc (episodes of ~650 tokens, mostly the tools prompt) fewer demonstrations per SFT
// step, and RL at a lower rate over 16 groups a step (4 groups at 3e-4 lowered the held-out rate).
const PLAN: Record<string, Record<string, string>> = {
  'tool-calc': { 'env.templates': '["add"]', 'env.operands': '[1,9]', 'env.max_turns': '2', 'sft.batch': '8',
    'sft.lr': '0.003', 'algo.lr': '0.0001', 'batch.groups': '16', 'pool.inflight': '20' },
  math: { 'env.templates': '["add"]', 'env.operands': '[1,9]', 'sft.batch': '16', 'sft.lr': '0.003', 'algo.lr': '0.0005' },
};

const { values: opts } = parseArgs({
  options: {
    recipes: { type: 'string', default: 'tool-calc,math' },
    model: { type: 'string', default: 'tiny' },
    'sft-steps': { type: 'string', default: '800' },
    'rl-steps': { type: 'string', default: '30' },
    eval: { type: 'string', default: '256' },
    out: { type: 'string', default: 'docs/learning' },
    set: { type: 'string', default: '' },
    keep: { type: 'string' },
    'sft-from': { type: 'string' },
  },
});

interface Held { greedy: number; sampled: number; n: number; seconds: number }
interface Result {
  recipe: string; model: string; params: number;
  sft: { steps: number; seconds: number; loss: number[]; accuracy: number[]; tokensPerStep: number };
  rl: { steps: number; seconds: number; reward: number[]; tokensPerEpisode: number; sampledPerEpisode: number };
  before: Held; after: Held;
}

const readMetrics = (stack: Stack, runId: string) => fs.readFileSync(path.join(stack.storeRoot, runId, 'metrics.jsonl'), 'utf8')
  .trim().split('\n').map((l) => JSON.parse(l) as Record<string, number>);
const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
const se = (p: number, n: number) => Math.sqrt((p * (1 - p)) / n);

// The held-out exact-answer rate of the weights in `dir`, on the stack's engine: the prompts of evaluate's
// held-out groups, EVAL_CONCURRENCY episodes at a time (all at once, one engine on loaded cores answered a
// request after more than its deadline); an episode the engine fails is run again, through a fresh router.
const EVAL_CONCURRENCY = 16;
async function heldOut(stack: Stack, recipeDir: string, config: RecipeConfig, dir: string, version: number): Promise<Held> {
  await Promise.all(stack.engines.map((e) => callService(e, '/weights/load', stack.token, { body: { path: dir, version } })));
  const started = Date.now();
  const sampled = { ...config, env: { ...config.env, format_penalty: 0 } };
  const greedy = { ...sampled, sampling: { ...sampled.sampling, temperature: 0 } };
  const { modulePath, runner } = await loadRecipeAgent(recipeDir, config);
  let router = new EngineRouter(stack.engines, stack.token);
  const n = Number(opts.eval);
  const jobs = Array.from({ length: n }, (_, i) => [greedy, sampled].map((c, k) => ({ c, i, k }))).flat();
  const rewards: number[][] = [[], []];
  const work = async () => {
    for (let job = jobs.shift(); job; job = jobs.shift()) {
      const groupIndex = EVAL_GROUP_BASE + job.i;
      const run = episodeRunner(runner, modulePath, job.c, { groupIndex, seed: deriveSeed(config.seed, groupIndex) });
      for (let attempt = 0; ; attempt++) {
        const session = `heldout/${version}/${job.i}/${job.k}/${attempt}`;
        try {
          const ep = await run(job.k, (body) => router.generate(session, body));
          rewards[job.k].push(ep.reward >= 1 ? 1 : 0);
          break;
        } catch (e) {
          // the agent or the engine refused the episode: it failed (as evaluate counts it); else the engine
          // did not answer in time: again
          if (e instanceof AgentError || (e instanceof ServiceError && e.status === 400)) { rewards[job.k].push(0); break; }
          if (attempt >= 2) throw e;
          // a router takes an engine that timed out out of rotation: a fresh one, after a pause, tries it again
          await new Promise((r) => setTimeout(r, 5000));
          router = new EngineRouter(stack.engines, stack.token);
        } finally {
          router.endSession(session);
        }
      }
    }
  };
  await new MockActivityEnvironment().run(() => Promise.all(Array.from({ length: EVAL_CONCURRENCY }, work)));
  return { greedy: mean(rewards[0]), sampled: mean(rewards[1]), n, seconds: (Date.now() - started) / 1000 };
}

async function runRecipe(recipe: string): Promise<Result> {
  const recipeDir = path.join(REPO_ROOT, 'recipes', recipe);
  const extra = Object.fromEntries(opts.set.split(/,(?![^[]*\])/).filter(Boolean)
    .map((kv) => [kv.slice(0, kv.indexOf('=')), kv.slice(kv.indexOf('=') + 1)]));
  const sftSteps = Number(opts['sft-steps']);
  const rlSteps = Number(opts['rl-steps']);
  const config = loadRecipe(recipeDir, {
    model: opts.model, 'sft.steps': String(sftSteps), 'sft.checkpoint_every': String(sftSteps), 'train.steps': String(rlSteps),
    'checkpoint.every': String(rlSteps), 'eval.every': '0', ...PLAN[recipe], ...extra,
  });
  return withStack(config, true, async (stack) => {
    const client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
    const stamp = Date.now();
    const sftId = `${recipe}-sft-${stamp}`;
    let t0 = Date.now();
    let sftCheckpoint = opts['sft-from'] ? path.resolve(opts['sft-from']) : '';
    let sftMetrics: Record<string, number>[] = [];
    let sftLosses: number[] = [];
    if (!sftCheckpoint) {
      const sft = await client.workflow.execute(sftRun, {
        workflowId: runWorkflowId(sftId), taskQueue: TASK_QUEUES.control, args: [{ runId: sftId, recipeDir, config }],
      });
      sftCheckpoint = sft.checkpoint!.path;
      sftMetrics = readMetrics(stack, sftId);
      sftLosses = sft.losses;
      console.log(`${recipe}: SFT ${sft.step} steps in ${((Date.now() - t0) / 1000).toFixed(0)} s, loss ${sft.losses[0].toFixed(3)} -> ${sft.loss?.toFixed(3)}`);
      if (opts.keep) {
        fs.cpSync(path.dirname(sftCheckpoint), path.join(opts.keep, `${recipe}-sft`), { recursive: true });
        fs.cpSync(path.join(stack.storeRoot, sftId, 'metrics.jsonl'), path.join(opts.keep, `${recipe}-sft`, 'metrics.jsonl'));
      }
    }
    const sftSeconds = (Date.now() - t0) / 1000;
    const before = await heldOut(stack, recipeDir, config, sftCheckpoint, 100_000);
    console.log(`${recipe}: before RL: greedy ${before.greedy.toFixed(3)}, sampled ${before.sampled.toFixed(3)} (n=${before.n}, ${before.seconds.toFixed(0)} s)`);

    const rlId = `${recipe}-rl-${stamp}`;
    t0 = Date.now();
    const rl = await client.workflow.execute(trainRun, {
      workflowId: runWorkflowId(rlId), taskQueue: TASK_QUEUES.control,
      args: [{ runId: rlId, recipeDir, config: { ...config, init: sftCheckpoint } }],
    });
    const rlSeconds = (Date.now() - t0) / 1000;
    const rlMetrics = readMetrics(stack, rlId);
    console.log(`${recipe}: RL ${rl.steps} steps in ${rlSeconds.toFixed(0)} s, batch reward ${rlMetrics.map((m) => m['rollout/reward_mean'].toFixed(2)).join(' ')}`);
    if (opts.keep) fs.cpSync(rl.checkpoint!, path.join(opts.keep, `${recipe}-rl`), { recursive: true });
    const after = await heldOut(stack, recipeDir, config, rl.checkpoint!, 100_001);
    console.log(`${recipe}: after ${rl.steps} RL steps (${rlSeconds.toFixed(0)} s): greedy ${after.greedy.toFixed(3)}, sampled ${after.sampled.toFixed(3)}`);
    const params = Number(execFileSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'), ['-c',
      'import sys; from safetensors.torch import load_file; print(sum(t.numel() for t in load_file(sys.argv[1]).values()))',
    path.join(sftCheckpoint, 'model.safetensors')]).toString());
    const actorKey = (m: Record<string, number>, k: string) => m[k] ?? m[`actor/${k}`];
    return {
      recipe, model: opts.model, params,
      sft: {
        steps: sftLosses.length, seconds: sftSeconds, loss: sftLosses, accuracy: sftMetrics.map((m) => m.token_accuracy),
        tokensPerStep: sftMetrics.length ? mean(sftMetrics.map((m) => m['tokens/total'])) : 0,
      },
      rl: {
        steps: rl.steps, seconds: rlSeconds, reward: rlMetrics.map((m) => m['rollout/reward_mean']),
        tokensPerEpisode: mean(rlMetrics.map((m) => actorKey(m, 'tokens/total') / actorKey(m, 'episodes'))),
        sampledPerEpisode: mean(rlMetrics.map((m) => actorKey(m, 'tokens/sampled') / actorKey(m, 'episodes'))),
      },
      before, after,
    };
  });
}

function report(results: Result[]): string {
  const pct = (p: number, n: number) => `${(100 * p).toFixed(1)}% ± ${(100 * se(p, n)).toFixed(1)}`;
  const z = (a: Held, b: Held, k: 'greedy' | 'sampled') => (b[k] - a[k]) / Math.sqrt(se(a[k], a.n) ** 2 + se(b[k], b.n) ** 2 || 1);
  const lines = [
    '# SFT warm start, then RL: held-out exact-answer rate (issue 16 item 4)', '',
    `Made by \`npx tsx bench/sft-rl.ts --recipes ${opts.recipes} --model ${opts.model} --sft-steps ${opts['sft-steps']} `
      + `--rl-steps ${opts['rl-steps']} --eval ${opts.eval}${opts.set ? ` --set ${opts.set}` : ''}\`, on a 2-core machine shared `
      + 'with other work (times are noisy). Held-out: the recipe\'s eval split, one greedy and one sampled (temperature 1) '
      + 'episode per prompt; exact answer = reward 1; ± one standard error sqrt(p(1-p)/n); z = (after - before) / '
      + 'sqrt(se_before^2 + se_after^2). Per-recipe settings besides recipe.json: '
      + Object.entries(PLAN).map(([k, v]) => `${k} ${JSON.stringify(v)}`).join('; ') + '.', '',
    '| recipe | params | SFT steps (s) | SFT loss first -> last | RL steps (s) | RL steps/s | tokens/episode (sampled) '
      + '| RL batch reward first 5 -> last 5 steps | held-out greedy before -> after (z) | held-out sampled before -> after (z) |',
    '| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |',
  ];
  for (const r of results) {
    const rw = r.rl.reward;
    lines.push(`| ${r.recipe} | ${(r.params / 1e6).toFixed(2)}M | ${r.sft.steps} (${r.sft.seconds.toFixed(0)}) `
      + `| ${r.sft.loss.length ? `${r.sft.loss[0].toFixed(3)} -> ${r.sft.loss[r.sft.loss.length - 1].toFixed(3)}` : `(${opts['sft-from']})`} `
      + `| ${r.rl.steps} (${r.rl.seconds.toFixed(0)}) `
      + `| ${(r.rl.steps / r.rl.seconds).toFixed(3)} | ${r.rl.tokensPerEpisode.toFixed(0)} (${r.rl.sampledPerEpisode.toFixed(0)}) `
      + `| ${mean(rw.slice(0, 5)).toFixed(3)} -> ${mean(rw.slice(-5)).toFixed(3)} `
      + `| ${pct(r.before.greedy, r.before.n)} -> ${pct(r.after.greedy, r.after.n)} (${z(r.before, r.after, 'greedy').toFixed(1)}) `
      + `| ${pct(r.before.sampled, r.before.n)} -> ${pct(r.after.sampled, r.after.n)} (${z(r.before, r.after, 'sampled').toFixed(1)}) |`);
  }
  lines.push('', 'SFT loss (mean cross-entropy per assistant token) every 10% of the steps:', '');
  for (const r of results.filter((x) => x.sft.loss.length)) {
    const at = Array.from({ length: 11 }, (_, i) => Math.min(r.sft.loss.length - 1, Math.round((i * (r.sft.loss.length - 1)) / 10)));
    lines.push(`- ${r.recipe}: ${at.map((i) => `${i + 1}: ${r.sft.loss[i].toFixed(3)}`).join(', ')}; `
      + `token accuracy at the end ${r.sft.accuracy[r.sft.accuracy.length - 1].toFixed(3)}`);
  }
  lines.push('', 'Curves: `agentic-sft-loss.png` (SFT loss per step, RL batch reward per step).', '');
  return lines.join('\n');
}

async function main() {
  const results: Result[] = [];
  for (const recipe of opts.recipes.split(',')) results.push(await runRecipe(recipe));
  fs.mkdirSync(opts.out, { recursive: true });
  const json = path.join(opts.out, 'agentic-report.json');
  fs.writeFileSync(json, JSON.stringify(results, null, 1));
  fs.writeFileSync(path.join(opts.out, 'agentic-report.md'), report(results));
  const plot = `
import json, sys, matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
rs = json.load(open(sys.argv[1]))
fig, ax = plt.subplots(1, 2, figsize=(10, 3.5))
for r in rs:
    ax[0].plot(range(1, len(r["sft"]["loss"]) + 1), r["sft"]["loss"], label=r["recipe"])
    ax[1].plot(range(1, len(r["rl"]["reward"]) + 1), r["rl"]["reward"], label=r["recipe"])
ax[0].set(xlabel="SFT step", ylabel="loss (nats / assistant token)", yscale="log"); ax[0].legend()
ax[1].set(xlabel="RL step", ylabel="batch mean reward"); ax[1].legend()
fig.tight_layout(); fig.savefig(sys.argv[2], dpi=100)`;
  execFileSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'), ['-c', plot, json, path.join(opts.out, 'agentic-sft-loss.png')]);
  console.log(report(results));
}

main().then(() => process.exit(0), (e) => { console.error(e); process.exit(1); });
