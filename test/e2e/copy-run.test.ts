// End to end: the embedded copy recipe through the real stack — Temporal dev server, engine
// processes, the FSDP2 actor under torchrun, the worker — and what it leaves behind: the steps it
// trained (from the workflow history: what Temporal actually carried), the trajectories in the
// store, the actor's step log, the engines' versions, and whether the policy learned.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { defaultPayloadConverter } from '@temporalio/common';
import { callService, type ActorHealth, type EngineHealth } from '../../activities/gpu-client';
import { groupRefs } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import type { RefitResult, TrainStepInput } from '../../activities/types';
import { loadAgentRunner } from '../../agents/contract';
import { readSamples } from '../../client/samples';
import { copyReward } from '../../recipes/copy/agent';
import { runEnvEpisode } from '../../agents/env-runner';
import { loadRecipe, REPO_ROOT, resolveModelDir, type RecipeConfig } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { tokenizerFor } from '../../agents/tokenizer';
import { startStack, type Stack } from '../../infra/stack';
import { runWorkflowId, TASK_QUEUES, trainRun, type TrainRunSummary } from '../../workflows/train-run';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'copy');
const STEPS = 40;
// The recipe's learning rate is set for a stable climb to 0.9 over a few hundred steps (bench/learning.ts);
// this test has 40 steps to show that the policy learns at all, so it trains at 3e-3, fast and unstable later.
// Every trajectory stays in the store (store.keep_steps), so that all of them can be checked below.
const OVERRIDES = {
  'train.steps': String(STEPS), 'checkpoint.every': '20', 'engines.count': '2', 'algo.lr': '3e-3', 'store.keep_steps': String(STEPS),
};

let stack: Stack;
let client: Client;
let config: RecipeConfig;
let summary: TrainRunSummary;
let trainInputs: TrainStepInput[];
let refits: RefitResult[];
let untrainedReward: number;
const runId = `e2e-${Date.now()}`;

// Mean reward of fresh episodes (tasks never used in training: group indexes from 1e6) sampled
// from the engines' current weights, through the same env runner the rollout activity uses.
async function evaluate(tasks: number, samples: number): Promise<number> {
  const runner = await loadAgentRunner(path.join(RECIPE_DIR, config.agent));
  if (runner.kind !== 'env') throw new Error('copy recipe is an env agent');
  const router = new EngineRouter(stack.engines, stack.token);
  const tokenizer = tokenizerFor(resolveModelDir(config.model));
  const rewards = await Promise.all(Array.from({ length: tasks * samples }, async (_, i) => {
    const groupIndex = 1_000_000 + Math.floor(i / samples);
    const episode = i % samples;
    const session = `eval-${i}`;
    const result = await runEnvEpisode({
      env: runner.createEnv(config.env), tokenizer, sampling: config.sampling, maxContext: config.max_context,
      runSeed: config.seed, task: { groupIndex, episode, seed: groupIndex * 7919 + config.seed },
      generate: (body) => router.generate(session, body),
    });
    router.endSession(session);
    return result.reward;
  }));
  return rewards.reduce((a, b) => a + b, 0) / rewards.length;
}

beforeAll(async () => {
  config = loadRecipe(RECIPE_DIR, OVERRIDES);
  stack = await startStack({
    modelDir: resolveModelDir(config.model), stateDir: fs.mkdtempSync(path.join(os.tmpdir(), 'molt-e2e-')),
    engines: config.engines.count, quiet: true,
  });
  client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
  untrainedReward = await evaluate(32, 4);

  const handle = await client.workflow.start(trainRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config }],
  });
  summary = await handle.result();

  // What Temporal carried to the actor activities, read back from the histories of every run in the
  // chain (the loop continues as new when its history grows).
  trainInputs = [];
  refits = [];
  const runs = [];
  for await (const r of client.workflow.list({ query: `WorkflowId = '${runWorkflowId(runId)}'` })) runs.push(r);
  runs.sort((a, b) => a.startTime.getTime() - b.startTime.getTime());
  for (const r of runs) {
    const scheduled = new Map<string, string>(); // scheduled event id -> activity type
    for (const event of (await client.workflow.getHandle(r.workflowId, r.runId).fetchHistory()).events ?? []) {
      const sched = event.activityTaskScheduledEventAttributes;
      if (sched) {
        scheduled.set(String(event.eventId), sched.activityType?.name ?? '');
        if (sched.activityType?.name === 'trainStep') trainInputs.push(defaultPayloadConverter.fromPayload(sched.input!.payloads![0]));
      }
      const done = event.activityTaskCompletedEventAttributes;
      if (done && scheduled.get(String(done.scheduledEventId)) === 'refit') refits.push(defaultPayloadConverter.fromPayload(done.result!.payloads![0]));
    }
  }
}, 900_000);

afterAll(async () => {
  await client?.connection.close();
  await stack?.stop();
});

