// The code recipe (recipes/code) for a few steps through the real stack: Temporal dev server, an engine and
// the actor with the tiny model, the worker, and every episode's answer scored in the sandbox. The tiny
// random model writes no working code, so this checks the mechanics: steps trained, and each trained
// trajectory's reward is what the sandbox gives its decoded answer.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { readTrajectory } from '../helpers/store';
import { deriveSeed } from '../../agents/env-runner';
import { loadRecipe, REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { tokenizerFor } from '../../agents/tokenizer';
import { startStack, type Stack } from '../../infra/stack';
import { codeTask, scoreSolution } from '../../recipes/code/agent';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../../workflows/train-run';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'code');
const STEPS = 3;
let stack: Stack;
afterAll(async () => { await stack?.stop(); });

test('three steps train on sandbox-scored episodes', async () => {
  const config = loadRecipe(RECIPE_DIR, {
    'train.steps': String(STEPS), 'checkpoint.every': String(STEPS), group_size: '4', 'batch.groups': '2',
    'pool.inflight': '3', 'sampling.max_tokens': '24', 'store.keep_steps': String(STEPS),
  });
  stack = await startStack({
    modelDir: resolveModelDir(config.model), stateDir: fs.mkdtempSync(path.join(os.tmpdir(), 'molt-e2e-code-')), engines: 1, quiet: true,
  });
  const client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
  const runId = `code-${Date.now()}`;
  const summary = await client.workflow.execute(trainRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config }],
  });
  await client.connection.close();
  expect(summary.steps).toBe(STEPS);

  const lines = fs.readFileSync(path.join(stack.storeRoot, runId, 'metrics.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l));
  expect(lines.map((m) => m.step)).toEqual([1, 2, 3]);
  const tokenizer = tokenizerFor(resolveModelDir(config.model));
  const groupsDir = path.join(stack.storeRoot, runId, 'trajectories');
  // Written trajectories only: a group the run's end cancelled may still be writing one (a .tmp- file, renamed once whole).
  const refs = fs.readdirSync(groupsDir).flatMap((g) => fs.readdirSync(path.join(groupsDir, g))
    .filter((f) => f.endsWith('.safetensors')).map((f) => `${runId}/trajectories/${g}/${f}`));
  expect(refs.length).toBeGreaterThanOrEqual(STEPS * 2 * 4);
  for (const ref of refs.slice(0, 8)) {
    const { trajectory: t, meta } = readTrajectory(stack.storeRoot, ref);
    const answer = tokenizer.decode(t.tokens.filter((_, i) => t.lossMask[i]));
    const prompt = tokenizer.decode(t.tokens.filter((_, i) => !t.lossMask[i]));
    const task = codeTask(deriveSeed(config.seed, Number(meta.group)));
    expect(prompt.endsWith(task.prompt)).toBe(true);
    expect(Number(meta.reward)).toBe((await scoreSolution(answer, task)).reward);
  }
}, 900_000);
