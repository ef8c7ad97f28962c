// molt-client as a user runs it (a tsx child process) against a real Temporal dev server, with
// a worker in this process whose activities finish instantly.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Context } from '@temporalio/activity';
import type { TestWorkflowEnvironment } from '@temporalio/testing';
import { createActivities } from '../../activities';
import { readMetrics, recordMetrics, type RecordMetricsInput } from '../../activities/metrics';
import { runConfigPath, writeRunConfig, type RunConfigInput } from '../../activities/run-folder';
import type { GroupResult, RolloutGroupInput, TrainStepInput } from '../../activities/types';
import { setUpdate } from '../../workflows/control';
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
  // `start` loads the agent module before it starts a run. throwing.ts loads but fails every episode.
  fs.writeFileSync(path.join(recipeDir, 'agent.ts'), `export const AgentRunner = { kind: 'env', createEnv: () => ({
    reset: () => ({ observation: 'x' }), step: () => ({ reward: 1, terminated: true, truncated: false }) }) };`);
  fs.writeFileSync(path.join(recipeDir, 'throwing.ts'),
    `export const AgentRunner = { kind: 'env', createEnv: () => { throw new Error('the env is broken'); } };`);
  fs.writeFileSync(path.join(recipeDir, 'no-runner.ts'), `export const Agent = {};`);
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
    return { groupIndex: input.groupIndex, episodes: [0], segments: [1], rewards: [1], failed: 0, tokens: 4, minVersion: 0, maxVersion: 0, seconds: 0 };
  },
  async trainStep(input: TrainStepInput) {
    trainedSteps.push(input.step);
    trainCalls.push(input);
    // held like a real actor call: heartbeating, so a long hold is not taken for a lost worker
    while (holdTraining) { Context.current().heartbeat(); await new Promise((r) => setTimeout(r, 20)); }
    return { step: input.step, version: input.step, replayed: false, metrics: { loss: 0.25 } };
  },
  async refit(input: { version: number }) { return { version: input.version, seconds: 0, bytes: 0 }; },
  async claimActor() { return { heldBy: null }; },
  async checkpoint(input: { runId: string; step: number }) { return { path: `/ckpt/step-${input.step}`, step: input.step }; },
  recordMetrics: (input: RecordMetricsInput) => recordMetrics({ engines: [], actor: '', token: '', storeRoot }, input),
  writeRunConfig: (input: RunConfigInput) => writeRunConfig(storeRoot, input),
};

test('start with a bad override exits 2 and names the field', async () => {
  const { code, stderr } = await cli('start', recipeDir, '--algo.lr', 'fast');
  expect(code).toBe(2);
  expect(stderr).toContain('recipe config: algo.lr: expected number, received string');
});

test('commands on an unknown run or schedule exit 1 with a clear message', async () => {
  for (const command of ['status', 'cancel', 'pause', 'unpause', 'checkpoint']) {
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
    const started = await cli('start', recipeDir, '--run-id', 'cli1', '--follow', '--train.steps', '3', '--algo.lr=2e-5', '-v');
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
    expect(started.stdout).not.toContain('recipe config'); // the resolved config is shown with -v only
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
    // Checked against the recipe's schema, by the CLI and by the workflow's update validator.
    const tooMany = await cli('set', 'cli3', '--pool.inflight', '20000');
    expect([tooMany.code, tooMany.stderr.trim()]).toEqual([2, 'run cli3: pool.inflight: 20000: at most 10000: ' +
      'the pool is measured up to 10,000 groups in flight']);
    const direct = await handle.executeUpdate(setUpdate, { args: [{ 'pool.inflight': 20000 }] }).catch((e) => e);
    expect(direct.cause.message).toContain('pool.inflight: 20000: at most 10000');
    const set = await cli('set', 'cli3', '--algo.lr', '3e-4');
    expect(set.stdout).toContain('algo.lr=0.0003');
    holdTraining = false;
    const ckpt = await cli('checkpoint', 'cli3'); // waits for step 1 to finish
    expect(ckpt.stdout).toContain('run cli3: checkpoint of step 1 at /ckpt/step-1');
    expect((await cli('status', 'cli3')).stdout).toContain('PAUSED; settings: algo.lr=0.0003');
    expect((await cli('unpause', 'cli3')).stdout).toContain('run cli3: training');
    expect((await handle.result()).steps).toBe(3);
    expect(trainCalls.filter((c) => c.runId === 'cli3').map((c) => c.algo.lr)).toEqual([1e-5, 3e-4, 3e-4]);
    expect((await readMetrics(storeRoot, 'cli3')).map((r) => r.step)).toEqual([1, 2, 3]);
    // The run's folder holds its resolved config, as the `set` changed it.
    expect(JSON.parse(fs.readFileSync(runConfigPath(storeRoot, 'cli3'), 'utf8'))).toMatchObject({ runId: 'cli3', config: { algo: { lr: 3e-4 } } });
    const plot = await cli('plot', 'cli3', '--store', storeRoot);
    expect(plot.stdout).toContain(`wrote ${storeRoot}/cli3/metrics.png`);
    expect(fs.readFileSync(path.join(storeRoot, 'cli3', 'metrics.png')).subarray(1, 4).toString()).toBe('PNG');
  });
});

