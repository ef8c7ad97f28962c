// molt-client as a user runs it (a tsx child process) against a real Temporal dev server, with
// a worker in this process whose activities finish instantly.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type { TestWorkflowEnvironment } from '@temporalio/testing';
import { readMetrics, recordMetrics, type RecordMetricsInput } from '../../activities/metrics';
import type { GroupResult, RolloutGroupInput, TrainStepInput } from '../../activities/types';
import { startTemporal, withWorkers } from '../helpers/temporal';
import { runCli } from '../helpers/cli';

let env: TestWorkflowEnvironment;
let recipeDir: string;
let storeRoot: string;
beforeAll(async () => {
  env = await startTemporal();
  recipeDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-cli-'));
  storeRoot = path.join(recipeDir, 'runs');
  fs.writeFileSync(path.join(recipeDir, 'recipe.json'), JSON.stringify({
    name: 'cli', agent: 'agent.ts', model: 'tiny', group_size: 2, pool: { inflight: 2 }, batch: { groups: 1 },
    train: { steps: 50 }, checkpoint: { every: 10 }, sampling: { max_tokens: 4 }, algo: { lr: 1e-5 },
  }));
});
afterAll(async () => {
  await env?.teardown();
  fs.rmSync(recipeDir, { recursive: true, force: true });
});

const cli = (...args: string[]) => runCli(args, { MOLT_TEMPORAL_ADDRESS: env.address });

const trainedSteps: number[] = [];
const trainCalls: TrainStepInput[] = [];
let holdTraining = false;
const activities = {
  async rolloutGroup(input: RolloutGroupInput): Promise<GroupResult> {
    return { groupIndex: input.groupIndex, refs: [`${input.runId}/g${input.groupIndex}/e0`], rewards: [1], failed: 0, tokens: 4, minVersion: 0, maxVersion: 0, seconds: 0 };
  },
  async trainStep(input: TrainStepInput) {
    trainedSteps.push(input.step);
    trainCalls.push(input);
    while (holdTraining) await new Promise((r) => setTimeout(r, 20));
    return { step: input.step, version: input.step, replayed: false, metrics: { loss: 0.25 } };
  },
  async refit(input: { version: number }) { return { version: input.version, seconds: 0, bytes: 0 }; },
  async checkpoint(input: { runId: string; step: number }) { return { path: `/ckpt/step-${input.step}`, step: input.step }; },
  recordMetrics: (input: RecordMetricsInput) => recordMetrics({ engines: [], actor: '', token: '', storeRoot }, input),
};

test('start with a bad override exits 2 and names the field', async () => {
  const { code, stderr } = await cli('start', recipeDir, '--algo.lr', 'fast');
  expect(code).toBe(2);
  expect(stderr).toContain('recipe config: algo.lr: expected number, received string');
});

test('commands on an unknown run or schedule exit 1 with a clear message', async () => {
  for (const command of ['status', 'cancel', 'pause', 'resume', 'checkpoint']) {
    const { code, stderr } = await cli(command, 'xyz');
    expect(code).toBe(1);
    expect(stderr.trim()).toBe('no run molt-xyz');
  }
  const set = await cli('set', 'xyz', '--algo.lr', '1e-4');
  expect([set.code, set.stderr.trim()]).toEqual([1, 'no run molt-xyz']);
  const schedule = await cli('schedule', 'describe', 'nope');
  expect([schedule.code, schedule.stderr.trim()]).toEqual([1, 'no schedule nope']);
});

test('start --follow runs to the end; status and list show the run; a second start with the same id is refused', async () => {
  await withWorkers(env, activities, async () => {
    const started = await cli('start', recipeDir, '--run-id', 'cli1', '--follow', '--train.steps', '3', '--algo.lr=2e-5');
    expect(started.code).toBe(0);
    expect(started.stdout).toContain('"lr": 0.00002');
    expect(started.stdout).toContain('http://localhost:8233/namespaces/default/workflows/molt-cli1');
    expect(started.stdout).toContain('run cli1 finished after 3 steps');
    expect(trainedSteps).toEqual([1, 2, 3]);

    const status = await cli('status', 'cli1');
    expect(status.code).toBe(0);
    expect(status.stdout).toContain('run cli1: COMPLETED');
    expect(status.stdout).toContain('checkpoint: /ckpt/step-3');

    const list = await cli('list');
    expect(list.stdout).toMatch(/^cli1\tCOMPLETED/m);

    const again = await cli('start', recipeDir, '--run-id', 'cli1');
    expect(again.code).toBe(2);
    expect(again.stderr).toContain('run molt-cli1 already exists');
  });
});

test('cancel stops a running run gracefully', async () => {
  await withWorkers(env, activities, async () => {
    const started = await cli('start', recipeDir, '--run-id', 'cli2');
    expect(started.code).toBe(0);
    const cancelled = await cli('cancel', 'cli2');
    expect(cancelled.code).toBe(0);
    const handle = env.client.workflow.getHandle(`molt-cli2`);
    const summary = await handle.result();
    expect(summary.stopped).toBe(true);
    expect((await cli('status', 'cli2')).stdout).toContain('run cli2: COMPLETED');
  });
});

test('pause, set, checkpoint and resume a running run; metrics.jsonl has one line per step', async () => {
  await withWorkers(env, activities, async () => {
    holdTraining = true;
    expect((await cli('start', recipeDir, '--run-id', 'cli3', '--train.steps', '3')).code).toBe(0);
    const handle = env.client.workflow.getHandle('molt-cli3');
    while (!trainCalls.some((c) => c.runId === 'cli3')) await new Promise((r) => setTimeout(r, 20));
    const paused = await cli('pause', 'cli3');
    expect(paused.stdout).toContain('run cli3: paused; algo.lr=0.00001');
    const bad = await cli('set', 'cli3', '--algo.lr', '-1');
    expect([bad.code, bad.stderr.trim()]).toEqual([2, 'run cli3: algo.lr: -1 must be a positive number']);
    const notNumber = await cli('set', 'cli3', '--algo.lr', 'fast');
    expect([notNumber.code, notNumber.stderr.trim()]).toEqual([2, '--algo.lr: "fast" is not a number']);
    const set = await cli('set', 'cli3', '--algo.lr', '3e-4');
    expect(set.stdout).toContain('algo.lr=0.0003');
    holdTraining = false;
    const ckpt = await cli('checkpoint', 'cli3'); // waits for step 1 to finish
    expect(ckpt.stdout).toContain('run cli3: checkpoint of step 1 at /ckpt/step-1');
    expect((await cli('status', 'cli3')).stdout).toContain('PAUSED; settings: algo.lr=0.0003');
    expect((await cli('resume', 'cli3')).stdout).toContain('run cli3: training');
    expect((await handle.result()).steps).toBe(3);
    expect(trainCalls.filter((c) => c.runId === 'cli3').map((c) => c.algo.lr)).toEqual([1e-5, 3e-4, 3e-4]);
    expect((await readMetrics(storeRoot, 'cli3')).map((r) => r.step)).toEqual([1, 2, 3]);
    const plot = await cli('plot', 'cli3', '--store', storeRoot);
    expect(plot.stdout).toContain(`wrote ${storeRoot}/cli3/metrics.png`);
    expect(fs.readFileSync(path.join(storeRoot, 'cli3', 'metrics.png')).subarray(1, 4).toString()).toBe('PNG');
  });
});
