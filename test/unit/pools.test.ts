// Second model pools against real engine processes (tiny model): the engine's /score (teacher scoring), and
// the rollout activity calling a recipe's judge and teacher pools: routed on their own routers, counted in the
// group's metrics, and journaled with the episode, so a retried activity gets the earlier answers back
// without asking the pool again. recipes/judge's parsing of the judge's answer.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { callService, ServiceError } from '../../activities/gpu-client';
import { evaluate } from '../../activities/evaluate';
import { rolloutGroup, type RolloutManifest } from '../../activities/rollout';
import { groupRefs } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import type { GroupResult, ServiceEndpoints } from '../../activities/types';
import { RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { judgeView, parseJudgeScore } from '../../recipes/judge/agent';
import { tokenizerFor } from '../../agents/tokenizer';
import { freePort, RecordingRouter, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const JUDGE_DIR = path.join(REPO_ROOT, 'recipes', 'judge');
let policy: Service;
let pool: Service;
let storeRoot: string;
beforeAll(async () => {
  [policy, pool] = await Promise.all([startEngine(tinyModel()), startEngine(tinyModel())]);
  storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-pools-'));
});
afterAll(async () => {
  await Promise.all([policy?.stop(), pool?.stop()]);
  fs.rmSync(storeRoot, { recursive: true, force: true });
});

class CountingRouter extends EngineRouter {
  scored = 0;
  async score(session: string, ids: number[], signal?: AbortSignal): Promise<number[]> {
    this.scored++;
    return super.score(session, ids, signal);
  }
}

test('parseJudgeScore reads the first integer as a score out of max, and nothing else', () => {
  expect(parseJudgeScore('2', 3)).toBeCloseTo(2 / 3);
  expect(parseJudgeScore(' 3\n', 3)).toBe(1);
  expect(parseJudgeScore('score: 0/3', 3)).toBe(0);
  expect(parseJudgeScore('x1', 3)).toBeCloseTo(1 / 3);
  for (const bad of ['', 'abc', '³', '7', '12', '-']) expect(parseJudgeScore(bad, 3)).toBeNull();
});

test('judgeView shows the judge one printable character per sampled token, ? for any other', () => {
  const tokenizer = tokenizerFor(tinyModel());
  const ids = [...Buffer.from('c'), 0xff, ...Buffer.from(' '), tokenizer.tokenId('<|endoftext|>')!, ...Buffer.from('a')];
  expect(tokenizer.decode(ids)).not.toHaveLength(5); // decoded, the answer's length and positions change
  expect(judgeView(ids, tokenizer)).toBe('c???a');
});

test('POST /score gives the logprob of each given id under the plain softmax, as generate reports it', async () => {
  const prompt = [...Buffer.from('copy abc>')];
  const gen = await callService<{ token_ids: number[]; logprobs: number[] }>(policy.url, '/generate', TOKEN, {
    body: { prompt_token_ids: prompt, sampling: { max_tokens: 6, temperature: 1, seed: 3 } },
  });
  const router = new EngineRouter([policy.url], TOKEN);
  const scored = await router.score('s', [...prompt, ...gen.token_ids]);
  expect(scored).toHaveLength(prompt.length + gen.token_ids.length);
  expect(scored[0]).toBe(0);
  const diff = gen.logprobs.map((lp, i) => Math.abs(lp - scored[prompt.length + i]));
  expect(Math.max(...diff)).toBeLessThan(1e-4);
  const bad = await router.score('s', [1, 999]).catch((e) => e);
  expect(bad).toBeInstanceOf(ServiceError);
  expect((bad as ServiceError).status).toBe(400);
  expect(bad.message).toMatch(/token_ids/);
});

test('judge and teacher calls are journaled: the retried activity replays them without asking the pools', async () => {
  const config = RecipeConfig.parse({
    ...JSON.parse(fs.readFileSync(path.join(JUDGE_DIR, 'recipe.json'), 'utf8')),
    group_size: 4, pools: { judge: { model: tinyModel() }, teacher: { model: tinyModel() } }, teacher: 'teacher',
  });
  const endpoints: ServiceEndpoints = { engines: [policy.url], actor: '', token: TOKEN, storeRoot };
  const input = { runId: 'pools', groupIndex: 2, recipeDir: JUDGE_DIR, config };

  // First attempt: the judge answers every episode, then the teacher cannot be reached: the activity fails.
  const judge1 = new RecordingRouter([pool.url], TOKEN);
  const deadTeacher = new CountingRouter([`http://127.0.0.1:${await freePort()}`], TOKEN);
  const first = new MockActivityEnvironment();
  let beat: RolloutManifest | undefined;
  first.on('heartbeat', (d: RolloutManifest) => { beat = d; });
  const failed = await first.run(rolloutGroup, endpoints, new EngineRouter([policy.url], TOKEN), input,
    { judge: judge1, teacher: deadTeacher }).catch((e) => e);
  expect(failed).toBeInstanceOf(ServiceError);
  expect(judge1.calls).toHaveLength(4);
  expect(judge1.calls.every((c) => c.session.endsWith('/judge'))).toBe(true);

  // The retry: no judge call reaches the engine again, the teacher scores each episode once.
  const judge2 = new RecordingRouter([pool.url], TOKEN);
  const teacher = new CountingRouter([pool.url], TOKEN);
  const retry = new MockActivityEnvironment({ heartbeatDetails: beat });
  const result = await (retry.run(rolloutGroup, endpoints, new EngineRouter([policy.url], TOKEN), input,
    { judge: judge2, teacher }) as Promise<GroupResult>);
  expect(judge2.calls).toHaveLength(0);
  expect(teacher.scored).toBe(4);
  expect(result.rewards).toHaveLength(4);
  expect(result.metrics).toMatchObject({ 'agent/judge_calls': 4, 'pool/teacher/calls': 4 });
  expect(result.metrics!['pool/judge/calls']).toBeUndefined(); // answered from the journal
  // the rewards are the judge's first answers, parsed (unparseable: 0, counted)
  const firstAnswers = judge1.calls.map((c) => parseJudgeScore(Buffer.from(c.res.token_ids).toString('latin1'), 3));
  expect(result.metrics!['agent/judge_unparsed']).toBe(firstAnswers.filter((s) => s === null).length);

  // The teacher's logprobs of the sampled ids are stored with the trajectory (0 elsewhere).
  const { trajectory } = readTrajectory(storeRoot, groupRefs('pools', result)[0]);
  const scored = await new EngineRouter([pool.url], TOKEN).score('check', trajectory.tokens);
  trajectory.lossMask.forEach((m, i) => expect(trajectory.teacherLogprobs![i]).toBeCloseTo(m ? scored[i] : 0, 4));
});

test('a judge engine that fails inside env.step fails the activity (retried), not the episodes', async () => {
  // The recipe's env catches nothing: the router's error reaches it and it throws. Counted as the recipe's
  // failure, one pool engine's hiccup under load failed whole groups and then the run (8 of 8 episodes
  // failed, over the failure budget); it is the engine's, so the activity is retried as for the policy.
  const config = RecipeConfig.parse({
    ...JSON.parse(fs.readFileSync(path.join(JUDGE_DIR, 'recipe.json'), 'utf8')), group_size: 4,
    pools: { judge: { model: tinyModel() } },
  });
  const endpoints: ServiceEndpoints = { engines: [policy.url], actor: '', token: TOKEN, storeRoot };
  const env = new MockActivityEnvironment();
  let beat: RolloutManifest | undefined;
  env.on('heartbeat', (d: RolloutManifest) => { beat = d; });
  const deadJudge = new EngineRouter([`http://127.0.0.1:${await freePort()}`], TOKEN);
  const failed: any = await env.run(rolloutGroup, endpoints, new EngineRouter([policy.url], TOKEN),
    { runId: 'pools-dead-judge', groupIndex: 0, recipeDir: JUDGE_DIR, config }, { judge: deadJudge }).catch((e: any) => e);
  expect(failed).toBeInstanceOf(ServiceError);
  expect(failed.nonRetryable).toBeFalsy();
  expect(Object.keys(beat?.failed ?? {})).toHaveLength(0);
});

test('a judge engine that fails during evaluation fails the activity (retried), not scores 0', async () => {
  // As in rolloutGroup: before, the dead judge's error counted as the episode's and every episode scored 0.
  const config = RecipeConfig.parse({
    ...JSON.parse(fs.readFileSync(path.join(JUDGE_DIR, 'recipe.json'), 'utf8')), group_size: 2,
    pools: { judge: { model: tinyModel() } }, eval: { every: 1, prompts: 2, samples: 1 },
  });
  const deadJudge = new EngineRouter([`http://127.0.0.1:${await freePort()}`], TOKEN);
  const failed: any = await new MockActivityEnvironment().run(evaluate, new EngineRouter([policy.url], TOKEN),
    { runId: 'pools-eval-dead-judge', step: 0, recipeDir: JUDGE_DIR, config }, { judge: deadJudge }, storeRoot)
    .catch((e: any) => e);
  expect(failed).toBeInstanceOf(ServiceError);
  expect(failed.nonRetryable).toBeFalsy();
});

test('a recipe pool the worker has no engines for fails the group at once, naming it', async () => {
  const config = RecipeConfig.parse({
    ...JSON.parse(fs.readFileSync(path.join(JUDGE_DIR, 'recipe.json'), 'utf8')), group_size: 2,
    pools: { judge: { model: tinyModel() } },
  });
  const endpoints: ServiceEndpoints = { engines: [policy.url], actor: '', token: TOKEN, storeRoot };
  const failed: any = await new MockActivityEnvironment().run(rolloutGroup, endpoints, new EngineRouter([policy.url], TOKEN),
    { runId: 'pools-missing', groupIndex: 0, recipeDir: JUDGE_DIR, config }).catch((e: any) => e);
  expect(failed.message).toMatch(/pools judge have no engines on this worker/);
  expect(failed.nonRetryable).toBe(true);
});
