// The actor activities against a real actor (torchrun, one rank) and a real engine: a train step
// applied exactly once, a refit that moves the engine's version once, a checkpoint and its pointer.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { checkpoint, checkpointDir, refit, trainStep } from '../../activities/actor';
import { createActivities } from '../../activities/index';
import { callService, type EngineHealth, type GenerateResponse } from '../../activities/gpu-client';
import { rolloutGroup } from '../../activities/rollout';
import { groupRefs } from '../../activities/store';
import type { GroupTrajectories, ServiceEndpoints } from '../../activities/types';
import { RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { killTree } from '../../infra/stack';
import { startActor, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

let engine: Service;
let actor: Service;
let root: string;
let endpoints: ServiceEndpoints;
const config = RecipeConfig.parse({
  ...JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'recipes', 'copy', 'recipe.json'), 'utf8')), group_size: 4,
});
// Runs an activity function inside an activity context (Temporal's test environment).
const inActivity = <R>(fn: () => Promise<R>): Promise<R> => new MockActivityEnvironment().run(fn) as Promise<R>;

beforeAll(async () => {
  root = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-actor-'));
  const model = tinyModel();
  [engine, actor] = await Promise.all([startEngine(model), startActor(model, path.join(root, 'actor-state'))]);
  endpoints = { engines: [engine.url], actor: actor.url, token: TOKEN, storeRoot: path.join(root, 'store') };
});
afterAll(async () => {
  await Promise.all([engine?.stop(), actor?.stop()]);
  fs.rmSync(root, { recursive: true, force: true });
});

const engineVersion = async () => (await callService<EngineHealth>(engine.url, '/health', TOKEN)).version;

let groups: GroupTrajectories[]; // the batch of step 1, trained again under later step numbers

test('train step, refit and checkpoint, each exactly once', async () => {
  const group = await inActivity(() => rolloutGroup(endpoints, new EngineRouter(endpoints.engines, TOKEN),
    { runId: 'r', groupIndex: 0, recipeDir: path.join(REPO_ROOT, 'recipes', 'copy'), config }));
  expect(groupRefs('r', group)).toHaveLength(4);
  groups = [group];

  const step = await inActivity(() => trainStep(endpoints, { runId: 'r', step: 1, groups, algo: config.algo }));
  expect(step).toMatchObject({ step: 1, version: 1, replayed: false });
  const again = await inActivity(() => trainStep(endpoints, { runId: 'r', step: 1, groups, algo: config.algo }));
  expect(again).toEqual({ ...step, replayed: true }); // a retried step is answered, not trained again

  // A gap: step 2 was never asked, so there is nothing to replay it from.
  await expect(inActivity(() => trainStep(endpoints, { runId: 'r', step: 3, groups, algo: config.algo })))
    .rejects.toThrow(/actor holds step 1 of run r: cannot replay step 2, it has no manifest/);
  // The same step with another batch is refused: one step number, one update.
  await expect(inActivity(() => trainStep(endpoints, { runId: 'r', step: 1, groups: [{ ...group, episodes: group.episodes.slice(1), segments: group.segments.slice(1) }], algo: config.algo })))
    .rejects.toThrow(/step 1 of run r was already asked with other trajectories/);

  expect(await engineVersion()).toBe(0);
  const pushed = await inActivity(() => refit(endpoints, { runId: 'r', version: 1 }));
  expect(pushed.version).toBe(1);
  expect(pushed.bytes).toBeGreaterThan(0);
  const health = await callService<EngineHealth>(engine.url, '/health', TOKEN);
  expect(health).toMatchObject({ version: 1, paused: false }); // resumed
  const noop = await inActivity(() => refit(endpoints, { runId: 'r', version: 1 }));
  expect(noop).toEqual({ version: 1, seconds: 0, bytes: 0 }); // a retried refit pushes nothing
  const res = await callService<GenerateResponse>(engine.url, '/generate', TOKEN, {
    body: { prompt_token_ids: [99, 111], sampling: { max_tokens: 2 } }, response: 'GenerateResponse',
  });
  expect(res.versions).toEqual([1, 1]);

  const saved = await inActivity(() => checkpoint(endpoints, { runId: 'r', step: 1 }));
  expect(saved).toEqual({ path: checkpointDir(endpoints.storeRoot, 'r', 1), step: 1 });
  expect(fs.readFileSync(path.join(endpoints.storeRoot, 'r', 'checkpoints', 'latest'), 'utf8')).toBe(saved.path);
  expect(fs.readdirSync(saved.path)).toContain('config.json');
  await expect(inActivity(() => checkpoint(endpoints, { runId: 'r', step: 2 })))
    .rejects.toThrow('actor holds step 1 of run r: cannot replay step 2, it has no manifest');
  expect(fs.existsSync(checkpointDir(endpoints.storeRoot, 'r', 2))).toBe(false);

  // A wrong token fails the same way on every retry: the activity says so at once.
  const wrongToken = createActivities({ ...endpoints, token: 'wrong' });
  await expect(inActivity(() => wrongToken.trainStep({ runId: 'r', step: 2, groups, algo: config.algo })))
    .rejects.toMatchObject({ name: 'ApplicationFailure', nonRetryable: true, message: expect.stringContaining('HTTP 401') });
  expect(fs.readFileSync(path.join(endpoints.storeRoot, 'r', 'checkpoints', 'latest'), 'utf8')).toBe(saved.path);
});

