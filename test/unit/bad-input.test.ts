// Bad input gets a clear error naming what is wrong, and nothing wrong is trained on:
//   a malformed recipe config       here (the new rollout fields); the CLI path: test/workflows/cli.test.ts
//   a module without AgentRunner    test/unit/contract.test.ts, test/unit/rollout.test.ts
//   an agent that throws            its episode fails, the group goes on (test/unit/rollout.test.ts,
//                                   chat-rollout.test.ts); over rollout.max_failed_fraction the group fails: here
//   an engine answering malformed JSON, a trajectory over the context budget, a corrupted store file,
//   a rollout worker whose store lacks the run's config.json: here
import * as fs from 'node:fs';
import * as http from 'node:http';
import type { AddressInfo } from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { defaultPayloadConverter } from '@temporalio/common';
import { MockActivityEnvironment } from '@temporalio/testing';
import { createActivities } from '../../activities';
import { callService, type ActorHealth } from '../../activities/gpu-client';
import { rolloutGroup, type RolloutManifest } from '../../activities/rollout';
import { groupRefs, trajectoryKey, writeTrajectory } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import { stepGroups, type GroupResult, type ServiceEndpoints, type TrainStepInput } from '../../activities/types';
import { MAX_STEP_TRAJECTORIES } from '../../agents/live-settings';
import { loadRecipe, RecipeConfig, RecipeError, REPO_ROOT } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { startActor, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const FIXTURES = path.join(__dirname, 'fixtures');
let engine: Service;
let root: string;
beforeAll(async () => {
  engine = await startEngine(tinyModel());
  root = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-bad-input-'));
});
afterAll(async () => {
  await engine.stop();
  fs.rmSync(root, { recursive: true, force: true });
});

const config = (agent: string, overrides: Record<string, unknown> = {}) => RecipeConfig.parse({
  name: 'bad', agent, model: 'tiny', group_size: 2, pool: { inflight: 1 }, batch: { groups: 1 }, train: { steps: 1 },
  checkpoint: { every: 1 }, sampling: { max_tokens: 3, stop_token_ids: [] }, algo: {}, ...overrides,
});

async function run(runId: string, cfg: RecipeConfig, engines = [engine.url]) {
  const endpoints: ServiceEndpoints = { engines, actor: 'unused', token: TOKEN, storeRoot: path.join(root, 'store') };
  const env = new MockActivityEnvironment();
  const beats: RolloutManifest[] = [];
  env.on('heartbeat', (d) => beats.push(JSON.parse(JSON.stringify(d))));
  const result = await (env.run(rolloutGroup, endpoints, new EngineRouter(engines, TOKEN), { runId, groupIndex: 0, recipeDir: FIXTURES, config: cfg }) as Promise<GroupResult>);
  return { result, refs: groupRefs(runId, result), failed: beats[beats.length - 1].failed };
}

test('a malformed rollout section of the recipe is named by its field', () => {
  const dir = fs.mkdtempSync(path.join(root, 'recipe-'));
  fs.copyFileSync(path.join(REPO_ROOT, 'recipes', 'copy', 'recipe.json'), path.join(dir, 'recipe.json'));
  expect(() => loadRecipe(dir, { 'rollout.max_failed_fraction': '2' })).toThrow(RecipeError);
  expect(() => loadRecipe(dir, { 'rollout.max_failed_fraction': '2' })).toThrow(/recipe config: rollout\.max_failed_fraction: .*1/);
  expect(() => loadRecipe(dir, { 'rollout.partial_tokens': '0' })).toThrow(/rollout\.partial_tokens/);
  expect(() => loadRecipe(dir, { 'pool.inflight': '10001' })).toThrow(/pool\.inflight: at most 10000: the pool is measured up to 10,000 groups in flight/);
  expect(loadRecipe(dir, { 'pool.inflight': '10000' }).pool.inflight).toBe(10000);
  // A step's results must fit one Temporal payload: past that the run's workflow task would fail forever.
  expect(() => loadRecipe(dir, { 'batch.groups': '2049' })).toThrow(/batch\.groups: at most 2048: a step's results travel in one Temporal payload/);
  expect(() => loadRecipe(dir, { 'batch.groups': '2048', group_size: '17' }))
    .toThrow(/batch\.groups: batch\.groups x group_size = 2048 x 17 = 34816 trajectories a step: at most 32768/);
  expect(loadRecipe(dir, { 'batch.groups': '2048', group_size: '16' }).batch.groups).toBe(2048);
  expect(loadRecipe(dir).rollout).toEqual({ max_failed_fraction: 0.5, partial_tokens: 64, partial_seconds: 5 });
});

// The bound above, checked on the payloads themselves: the largest step a recipe may ask for (2,048 groups of 16)
// in a trainStep input, and the most results a run carries across continue-as-new (a batch less one group),
// each as large as a long run makes it (group and step numbers of 7 digits, rewards of full precision, metrics).
test('the largest step allowed fits one Temporal payload, as a step input and as carried results', () => {
  const [groups, groupSize] = [2048, MAX_STEP_TRAJECTORIES / 2048];
  const result = (g: number): GroupResult => {
    const episodes = Array.from({ length: groupSize }, (_, e) => e);
    return {
      groupIndex: 1_000_000 + g, episodes, segments: episodes.map(() => 3), rewards: episodes.map(() => Math.random()),
      failed: 0, tokens: 1_234_567, minVersion: 1_000_000, maxVersion: 1_000_001, seconds: Math.random() * 1000,
      metrics: Object.fromEntries(['agent/turns', 'agent/tool_calls', 'pool/judge/calls', 'pool/judge/seconds'].map((k) => [k, Math.random() * 100])),
    };
  };
  const batch = Array.from({ length: groups }, (_, g) => result(g));
  const payloadBytes = (value: unknown) => defaultPayloadConverter.toPayload(value)!.data!.length;
  const input: TrainStepInput = { runId: 'a-run-with-a-long-name-20261203-093000', step: 1_000_000,
    groups: stepGroups(batch), algo: loadRecipe(path.join(REPO_ROOT, 'recipes', 'copy')).algo };
  expect(payloadBytes(input)).toBeLessThan(1 << 20);
  expect(payloadBytes({ ready: batch.slice(1) })).toBeLessThan(2 << 20);
});

test('failed episodes within the failure budget: the group goes on; over it: the activity fails for good, saying why', async () => {
  const within = await run('budget-ok', config('echo-agent.ts', { env: { failEpisode: 1, turns: 1 }, rollout: { max_failed_fraction: 0.5 } }));
  expect(within.result).toMatchObject({ failed: 1, rewards: [1] });
  await expect(run('budget-over', config('echo-agent.ts', { env: { failEpisode: 1, turns: 1 }, rollout: { max_failed_fraction: 0.4 } })))
    .rejects.toMatchObject({
      name: 'ApplicationFailure', nonRetryable: true, type: 'FailureBudgetExceeded',
      message: expect.stringMatching(/group 0: 1 of 2 episodes failed, over the failure budget rollout\.max_failed_fraction=0\.4; recipe bad \(test\/unit\/fixtures\/echo-agent\.ts:16\), group 0 episode 1: env step threw: episode 1 fails on purpose/),
    });
});

test('a group whose run has no config.json in the worker\'s store fails (retried), naming the file and the store root', async () => {
  const storeRoot = path.join(root, 'other-store');
  const acts = createActivities({ engines: [engine.url], actor: 'unused', token: TOKEN, storeRoot });
  const input = { runId: 'no-config', groupIndex: 0 }; // what the workflow sends: the config stays in the run's folder
  const missing = new MockActivityEnvironment().run(acts.rolloutGroup, input);
  await expect(missing).rejects.toThrow(`run no-config: cannot read its config ${path.join(storeRoot, 'no-config', 'config.json')} (ENOENT)`);
  await expect(missing).rejects.toThrow(`this worker's store root (${storeRoot}) must be the control worker's`);
  await expect(missing).rejects.not.toMatchObject({ nonRetryable: true }); // a store that comes back is used on a retry
  // Written, it is what the group runs with: a batch of 8 groups wants 4 samples, from every second group.
  await acts.writeRunConfig({ runId: 'no-config', recipeDir: FIXTURES, config: config('echo-agent.ts', { env: { turns: 1 }, batch: { groups: 8 } }) });
  const [first, second] = await Promise.all([0, 1].map((groupIndex) =>
    new MockActivityEnvironment().run(acts.rolloutGroup, { ...input, groupIndex }) as Promise<GroupResult>));
  expect(first).toMatchObject({ groupIndex: 0, failed: 0, sample: { episode: expect.any(Number) } });
  expect(groupRefs('no-config', first)).toHaveLength(2);
  expect(second).toMatchObject({ groupIndex: 1, failed: 0 });
  expect(second.sample).toBeUndefined();
});

test('an engine answering malformed JSON fails the activity (retried) with a message naming it; nothing is stored', async () => {
  let body = 'not json {';
  const broken = http.createServer((req, res) => {
    req.resume();
    req.on('end', () => res.writeHead(200, { 'content-type': 'application/json' }).end(body));
  });
  await new Promise<void>((resolve) => broken.listen(0, '127.0.0.1', resolve));
  const url = `http://127.0.0.1:${(broken.address() as AddressInfo).port}`;
  try {
    await expect(run('broken-engine', config('echo-agent.ts', { env: { turns: 1 } }), [url]))
      .rejects.toMatchObject({ name: 'ServiceError', message: expect.stringContaining(`POST ${url}/generate: HTTP 200, body is not JSON: not json {`) });
    body = JSON.stringify({ request_id: 'x', token_ids: [1, 2], logprobs: [0], versions: [0, 0], finish_reason: 'stop' });
    await expect(run('broken-engine', config('echo-agent.ts', { env: { turns: 1 } }), [url]))
      .rejects.toThrow(/response from POST .*\/generate: does not match Generate(Response|Chunk)|engine returned 2 tokens but 1 logprobs/);
    expect(fs.existsSync(path.join(root, 'store', 'broken-engine', 'trajectories'))).toBe(false);
  } finally {
    broken.close();
  }
});

test('a trajectory over the context budget: its episode fails with the reason, the others go on', async () => {
  // Episode 0 fits; episode 1's first observation is over max_context; episode 2's fits max_context
  // but not the model (1024 positions), so the engine refuses it (400).
  const { result, refs, failed } = await run('context', config('sized-agent.ts', { group_size: 3, max_context: 2000, env: { sizes: [5, 2500, 1100] }, rollout: { max_failed_fraction: 1 } }));
  expect(result).toMatchObject({ failed: 2, rewards: [1] });
  expect(failed[1]).toBe('recipe bad (test/unit/fixtures/sized-agent.ts), group 0 episode 1: the first observation is 2500 tokens, max_context is 2000');
  expect(failed[2]).toMatch(/HTTP 400: .*1100/);
  expect(readTrajectory(path.join(root, 'store'), refs[0]).trajectory.tokens).toHaveLength(5 + 3);
});

describe('a corrupted store file', () => {
  let actor: Service;
  const storeRoot = () => path.join(root, 'store');
  beforeAll(async () => { actor = await startActor(tinyModel(), path.join(root, 'actor-state')); });
  afterAll(async () => { await actor?.stop(); });

  test('is detected by its checksum in both readers, reported by ref, and not trained on', async () => {
    const ref = trajectoryKey('corrupt', 0, 0, 0);
    await writeTrajectory(storeRoot(), ref, { tokens: [99, 111, 112, 121], logprobs: [0, 0, -1.5, -2.5], versions: [-1, -1, 0, 0], lossMask: [0, 0, 1, 1] },
      { run: 'corrupt', group: 0, episode: 0, segment: 0, reward: 1, finish: 'stop' });
    expect(readTrajectory(storeRoot(), ref).trajectory.tokens).toEqual([99, 111, 112, 121]);
    const file = path.join(storeRoot(), ref);
    const bytes = fs.readFileSync(file);
    bytes[bytes.length - 10] ^= 0x01; // one bit of the tensor data
    fs.writeFileSync(file, bytes);

    expect(() => readTrajectory(storeRoot(), ref)).toThrow(/corrupt\/trajectories\/g0\/e0-s0\.safetensors: checksum mismatch .* the file is corrupted/);
    const train = callService(actor.url, '/train_step', TOKEN, {
      body: { run_id: 'corrupt', step: 1, store_root: storeRoot(), trajectories: [ref], algo: {} }, request: 'TrainStepRequest',
    });
    await expect(train).rejects.toMatchObject({ status: 400, message: expect.stringContaining(`trajectory '${ref}'`) });
    await expect(train).rejects.toThrow(/is corrupted: sha256 of its tensor data is [0-9a-f]{64}, the file says [0-9a-f]{64}; not trained on/);
    expect((await callService<ActorHealth>(actor.url, '/health', TOKEN)).last_step).toBe(0); // nothing applied
  });
});
