// The math recipe (recipes/math, Env form): its env and demonstrations; episodes through
// rolloutGroup with a real engine process, stored token-exact and rewarded by the verifier; and
// evaluation (the evaluate activity) on held-out problems only.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { EVAL_GROUP_BASE, evaluate, type EvaluateResult } from '../../activities/evaluate';
import { rolloutGroup } from '../../activities/rollout';
import { groupRefs } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import type { GroupResult } from '../../activities/types';
import { contentText } from '../../agents/chat-template';
import { deriveSeed } from '../../agents/env-runner';
import { loadRecipe, REPO_ROOT } from '../../agents/recipe';
import { tokenizerFor } from '../../agents/tokenizer';
import { AgentRunner, demonstration, observationOf, reward } from '../../recipes/math/agent';
import { demonstrationProblem, Fraction, groupProblem, problemSettings, splitOf } from '../../recipes/math/problems';
import { RecordingRouter, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const RECIPE = path.join(REPO_ROOT, 'recipes', 'math');
const problemOf = (observation: string) => /^Q: (.+) Put the answer in/.exec(observation)![1];

test('the env asks the group\'s problem and rewards a boxed right answer in one step', async () => {
  const env = AgentRunner.createEnv({});
  const task = { groupIndex: 3, episode: 0, seed: deriveSeed(0, 3) };
  const p = groupProblem(task, problemSettings({}));
  const first = await env.reset(task);
  expect(first.observation).toBe(observationOf(p));
  expect(first.observation).toMatch(/^Q: .+ Put the answer in \\boxed\{\}\.\nA:$/);
  expect(await env.step({ text: ` \\boxed{${p.answer}} and more`, tokenIds: [] })).toMatchObject({ reward: 1, terminated: true });
  expect((await env.step({ text: ` ${p.answer}`, tokenIds: [] })).reward).toBe(0); // not boxed
  expect((await env.step({ text: ` \\boxed{${p.answer.add(Fraction.of(1))}}`, tokenIds: [] })).reward).toBe(0);
  expect(reward('\\boxed{1.75}', new Fraction(7n, 4n))).toBe(1);
  expect(reward('\\boxed{-1,204 dollars}', Fraction.of(-1204))).toBe(1);
});

test('demonstrations: deterministic, correct, train problems, within the recipe\'s token budgets', () => {
  const config = loadRecipe(RECIPE);
  const tokenizer = tokenizerFor(tinyModel());
  const settings = problemSettings(config.env);
  expect(demonstration(7, config.env)).toEqual(demonstration(7, config.env));
  expect(demonstration(8, config.env)).not.toEqual(demonstration(7, config.env));
  for (let i = 0; i < 300; i++) {
    const { messages } = demonstration(i, config.env);
    const p = demonstrationProblem(i, settings);
    expect(messages).toEqual([{ role: 'user', content: observationOf(p) }, { role: 'assistant', content: ` \\boxed{${p.answer}}` }]);
    expect(reward(contentText(messages[1].content), p.answer)).toBe(1);
    expect(splitOf(p.text, settings.evalFraction)).toBe('train');
    expect(tokenizer.encode(contentText(messages[1].content)).length).toBeLessThanOrEqual(config.sampling.max_tokens);
    expect(tokenizer.encode(contentText(messages[0].content) + contentText(messages[1].content)).length).toBeLessThanOrEqual(config.max_context);
  }
});

describe('with a real engine process', () => {
  let engine: Service;
  let storeRoot: string;
  beforeAll(async () => {
    engine = await startEngine(tinyModel());
    storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-math-'));
  });
  afterAll(async () => {
    await engine.stop();
    fs.rmSync(storeRoot, { recursive: true, force: true });
  });

  test('rolloutGroup: each episode is the observation\'s tokens plus the sampled ones, rewarded by the verifier', async () => {
    const config = loadRecipe(RECIPE, { group_size: '4', seed: '3' });
    const router = new RecordingRouter([engine.url], TOKEN);
    const endpoints = { engines: router.engines, actor: 'unused', token: TOKEN, storeRoot };
    const started = Date.now();
    const result = await (new MockActivityEnvironment().run(rolloutGroup, endpoints, router,
      { runId: 'm', groupIndex: 5, recipeDir: RECIPE, config }) as Promise<GroupResult>);
    const seconds = (Date.now() - started) / 1000;
    expect(result.failed).toBe(0);
    const tokenizer = tokenizerFor(tinyModel());
    const p = groupProblem({ groupIndex: 5, seed: deriveSeed(3, 5) }, problemSettings(config.env));
    const prompt = tokenizer.encode(observationOf(p));
    groupRefs('m', result).forEach((ref, e) => {
      const call = router.calls.find((c) => c.session === `m/g5/e${e}`)!;
      expect(call.body.prompt_token_ids).toEqual(prompt);
      expect(call.body.sampling.max_tokens).toBe(16);
      const { trajectory, meta } = readTrajectory(storeRoot, ref);
      expect(trajectory.tokens).toEqual([...prompt, ...call.res.token_ids]);
      expect(trajectory.lossMask).toEqual([...prompt.map(() => 0), ...call.res.token_ids.map(() => 1)]);
      expect(meta.reward).toBe(reward(tokenizer.decode(call.res.token_ids), p.answer));
    });
    console.log(`math: 4 episodes in ${seconds.toFixed(1)} s, ${result.tokens} sampled tokens, ` +
      `${prompt.length + result.tokens / 4} tokens per episode`);
  });

  test('evaluation sees held-out problems only', async () => {
    const config = loadRecipe(RECIPE, { 'eval.prompts': '6', 'eval.samples': '2' });
    const router = new RecordingRouter([engine.url], TOKEN);
    const result: EvaluateResult = await new MockActivityEnvironment().run(evaluate, router,
      { runId: 'm', step: 1, recipeDir: RECIPE, config });
    expect(result).toMatchObject({ prompts: 6, samples: 2, failed: 0 });
    expect(router.calls).toHaveLength(6 * 3); // 2 samples and a greedy episode per prompt
    const tokenizer = tokenizerFor(tinyModel());
    const seen = new Set(router.calls.map((c) => problemOf(tokenizer.decode(c.body.prompt_token_ids))));
    expect(seen.size).toBe(6);
    for (const text of seen) expect(splitOf(text, 0.1)).toBe('eval');
    for (let i = 0; i < 6; i++) {
      expect(seen.has(groupProblem({ groupIndex: EVAL_GROUP_BASE + i, seed: deriveSeed(0, EVAL_GROUP_BASE + i) },
        problemSettings(config.env)).text)).toBe(true);
    }
  });
});
