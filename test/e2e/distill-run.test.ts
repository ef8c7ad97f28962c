// Second model pools, end to end: recipes/distill through the real stack with a teacher pool beside the
// policy's engine. The teacher is the tiny model taught the copy task by a few supervised steps
// (recipes/distill/make_teacher.py); the student starts from the tiny model's random init. The actor trains on
// on_policy_distill advantages from the teacher pool's scores of the exact sampled ids, never on the reward: the
// student's per-token reverse KL to the teacher must fall and its copy reward rise. The pool is started by the
// stack, routed apart from the policy's engines, never refit, and shown by the progress query (`status`).
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { callService, type EngineHealth } from '../../activities/gpu-client';
import { readTrajectory } from '../helpers/store';
import { loadRecipe, REPO_ROOT, resolveModelDir, type RecipeConfig } from '../../agents/recipe';
import { startStack, type Stack } from '../../infra/stack';
import { addEngineUpdate, enginesQuery } from '../../workflows/control';
import { progressQuery, runWorkflowId, TASK_QUEUES, trainRun, type Progress } from '../../workflows/train-run';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'distill');
const PY = path.join(REPO_ROOT, '.venv', 'bin', 'python');
const STEPS = 28;

let stack: Stack;
let client: Client;
let config: RecipeConfig;
const stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-distill-'));
const teacherDir = path.join(stateDir, 'copy-teacher');

beforeAll(async () => { // the machine may be loaded: making the teacher and starting the stack take minutes
  execFileSync(PY, ['recipes/distill/make_teacher.py', '--model', resolveModelDir('tiny'), '--out', teacherDir,
    '--steps', '150'], { cwd: REPO_ROOT, env: { ...process.env, OMP_NUM_THREADS: '1' }, stdio: 'ignore' });
  config = loadRecipe(RECIPE_DIR, {
    'pools.teacher.model': teacherDir, 'train.steps': String(STEPS), 'store.keep_steps': String(STEPS),
  });
  stack = await startStack({
    modelDir: resolveModelDir(config.model), stateDir, quiet: true,
    pools: { teacher: { modelDir: config.pools.teacher.model, count: 1 } },
  });
  client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
}, 900_000);
afterAll(async () => {
  await client?.connection.close();
  await stack?.stop();
});

test('the student learns the copy task from the teacher pool alone: reverse KL falls, reward rises', async () => {
  const runId = `distill-${Date.now()}`;
  const handle = await client.workflow.start(trainRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config }],
  });
  let progress: Progress | null = null;
  while (!progress) progress = await handle.query(progressQuery).catch(() => null);
  expect(progress.pools.teacher).toMatchObject({ model: teacherDir, count: 1, backend: 'torch' });
  // The teacher's engine is not one of the run's (elastic) policy engines, and cannot be made one: it is never refit.
  const messages = (e: unknown): string => (e instanceof Error ? `${e.message} / ${messages(e.cause)}` : '');
  const added = await handle.executeUpdate(addEngineUpdate, { args: [stack.pools.teacher[0]] }).then(() => 'joined', messages);
  expect(added).toContain(`engine ${stack.pools.teacher[0]} is in the recipe's pool teacher: pools are never refit`);
  expect((await handle.query(enginesQuery)).serving).toEqual(stack.engines);
  await handle.result();

  const lines = fs.readFileSync(path.join(stack.storeRoot, runId, 'metrics.jsonl'), 'utf8').trim().split('\n')
    .map((l) => JSON.parse(l) as Record<string, number>);
  expect(lines).toHaveLength(STEPS);
  const kl = lines.map((m) => m['distill/reverse_kl']);
  const reward = lines.map((m) => m['rollout/reward_mean']);
  const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
  console.log(`distill: reverse KL per step ${kl.map((x) => x.toFixed(3)).join(' ')}\n`
    + `reward per step ${reward.map((x) => x.toFixed(3)).join(' ')}\n`
    + `teacher calls per step ${lines.map((m) => m['pool/teacher/calls']).join(' ')}, seconds per step `
    + `${lines.map((m) => m['pool/teacher/seconds'].toFixed(2)).join(' ')}, step seconds ${lines.map((m) => m['time/step'].toFixed(2)).join(' ')}`);
  // Seen in a plain loop with these settings: KL ~6.2 -> ~3.6, reward ~0.005 -> ~0.25 by step 20.
  expect(mean(kl.slice(-6))).toBeLessThan(mean(kl.slice(0, 4)) - 1);
  expect(mean(reward.slice(-6))).toBeGreaterThan(mean(reward.slice(0, 4)) + 0.1);
  // every sampled episode of a step was scored once by the teacher (batch.groups x group_size segments)
  for (const m of lines) expect(m['pool/teacher/calls']).toBeGreaterThanOrEqual(config.batch.groups * config.group_size);

  // The trajectories carry the teacher's logprob of each sampled token (0 elsewhere).
  const manifest = JSON.parse(fs.readFileSync(path.join(stack.storeRoot, runId, 'steps', 'step-1.json'), 'utf8'));
  const { trajectory } = readTrajectory(stack.storeRoot, manifest.refs[0]);
  expect(trajectory.teacherLogprobs).toHaveLength(trajectory.tokens.length);
  trajectory.lossMask.forEach((m, i) => (m ? expect(trajectory.teacherLogprobs![i]).toBeLessThanOrEqual(0)
    : expect(trajectory.teacherLogprobs![i]).toBe(0)));

  // The policy's engine was refit to the last step; the teacher pool never was.
  const health = (url: string) => callService<EngineHealth>(url, '/health', stack.token, { response: 'EngineHealth' });
  expect((await health(stack.engines[0])).version).toBe(STEPS);
  expect((await health(stack.pools.teacher[0])).version).toBe(0);
}, 1_200_000);