test('--help on the program and on commands; start --help lists every recipe key from the schema', async () => {
  const top = await cli('--help');
  expect(top.code).toBe(0);
  for (const command of ['start', 'dev', 'status', 'list', 'cancel', 'pause', 'unpause', 'set', 'checkpoint', 'plot', 'eval', 'schedule']) {
    expect(top.stdout).toMatch(new RegExp(`^  ${command} `, 'm'));
  }
  const start = await cli('start', '--help');
  expect(start.code).toBe(0);
  expect(start.stdout).toContain('--print-config');
  expect(start.stdout).toMatch(/--pool\.inflight +integer > 0 <= 10000; required/);
  expect(start.stdout).toMatch(/--algo\.lr +number > 0; default 0\.000001/);
  expect(start.stdout).toMatch(/--staleness_mode +mask\|drop; default "mask"/);
  expect(start.stdout).toMatch(/--agent +string; required; agent module path, relative to the recipe folder/);
  expect(start.stdout).toMatch(/--rollout\.max_failed_fraction +number >= 0 <= 1; default 0\.5; a group with more failed/);
  const create = await cli('schedule', 'create', '--help');
  expect([create.code, create.stdout]).toEqual([0, expect.stringContaining('--algo.rollout_correction.level')]);
  const unknown = await cli('status', 'x', '--algo.lr', '1e-4'); // recipe overrides go with start, dev, set, eval, schedule create
  expect([unknown.code, unknown.stderr]).toEqual([2, expect.stringContaining("unknown option '--algo.lr'")]);
});

test('--print-config and --dry-run resolve the config (overrides after other flags too) and start nothing', async () => {
  const printed = await cli('start', recipeDir, '--run-id', 'dry1', '--print-config', '--seed', '7', '--pool.inflight=8', '--env.depth', '-1');
  expect(printed.code).toBe(0);
  const config = JSON.parse(printed.stdout);
  expect([config.seed, config.pool.inflight, config.env, config.algo.lr]).toEqual([7, 8, { depth: -1 }, 1e-5]);
  const dry = await cli('start', recipeDir, '--dry-run', '--run-id', 'dry1', '--algo.lr', '3e-5');
  expect(dry.code).toBe(0);
  expect(dry.stdout).toContain('"lr": 0.00003');
  expect(dry.stdout).toContain('dry run: run dry1');
  await expect(env.client.workflow.getHandle('molt-dry1').describe()).rejects.toThrow(/not found/);
});

test('start refuses an agent module that does not load or has no AgentRunner, before any run starts', async () => {
  const began = Date.now();
  const missing = await cli('start', recipeDir, '--run-id', 'badagent', '--agent', 'nope.ts');
  console.log(`bad agent path -> CLI error: ${((Date.now() - began) / 1000).toFixed(1)} s`);
  expect(missing.code).toBe(2);
  expect(missing.stderr).toContain(`agent module ${recipeDir}/nope.ts could not be loaded`);
  const noRunner = await cli('start', recipeDir, '--run-id', 'badagent', '--agent', 'no-runner.ts');
  expect(noRunner.code).toBe(2);
  expect(noRunner.stderr).toContain('does not export an AgentRunner object (exports: Agent)');
  await expect(env.client.workflow.getHandle('molt-badagent').describe()).rejects.toThrow(/not found/);
});

// The real rolloutGroup activity (it fails before any engine call, so no engine is needed).
const realRollout = () => ({
  ...activities,
  rolloutGroup: createActivities({ engines: ['http://127.0.0.1:9'], actor: '', token: 't', storeRoot }).rolloutGroup,
});

test('a run whose agent module does not load fails at once with the reason; status shows it and exits 1', async () => {
  await withWorkers(env, realRollout(), async () => {
    const config = JSON.parse((await cli('start', recipeDir, '--print-config', '--agent', 'gone.ts')).stdout);
    const began = Date.now();
    const handle = await env.client.workflow.start('trainRun', {
      workflowId: 'molt-gone', taskQueue: 'molt-control', args: [{ runId: 'gone', recipeDir, config }],
    }); // as a schedule's firing does: no CLI check before it
    await expect(handle.result()).rejects.toThrow();
    console.log(`agent module missing at the worker -> run failed: ${((Date.now() - began) / 1000).toFixed(1)} s`);
    const status = await cli('status', 'gone');
    expect(status.code).toBe(1);
    expect(status.stdout).toContain('run gone: FAILED');
    expect(status.stderr).toContain(`run molt-gone ended: FAILED: run gone failed after 0 steps: agent module ${recipeDir}/gone.ts could not be loaded`);
  });
});

