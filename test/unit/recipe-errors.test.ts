// A recipe whose generator, verifier or tool throws (issue 16 item 5): the episode fails with an error
// naming the recipe, the file and line that threw, and the episode; failed episodes count against
// rollout.max_failed_fraction. TypeScript agents (fixtures/buggy-agent.ts, the math recipe itself) and
// a Python one (fixtures/py-chat.py), through rolloutGroup with a real engine process.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { rolloutGroup, type RolloutManifest } from '../../activities/rollout';
import type { GroupResult } from '../../activities/types';
import { loadRecipe, RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const FIXTURES = path.join(__dirname, 'fixtures');
let engine: Service;
let root: string;
beforeAll(async () => {
  engine = await startEngine(tinyModel());
  root = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-recipe-errors-'));
});
afterAll(async () => {
  await engine.stop();
  fs.rmSync(root, { recursive: true, force: true });
});

const config = (agent: string, env: Record<string, unknown>, budget = 1) => RecipeConfig.parse({
  name: 'buggy', agent, model: 'tiny', group_size: 3, pool: { inflight: 1 }, batch: { groups: 1 }, train: { steps: 1 },
  checkpoint: { every: 1 }, sampling: { max_tokens: 3 }, algo: {}, env, rollout: { max_failed_fraction: budget },
});

async function run(runId: string, cfg: RecipeConfig, recipeDir = FIXTURES) {
  const endpoints = { engines: [engine.url], actor: 'unused', token: TOKEN, storeRoot: path.join(root, 'store') };
  const env = new MockActivityEnvironment();
  const beats: RolloutManifest[] = [];
  env.on('heartbeat', (d) => beats.push(JSON.parse(JSON.stringify(d))));
  const result = await (env.run(rolloutGroup, endpoints, new EngineRouter([engine.url], TOKEN),
    { runId, groupIndex: 0, recipeDir, config: cfg }) as Promise<GroupResult>);
  return { result, failed: beats[beats.length - 1].failed };
}

// The line of a fixture marked with `marker`.
const lineOf = (file: string, marker: string) =>
  fs.readFileSync(path.join(FIXTURES, file), 'utf8').split('\n').findIndex((l) => l.includes(marker)) + 1;

test('a generator or verifier that throws: its episode fails, named by recipe, file:line and episode', async () => {
  const generator = await run('gen', config('buggy-agent.ts', { bug: 'generator' }));
  expect([generator.result.failed, generator.result.rewards]).toEqual([1, [1, 1]]);
  expect(generator.failed[1]).toBe(`recipe buggy (test/unit/fixtures/buggy-agent.ts:${lineOf('buggy-agent.ts', 'THROWS: generator')}), ` +
    'group 0 episode 1: env reset threw: generator bug');
  const verifier = await run('ver', config('buggy-agent.ts', { bug: 'verifier' }));
  expect(verifier.failed[1]).toBe(`recipe buggy (test/unit/fixtures/buggy-agent.ts:${lineOf('buggy-agent.ts', 'THROWS: verifier')}), ` +
    'group 0 episode 1: env step threw: verifier bug');
});

test('over the failure budget the group stops the run, with the same message', async () => {
  await expect(run('gen-over', config('buggy-agent.ts', { bug: 'generator' }, 0.2))).rejects.toMatchObject({
    name: 'ApplicationFailure', nonRetryable: true, type: 'FailureBudgetExceeded',
    message: 'group 0: 1 of 3 episodes failed, over the failure budget rollout.max_failed_fraction=0.2; recipe buggy ' +
      `(test/unit/fixtures/buggy-agent.ts:${lineOf('buggy-agent.ts', 'THROWS: generator')}), group 0 episode 1: env reset threw: generator bug`,
  });
});

test('a chat agent\'s tool that throws fails each episode, named; all of them are over the budget', async () => {
  const tool = `recipe buggy \\(test/unit/fixtures/buggy-agent\\.ts:${lineOf('buggy-agent.ts', 'THROWS: tool')}\\), group 0 episode \\d: ` +
    'chat agent run\\(\\) failed: tool bug on 1\\+1';
  const within = await run('tool', config('buggy-chat-agent.ts', {}));
  expect(within.result.failed).toBe(3);
  for (const e of [0, 1, 2]) expect(within.failed[e]).toMatch(new RegExp(`^${tool.replace('\\d', String(e))}$`));
  await expect(run('tool-over', config('buggy-chat-agent.ts', {}, 0.5)))
    .rejects.toMatchObject({ type: 'FailureBudgetExceeded', message: expect.stringMatching(new RegExp(`3 of 3 episodes failed.*; ${tool}$`)) });
});

test('a Python tool that raises: the message names the Python file and line, the recipe and the episode', async () => {
  const { result, failed } = await run('py-tool', config('py-chat-agent.ts', {}));
  expect(result.failed).toBe(3);
  for (const e of [0, 1, 2]) {
    expect(failed[e].split('\n')[0]).toBe(`recipe buggy (test/unit/fixtures/py-chat-agent.ts), group 0 episode ${e}: chat agent run() failed: ` +
      `python test/unit/fixtures/py-chat.py: run(): ZeroDivisionError: division by zero (test/unit/fixtures/py-chat.py:${lineOf('py-chat.py', 'RAISES')}, in tool)`);
  }
});

test('the math recipe with a bad setting: its own check, in its own file, names the setting', async () => {
  const recipeDir = path.join(REPO_ROOT, 'recipes', 'math');
  const problems = fs.readFileSync(path.join(recipeDir, 'problems.ts'), 'utf8').split('\n');
  const line = problems.findIndex((l) => l.includes('throw new Error(`env.eval_fraction must be')) + 1;
  const { result, failed } = await run('math-bad', loadRecipe(recipeDir, { group_size: '2', 'env.eval_fraction': '2', 'rollout.max_failed_fraction': '1' }), recipeDir);
  expect(result.failed).toBe(2);
  expect(failed[0]).toBe(`recipe math (recipes/math/problems.ts:${line}), group 0 episode 0: createEnv: ` +
    'env.eval_fraction must be a number in (0, 1), got 2');
});
