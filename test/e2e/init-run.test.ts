// Start from any weights (recipe key `init`), through the real stack: run A trains a few steps at a
// large learning rate and checkpoints; run B starts from that checkpoint. The engines must sample run
// B's first batch (version 0) from the checkpoint's weights, not the tiny model's: the logprobs they
// recorded are compared with a teacher-forced forward of each. The actor (policy and KL reference,
// started with --ref-model tiny) must hold them too: its recomputed logprobs match the engine's
// (rollout_kl) and its KL to the reference is 0 at the first step. A directory that slips past the
// client's checks fails the run at once, naming it.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection, WorkflowFailedError } from '@temporalio/client';
import { readTrajectory } from '../helpers/store';
import { loadRecipe, REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { startStack, type Stack } from '../../infra/stack';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../../workflows/train-run';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'copy');
const SMALL = { 'group_size': '4', 'pool.inflight': '2', 'batch.groups': '2', 'checkpoint.every': '3' };
const PY = path.join(REPO_ROOT, '.venv', 'bin', 'python');

let stack: Stack;
let client: Client;
const stamp = Date.now();

beforeAll(async () => {
  stack = await startStack({
    modelDir: resolveModelDir('tiny'), stateDir: fs.mkdtempSync(path.join(os.tmpdir(), 'molt-init-')),
    engines: 1, quiet: true, actorArgs: ['--ref-model', resolveModelDir('tiny')],
  });
  client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
});
afterAll(async () => {
  await client?.connection.close();
  await stack?.stop();
});

function run(runId: string, overrides: Record<string, string>, init?: string) {
  const config = loadRecipe(RECIPE_DIR, { ...SMALL, ...overrides });
  return client.workflow.execute(trainRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control,
    args: [{ runId, recipeDir: RECIPE_DIR, config: init === undefined ? config : { ...config, init } }],
  });
}

// Teacher-forced logprobs of tokens[start..] under the weights of `dir` (fp32, CPU).
function forwardLogprobs(dir: string, tokens: number[], start: number): number[] {
  const script = `
import json, sys, torch
from transformers import AutoModelForCausalLM
m = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
t = torch.tensor([json.loads(sys.argv[2])])
with torch.no_grad():
    lp = torch.log_softmax(m(input_ids=t).logits[0, :-1].float(), -1).gather(-1, t[0, 1:, None])[:, 0]
print(json.dumps(lp[int(sys.argv[3]) - 1:].tolist()))`;
  return JSON.parse(execFileSync(PY, ['-c', script, dir, JSON.stringify(tokens), String(start)],
    { env: { ...process.env, OMP_NUM_THREADS: '1' } }).toString());
}

test('a run with init starts its actor, KL reference and engines from a checkpoint of another run', async () => {
  const first = await run(`init-a-${stamp}`, { 'train.steps': '3', 'algo.lr': '0.05' });
  expect(first.checkpoint).not.toBeNull();
  const ckpt = first.checkpoint!;

  const second = `init-b-${stamp}`;
  const summary = await run(second, { 'train.steps': '1', 'algo.kl_coef': '0.1' }, ckpt);
  expect(summary.steps).toBe(1);
  expect(fs.readFileSync(path.join(stack.storeRoot, second, 'init'), 'utf8')).toBe(ckpt);

  // The first batch, sampled at version 0: its logprobs are the checkpoint's, and not the tiny model's.
  const manifest = JSON.parse(fs.readFileSync(path.join(stack.storeRoot, second, 'steps', 'step-1.json'), 'utf8'));
  const { trajectory } = readTrajectory(stack.storeRoot, manifest.refs[0]);
  const start = Array.from(trajectory.lossMask).indexOf(1);
  const tokens = Array.from(trajectory.tokens);
  const sampled = Array.from(trajectory.logprobs).slice(start);
  expect(new Set(Array.from(trajectory.versions).slice(start))).toEqual(new Set([0]));
  const fromCkpt = forwardLogprobs(ckpt, tokens, start);
  const fromTiny = forwardLogprobs(resolveModelDir('tiny'), tokens, start);
  const maxDiff = (a: number[], b: number[]) => Math.max(...a.map((x, i) => Math.abs(x - b[i])));
  expect(maxDiff(sampled, fromCkpt)).toBeLessThan(1e-3);
  expect(maxDiff(sampled, fromTiny)).toBeGreaterThan(0.05);

  // The actor trained step 1 from the same weights (its recomputed logprobs agree with the engine's),
  // and its reference model is the checkpoint too (KL 0 before the update).
  const line = fs.readFileSync(path.join(stack.storeRoot, second, 'metrics.jsonl'), 'utf8').trim().split('\n')[0];
  const metrics = JSON.parse(line) as Record<string, number>;
  const get = (name: string) => metrics[name] ?? metrics[`actor/${name}`];
  expect(Math.abs(get('rollout_kl'))).toBeLessThan(1e-4);
  expect(Math.abs(get('kl'))).toBeLessThan(1e-4);
});

test('an init directory that slips past the client checks fails the run at once, naming it', async () => {
  const missing = path.join(os.tmpdir(), `molt-no-such-init-${stamp}`);
  const failed = await run(`init-c-${stamp}`, { 'train.steps': '1' }, missing).then(() => null, (e) => e);
  expect(failed).toBeInstanceOf(WorkflowFailedError);
  const cause = (failed as WorkflowFailedError).cause as Error;
  expect(cause.message).toContain(missing);
  expect(cause.message).toMatch(/init/);
});
