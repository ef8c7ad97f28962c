// The evaluate activity against a real engine (tiny model): the pass@k figures from known episode
// rewards, a deterministic greedy pass, and its greedy reward recomputed episode by episode.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { EVAL_GROUP_BASE, evaluate, type EvaluateResult } from '../../activities/evaluate';
import { loadAgentRunner } from '../../agents/contract';
import { deriveSeed, runEnvEpisode } from '../../agents/env-runner';
import { RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { tokenizerFor } from '../../agents/tokenizer';
import { startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const COPY_DIR = path.join(REPO_ROOT, 'recipes', 'copy');
const FIXTURES = path.join(__dirname, 'fixtures');
const copyConfig = (overrides: Record<string, unknown> = {}) => RecipeConfig.parse({
  ...JSON.parse(fs.readFileSync(path.join(COPY_DIR, 'recipe.json'), 'utf8')), ...overrides,
});

let engine: Service;
beforeAll(async () => { engine = await startEngine(tinyModel()); }, 120_000);
afterAll(async () => { await engine?.stop(); });

const run = (recipeDir: string, config: RecipeConfig, step = 3): Promise<EvaluateResult> =>
  new MockActivityEnvironment().run(evaluate, new EngineRouter([engine.url], TOKEN), { runId: 'r', step, recipeDir, config });

test('pass@1 and pass@n count the samples with reward >= 1; a failed episode counts as reward 0', async () => {
  // echo-agent: reward 1 per turn (3 turns); sample episode 1 of every prompt throws. The greedy
  // episode is episode `samples` (4), so it does not.
  const config = copyConfig({ agent: 'echo-agent.ts', env: { failEpisode: 1 }, eval: { prompts: 2, samples: 4 } });
  const result = await run(FIXTURES, config);
  expect(result).toEqual({
    step: 3, prompts: 2, samples: 4, greedy_reward: 3, sample_reward_mean: (3 * 3 + 0) / 4,
    'pass@1': 3 / 4, 'pass@n': 1, failed: 2, version_min: 0, version_max: 0,
  });
});

test('greedy is deterministic and matches its episodes run one by one; pass@k is consistent with the samples', async () => {
  const config = copyConfig({ eval: { prompts: 4, samples: 3 } });
  const [a, b] = [await run(COPY_DIR, config), await run(COPY_DIR, config)];
  expect(b.greedy_reward).toBe(a.greedy_reward);

  // The greedy episodes again, outside the activity: same held-out tasks, temperature 0.
  const runner = await loadAgentRunner(path.join(COPY_DIR, config.agent));
  if (runner.kind !== 'env') throw new Error('copy is an Env agent');
  const router = new EngineRouter([engine.url], TOKEN);
  const greedy = await Promise.all([0, 1, 2, 3].map(async (i) => {
    const groupIndex = EVAL_GROUP_BASE + i;
    const result = await runEnvEpisode({
      env: runner.createEnv(config.env), tokenizer: tokenizerFor(tinyModel()), sampling: { ...config.sampling, temperature: 0 },
      maxContext: config.max_context, runSeed: config.seed, task: { groupIndex, episode: 3, seed: deriveSeed(config.seed, groupIndex) },
      generate: (body) => router.generate(`check-${i}`, body),
    });
    return result.reward;
  }));
  expect(a.greedy_reward).toBeCloseTo(greedy.reduce((x, y) => x + y, 0) / 4, 12);

  for (const r of [a, b]) {
    const passed = r['pass@1'] * r.prompts * r.samples; // samples with reward >= 1
    expect(Math.abs(passed - Math.round(passed))).toBeLessThan(1e-9);
    expect(r['pass@1']).toBeLessThanOrEqual(r['pass@n']);
    expect(r['pass@n']).toBeLessThanOrEqual(Math.min(1, r['pass@1'] * r.samples));
    expect(r['pass@1']).toBeLessThanOrEqual(r.sample_reward_mean); // copy rewards lie in [0, 1]
    expect(r).toMatchObject({ failed: 0, version_min: 0, version_max: 0 });
  }
  const noGreedy = await run(COPY_DIR, copyConfig({ eval: { prompts: 1, samples: 1, greedy: false } }));
  expect(noGreedy.greedy_reward).toBeNull();
}, 60_000);
