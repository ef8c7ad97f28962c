// The geo recipe (recipes/geo) for a few steps through the real stack: Temporal dev server, an engine and the actor
// with a tiny random-init Qwen3-VL, the worker, the stock `openai` client sending Pillow-drawn triangles as
// image_url data URLs. The tiny model reads no geometry, so this checks the mechanics: steps trained (the actor
// feeds each trajectory's stored images), the engine refit each step, each episode's image stored once with it.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { callService, type EngineHealth } from '../../activities/gpu-client';
import { readTrajectory } from '../helpers/store';
import { loadRecipe, REPO_ROOT } from '../../agents/recipe';
import { startStack, type Stack } from '../../infra/stack';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../../workflows/train-run';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'geo');
const STEPS = 3;
let stack: Stack;
afterAll(async () => { await stack?.stop(); });

test('three steps train on image episodes', async () => {
  const stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-e2e-geo-'));
  const model = path.join(stateDir, 'tiny-vlm');
  execFileSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'), ['recipes/geo/make_tiny_vlm.py', '--out', model],
    { cwd: REPO_ROOT, stdio: 'ignore' });
  const config = loadRecipe(RECIPE_DIR, {
    model, 'train.steps': String(STEPS), 'checkpoint.every': String(STEPS), 'store.keep_steps': String(STEPS),
  });
  stack = await startStack({ modelDir: model, stateDir, engines: 1, quiet: true });
  const client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
  const runId = `geo-${Date.now()}`;
  const summary = await client.workflow.execute(trainRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config }],
  });
  await client.connection.close();
  expect(summary.steps).toBe(STEPS);

  const lines = fs.readFileSync(path.join(stack.storeRoot, runId, 'metrics.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l));
  expect(lines.map((m) => m.step)).toEqual([1, 2, 3]);
  const health = await callService<EngineHealth>(stack.engines[0], '/health', stack.token, { response: 'EngineHealth' });
  expect(health.version).toBe(STEPS);
  const groupsDir = path.join(stack.storeRoot, runId, 'trajectories');
  // Written trajectories only: a group the run's end cancelled may still be writing one (a .tmp- file, renamed once whole).
  const refs = fs.readdirSync(groupsDir).flatMap((g) => fs.readdirSync(path.join(groupsDir, g))
    .filter((f) => f.endsWith('.safetensors')).map((f) => `${runId}/trajectories/${g}/${f}`));
  expect(refs.length).toBeGreaterThanOrEqual(STEPS * config.batch.groups * config.group_size);
  let imageBytes = 0;
  for (const ref of refs) {
    const { trajectory: t } = readTrajectory(stack.storeRoot, ref);
    expect(t.images).toHaveLength(1); // one picture per episode, in its own folder
    const file = path.join(stack.storeRoot, t.images![0]);
    expect(path.dirname(t.images![0])).toBe(ref.replace('/trajectories/', '/images/').replace(/-s\d+\.safetensors$/, ''));
    imageBytes += fs.statSync(file).size;
  }
  console.log(`geo e2e: ${STEPS} steps, seconds per step ${lines.map((m) => m['time/step'].toFixed(1)).join(' ')}, `
    + `reward ${lines.map((m) => m['rollout/reward_mean'].toFixed(2)).join(' ')}, stored image bytes per episode `
    + `${Math.round(imageBytes / refs.length)}`);
}, 1_500_000);