test('the run completes its steps, each applied exactly once at the actor', async () => {
  expect(summary.steps).toBe(STEPS);
  expect(summary.stopped).toBe(false);
  expect(trainInputs.map((t) => t.step)).toEqual(Array.from({ length: STEPS }, (_, i) => i + 1));
  const log = fs.readFileSync(path.join(stack.stateDir, 'actor', 'steps.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l));
  const mine = log.filter((e) => e.run_id === runId).map((e) => e.step);
  expect(mine).toEqual(Array.from({ length: STEPS }, (_, i) => i + 1));
  expect(fs.existsSync(path.join(summary.checkpoint!, 'model.safetensors'))).toBe(true);
});

test('every trained trajectory is in the store, token-exact, with per-token logprobs and versions', () => {
  const seen = new Set<string>();
  for (const input of trainInputs) {
    const refs = input.groups.flatMap((g) => groupRefs(runId, g));
    expect(refs.length).toBeGreaterThanOrEqual(config.batch.groups); // one episode at least per group
    for (const ref of refs) {
      expect(seen.has(ref)).toBe(false); // never trained twice
      seen.add(ref);
      const { trajectory: t, meta } = readTrajectory(stack.storeRoot, ref);
      const n = t.tokens.length;
      expect([t.logprobs.length, t.versions.length, t.lossMask.length]).toEqual([n, n, n]);
      const sampled = t.lossMask.flatMap((m, i) => (m ? [i] : []));
      expect(sampled.length).toBe(config.sampling.max_tokens);
      for (let i = 0; i < n; i++) {
        if (t.lossMask[i]) {
          expect(t.logprobs[i]).toBeLessThanOrEqual(0);
          expect(Number.isFinite(t.logprobs[i])).toBe(true);
          // A token trained at step s was sampled by a policy no newer than s - 1.
          expect(t.versions[i]).toBeGreaterThanOrEqual(0);
          expect(t.versions[i]).toBeLessThanOrEqual(input.step - 1);
        } else {
          expect([t.logprobs[i], t.versions[i]]).toEqual([0, -1]);
        }
      }
      expect(meta.run).toBe(runId);
      expect(Number(meta.reward)).toBeGreaterThanOrEqual(0);
    }
  }
});

// Invariant 3: a token sampled at version v has, under the actor at version v, the logprob the engine
// reported (fp32 on CPU). Each step's metrics measure it over the batch's tokens of the actor's version.
test('engine and actor agree on the logprobs of tokens sampled at the actor version', () => {
  const lines = fs.readFileSync(path.join(stack.storeRoot, runId, 'metrics.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l));
  expect(lines.map((m) => m.step)).toEqual(Array.from({ length: STEPS }, (_, i) => i + 1));
  const freshTokens = lines.reduce((n, m) => n + (m['staleness/0'] ?? 0), 0);
  expect(freshTokens).toBeGreaterThan(0);
  for (const m of lines) expect(m.rollout_logp_max_abs_diff_same_version).toBeLessThan(1e-3);
});

test('after each refit the engines hold the actor version', async () => {
  expect(refits.map((r) => r.version)).toEqual(Array.from({ length: STEPS }, (_, i) => i + 1));
  const actor = await callService<ActorHealth>(stack.actor, '/health', stack.token, { response: 'ActorHealth' });
  expect(actor.version).toBe(STEPS);
  for (const engine of stack.engines) {
    const health = await callService<EngineHealth>(engine, '/health', stack.token, { response: 'EngineHealth' });
    expect(health).toMatchObject({ version: STEPS, paused: false });
  }
});

test('each step leaves up to 4 decoded episodes of its batch to read, scored as the env scored them', () => {
  const samples = readSamples(runId, stack.storeRoot);
  expect(new Set(samples.map((x) => x.step))).toEqual(new Set(Array.from({ length: STEPS }, (_, i) => i + 1)));
  for (let step = 1; step <= STEPS; step++) expect(samples.filter((x) => x.step === step).length).toBeLessThanOrEqual(4);
  for (const x of samples) {
    const target = /copy ([a-d]{3})>$/.exec(x.prompt)![1];
    expect(x.reward).toBeCloseTo(copyReward(x.completion, target), 6);
  }
});

// The untrained policy is close to uniform over 259 tokens: each position matches with
// p ~ 1/259, so its mean reward over 128 episodes is ~0.004 with a standard error ~0.003. The
// best policy that ignores the prompt still scores only 0.25 (one of four letters). We ask the
// trained policy to beat the untrained one by 0.1 — over 20 standard errors of the untrained
// mean, out of reach of luck.
test('the policy learns: trained mean reward beats the untrained policy by a wide margin', async () => {
  const trainedReward = await evaluate(32, 4);
  console.log(`copy recipe: untrained reward ${untrainedReward.toFixed(3)}, after ${STEPS} steps ${trainedReward.toFixed(3)}`);
  expect(untrainedReward).toBeLessThan(0.05);
  expect(trainedReward - untrainedReward).toBeGreaterThan(0.1);
});
