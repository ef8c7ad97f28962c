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
import type { ServiceEndpoints } from '../../activities/types';
import { RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
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

test('train step, refit and checkpoint, each exactly once', async () => {
  const group = await inActivity(() => rolloutGroup(endpoints, new EngineRouter(endpoints.engines, TOKEN),
    { runId: 'r', groupIndex: 0, recipeDir: path.join(REPO_ROOT, 'recipes', 'copy'), config }));
  expect(group.refs).toHaveLength(4);

  const step = await inActivity(() => trainStep(endpoints, { runId: 'r', step: 1, refs: group.refs, algo: config.algo }));
  expect(step).toMatchObject({ step: 1, version: 1, replayed: false });
  const again = await inActivity(() => trainStep(endpoints, { runId: 'r', step: 1, refs: group.refs, algo: config.algo }));
  expect(again).toEqual({ ...step, replayed: true }); // a retried step is answered, not trained again

  await expect(inActivity(() => trainStep(endpoints, { runId: 'r', step: 3, refs: group.refs, algo: config.algo })))
    .rejects.toThrow(/HTTP 409: step 3 of run 'r' is neither applied nor next/); // the actor's {"error"} text

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
    .rejects.toThrow("checkpoint: asked for step 2 of run r, but the actor holds step 1 of run r");
  expect(fs.existsSync(checkpointDir(endpoints.storeRoot, 'r', 2))).toBe(false);

  // A wrong token fails the same way on every retry: the activity says so at once.
  const wrongToken = createActivities({ ...endpoints, token: 'wrong' });
  await expect(inActivity(() => wrongToken.trainStep({ runId: 'r', step: 2, refs: group.refs, algo: config.algo })))
    .rejects.toMatchObject({ name: 'ApplicationFailure', nonRetryable: true, message: expect.stringContaining('HTTP 401') });
  expect(fs.readFileSync(path.join(endpoints.storeRoot, 'r', 'checkpoints', 'latest'), 'utf8')).toBe(saved.path);
});
