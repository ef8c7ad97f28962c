// The SFT warm start through the real stack (Temporal dev server, worker, actor, engine, tiny model): a few dozen
// steps on the copy task's demonstrations lower the loss and leave a checkpoint; an RL run started from it
// (recipe `init`) samples its first batch with a far higher reward than a run from the random init; a repeated
// step is answered from the actor's log, not trained twice. The actor and then the worker are killed mid-run
// (SIGKILL): the run goes on from its checkpoint and manifests, every step applied exactly once.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { callService, type TrainStepResponse } from '../../activities/gpu-client';
import { loadRecipe, REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { startStack, type Stack } from '../../infra/stack';
import { sftRun } from '../../workflows/sft-run';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../../workflows/train-run';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'copy');
const SMALL = { 'group_size': '8', 'pool.inflight': '4', 'batch.groups': '4', 'checkpoint.every': '5', 'train.steps': '1' };

let stack: Stack;
let client: Client;
const stamp = Date.now();

beforeAll(async () => {
  stack = await startStack({
    modelDir: resolveModelDir('tiny'), stateDir: fs.mkdtempSync(path.join(os.tmpdir(), 'molt-sft-')), engines: 1, quiet: true,
  });
  client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
});
afterAll(async () => {
  await client?.connection.close();
  await stack?.stop();
});

function rl(runId: string, init?: string) {
  const config = loadRecipe(RECIPE_DIR, SMALL);
  return client.workflow.execute(trainRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control,
    args: [{ runId, recipeDir: RECIPE_DIR, config: init === undefined ? config : { ...config, init } }],
  });
}

test('SFT on demonstrations lowers the loss, checkpoints, and RL from its checkpoint beats the random init', async () => {
  const runId = `sft-${stamp}`;
  const config = loadRecipe(RECIPE_DIR, { 'sft.steps': '30', 'sft.checkpoint_every': '10' });
  const handle = await client.workflow.start(sftRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config }],
  });
  const metricsLines = () => {
    const file = path.join(stack.storeRoot, runId, 'metrics.jsonl');
    return fs.existsSync(file) ? fs.readFileSync(file, 'utf8').trim().split('\n').map((l) => JSON.parse(l)) : [];
  };
  const after = async (steps: number) => { while (metricsLines().length < steps) await new Promise((r) => setTimeout(r, 50)); };
  await after(12); // past the checkpoint of step 10
  await stack.restart('actor', 'SIGKILL');
  await after(16);
  await stack.restart('worker', 'SIGKILL'); // the control and actor queues' worker
  const done = await handle.result();
  expect(done.step).toBe(30);
  expect(done.losses).toHaveLength(30);
  const [first, last] = [done.losses[0], done.losses[29]];
  expect(first).toBeGreaterThan(4); // ~ln(259): the random init spreads over the byte vocabulary
  expect(last).toBeLessThan(first / 4);
  for (const loss of done.losses.slice(12)) expect(loss).toBeLessThan(first / 2); // no step started over from scratch
  expect(metricsLines().map((m) => m.step)).toEqual(Array.from({ length: 30 }, (_, i) => i + 1));
  const ckpt = path.join(stack.storeRoot, runId, 'checkpoints', 'step-30');
  expect(done.checkpoint).toEqual({ step: 30, path: ckpt });
  expect(fs.existsSync(path.join(ckpt, 'model.safetensors'))).toBe(true);
  const applied = fs.readFileSync(path.join(ckpt, 'steps.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l).step);
  expect(applied).toEqual(Array.from({ length: 30 }, (_, i) => i + 1)); // each step once, in order

  // A retried step (the same run and step) gets the recorded metrics back, trained once.
  const again = await callService<TrainStepResponse>(stack.actor, '/sft_step', stack.token, {
    body: { run_id: runId, step: 30, examples: [{ tokens: [1, 2, 3], mask: [0, 1, 1] }], algo: config.algo },
    request: 'SftStepRequest', response: 'TrainStepResponse',
  });
  expect(again.replayed).toBe(true);
  expect(again.metrics.loss).toBe(last);

  // RL from the checkpoint: the first batch is sampled at version 0, i.e. by the SFT weights.
  const fromSft = await rl(`sft-rl-${stamp}`, ckpt);
  const fromScratch = await rl(`scratch-rl-${stamp}`);
  const firstReward = (id: string) => JSON.parse(fs.readFileSync(path.join(stack.storeRoot, id, 'metrics.jsonl'), 'utf8')
    .split('\n')[0])['rollout/reward_mean'] as number;
  expect(fromSft.steps).toBe(1);
  const [sftReward, scratchReward] = [firstReward(`sft-rl-${stamp}`), firstReward(`scratch-rl-${stamp}`)];
  expect(scratchReward).toBeLessThan(0.1);
  expect(sftReward).toBeGreaterThan(0.5);
  expect(fromScratch.steps).toBe(1);
});