test('start --follow of a run whose agent throws prints the reason and exits 1', async () => {
  await withWorkers(env, realRollout(), async () => {
    const run = await cli('start', recipeDir, '--run-id', 'throws', '--agent', 'throwing.ts', '--follow');
    expect(run.code).toBe(1);
    expect(run.stderr).toContain('run molt-throws ended: FAILED: run throws failed after 0 steps: group ');
    expect(run.stderr).toContain('createEnv: the env is broken');
  });
});

test('status of a terminated run prints the reason and exits 1', async () => {
  expect((await cli('start', recipeDir, '--run-id', 'term')).code).toBe(0); // no worker: it waits
  await env.client.workflow.getHandle('molt-term').terminate('the operator stopped it');
  const status = await cli('status', 'term');
  expect(status.code).toBe(1);
  expect(status.stdout).toContain('run term: TERMINATED');
  expect(status.stderr.trim()).toBe('run molt-term ended: TERMINATED: the operator stopped it');
});

test('gc: a run that ended keeps what its policy says; a running run is asked what it may still train; unknown runs are refused', async () => {
  // A run's folder as the workers leave it: step s trained group s - 1, groups 4 and 5 were left over;
  // the last checkpoint is at step 4.
  const make = (runId: string) => {
    const write = (rel: string, text: string) => {
      fs.mkdirSync(path.dirname(path.join(storeRoot, runId, rel)), { recursive: true });
      fs.writeFileSync(path.join(storeRoot, runId, rel), text);
    };
    for (let step = 1; step <= 4; step++) {
      write(`steps/step-${step}.json`, JSON.stringify({ refs: [`${runId}/trajectories/g${step - 1}/e0-s0.safetensors`], algo: {} }));
    }
    for (let g = 0; g <= 5; g++) write(`trajectories/g${g}/e0-s0.safetensors`, 'x');
    write('checkpoints/step-4/trainer_state.json', JSON.stringify({ step: 4 }));
    write('checkpoints/latest', path.join(storeRoot, runId, 'checkpoints', 'step-4'));
  };
  const groups = (runId: string) => fs.readdirSync(path.join(storeRoot, runId, 'trajectories')).sort();
  make('gc1');
  const unknown = await cli('gc', 'gc1', '--store', storeRoot);
  expect([unknown.code, unknown.stderr.trim()]).toEqual([1, 'no run molt-gc1; if it has ended (e.g. on another stack), pass --ended']);
  const bad = await cli('gc', 'gc1', '--store', storeRoot, '--keep-steps', 'x');
  expect([bad.code, bad.stderr.trim()]).toEqual([2, '--keep-steps: "x" must be an integer >= 0']);
  const ended = await cli('gc', 'gc1', '--store', storeRoot, '--ended', '--keep-steps', '1');
  expect(ended.code).toBe(0); // manifests of steps 1-3, groups 0-2 and 4-5 (a folder and a file each)
  expect(ended.stdout).toContain(`run gc1: removed 13 files and folders (0.0 MB) from ${storeRoot}/gc1; kept the steps after 3`);
  expect(groups('gc1')).toEqual(['g3']);
  expect(fs.readdirSync(path.join(storeRoot, 'gc1', 'steps'))).toEqual(['step-4.json']);
  const missing = await cli('gc', 'nope', '--store', storeRoot, '--ended');
  expect([missing.code, missing.stderr.trim()]).toEqual([1, `no folder for run nope in ${storeRoot}`]);

  await withWorkers(env, activities, async () => {
    holdTraining = true;
    expect((await cli('start', recipeDir, '--run-id', 'gc2', '--train.steps', '2')).code).toBe(0);
    while (!trainCalls.some((c) => c.runId === 'gc2')) await new Promise((r) => setTimeout(r, 20));
    make('gc2'); // pretend: the loop has no checkpoint yet and group 0 is in its step
    const running = await cli('gc', 'gc2', '--store', storeRoot, '--keep-steps', '0');
    holdTraining = false;
    expect(running.code).toBe(0);
    expect(running.stdout).toContain('kept the steps after 0 and groups from 0'); // the loop's answer, not the folder's checkpoint
    expect(groups('gc2')).toEqual(['g0', 'g1', 'g2', 'g3', 'g4', 'g5']);
    await env.client.workflow.getHandle('molt-gc2').result();
  });
});
