// The embedded copy task: its reward, its per-group task, and its recipe.json.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import { AgentRunner, copyReward, copyTarget } from '../../recipes/copy/agent';

test('reward is the fraction of matching positions', () => {
  expect(copyReward('abc', 'abc')).toBe(1);
  expect(copyReward('abd', 'abc')).toBeCloseTo(2 / 3);
  expect(copyReward('cab', 'abc')).toBe(0);
  expect(copyReward('a', 'abc')).toBeCloseTo(1 / 3); // short answers lose the missing positions
  expect(copyReward('abcd', 'abc')).toBe(1); // only the first three positions count
  expect(copyReward('ＡBC', 'abc')).toBe(0);
  expect(copyReward('', 'abc')).toBe(0);
});

test('the task depends only on the seed, and uses only the given letters', () => {
  expect(copyTarget(7, 'abcd', 3)).toBe(copyTarget(7, 'abcd', 3));
  const targets = new Set(Array.from({ length: 200 }, (_, s) => copyTarget(s, 'abcd', 3)));
  for (const t of targets) expect(t).toMatch(/^[abcd]{3}$/);
  expect(targets.size).toBeGreaterThan(40); // of the 64 possible
});

test('the env prompts `copy xyz>` and rewards the answer in one step', async () => {
  const env = AgentRunner.createEnv({ letters: 'abcd', length: 3 });
  const { observation } = await env.reset({ groupIndex: 0, episode: 0, seed: 11 });
  const target = copyTarget(11, 'abcd', 3);
  expect(observation).toBe(`copy ${target}>`);
  const step = await env.step({ text: target, tokenIds: [] });
  expect(step).toMatchObject({ reward: 1, terminated: true, truncated: false });
});

test('recipe.json is a valid recipe that answers exactly 3 tokens', () => {
  const config = RecipeConfig.parse(JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'recipes', 'copy', 'recipe.json'), 'utf8')));
  expect(config.sampling.max_tokens).toBe(3);
  expect(config.sampling.stop_token_ids).toEqual([]);
  expect(config.group_size).toBe(8);
  expect(fs.existsSync(path.join(REPO_ROOT, 'recipes', 'copy', config.agent))).toBe(true);
});

test('env.reverse prompts `reverse xyz>` and rewards the letters backwards', async () => {
  const env = AgentRunner.createEnv({ letters: 'abcd', length: 3, reverse: true });
  const { observation } = await env.reset({ groupIndex: 0, episode: 0, seed: 11 });
  const shown = copyTarget(11, 'abcd', 3);
  expect(observation).toBe(`reverse ${shown}>`);
  const backwards = [...shown].reverse().join('');
  expect(await env.step({ text: backwards, tokenIds: [] })).toMatchObject({ reward: 1 });
  if (backwards !== shown) expect((await env.step({ text: shown, tokenIds: [] })).reward).toBeLessThan(1);
});