// The actor dies after steps 2 and 3 (checkpoint at 1): a fresh actor (base weights, empty log) is
// brought back by the activities themselves — the latest checkpoint, then steps 2 and 3 replayed
// from their manifests — and the replayed steps make the very same updates (same metrics).
test('a restarted actor catches up from the latest checkpoint and the step manifests', async () => {
  const trained = [];
  for (const step of [2, 3]) trained.push(await inActivity(() => trainStep(endpoints, { runId: 'r', step, groups, algo: config.algo })));
  const restart = async () => {
    const exited = new Promise((r) => actor.proc.once('exit', r));
    killTree(actor.proc.pid!, 'SIGKILL'); // torchrun and its rank: a SIGKILLed torchrun would leave the rank running
    await exited;
    actor = await startActor(tinyModel(), path.join(root, 'actor-state'));
    endpoints.actor = actor.url;
  };
  await restart();
  const step4 = await inActivity(() => trainStep(endpoints, { runId: 'r', step: 4, groups, algo: config.algo }));
  expect(step4).toMatchObject({ step: 4, version: 4, replayed: false });
  const log = fs.readFileSync(path.join(root, 'actor-state', 'steps.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l));
  expect(log.map((e) => e.step)).toEqual([1, 2, 3, 4]); // the checkpoint's step, the replays, the new one: each once
  const deterministic = (m: Record<string, number>) => Object.fromEntries(Object.entries(m).filter(([k]) => !k.startsWith('time/')));
  for (const [i, step] of [2, 3].entries()) expect(deterministic(log[step - 1].metrics)).toEqual(deterministic(trained[i].metrics));

  // Dead again before the refit of step 4: the refit catches the actor up before it pushes.
  await restart();
  expect((await inActivity(() => refit(endpoints, { runId: 'r', version: 4 }))).version).toBe(4);
  expect(await engineVersion()).toBe(4);
  const health = await callService<{ last_step: number; run_id: string }>(actor.url, '/health', TOKEN);
  expect(health).toMatchObject({ last_step: 4, run_id: 'r' });
});

// A refit of an earlier worker paused the engines around the push and could fail before it resumed
// them (a connection reset on /resume): the next refit resumes an engine it finds paused, also when
// every engine is at the version already and nothing is pushed.
test('a refit leaves no engine paused', async () => {
  await inActivity(() => trainStep(endpoints, { runId: 'r', step: 5, groups, algo: config.algo }));
  for (const version of [5, 5]) { // pushed, then already there
    await callService(engine.url, '/pause', TOKEN, { body: { mode: 'keep' } });
    expect((await inActivity(() => refit(endpoints, { runId: 'r', version }))).version).toBe(5);
    expect(await callService<EngineHealth>(engine.url, '/health', TOKEN)).toMatchObject({ version: 5, paused: false });
  }
  const res = await callService<GenerateResponse>(engine.url, '/generate', TOKEN, {
    body: { prompt_token_ids: [99, 111], sampling: { max_tokens: 2 } }, response: 'GenerateResponse', timeoutMs: 60_000,
  });
  expect(res.versions).toEqual([5, 5]);
});
