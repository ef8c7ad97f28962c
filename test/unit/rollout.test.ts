// The LLM loop against real engine processes (tiny model): token identity of the trajectory,
// context limits, seeds, the router's placement and failover, and the rolloutGroup activity with
// its store writes, heartbeat manifest and retry.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { loadAgentRunner } from '../../agents/contract';
import { deriveSeed, runEnvEpisode, type EpisodeInput } from '../../agents/env-runner';
import { RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { tokenizerFor } from '../../agents/tokenizer';
import type { GenerateRequest, GenerateResponse } from '../../activities/gpu-client';
import { rolloutGroup, type RolloutManifest } from '../../activities/rollout';
import { groupRefs } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import type { GroupResult, ServiceEndpoints } from '../../activities/types';
import { copyTarget } from '../../recipes/copy/agent';
import { freePort, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const FIXTURES = path.join(__dirname, 'fixtures');
const copyConfig = (overrides: Record<string, unknown> = {}) => RecipeConfig.parse({
  ...JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'recipes', 'copy', 'recipe.json'), 'utf8')), ...overrides,
});

let engines: Service[] = [];
let storeRoot: string;
beforeAll(async () => {
  const model = tinyModel();
  engines = await Promise.all([startEngine(model), startEngine(model)]);
  storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-rollout-'));
});
afterAll(async () => {
  await Promise.all(engines.map((e) => e.stop()));
  fs.rmSync(storeRoot, { recursive: true, force: true });
});

describe('runEnvEpisode', () => {
  const tokenizer = () => tokenizerFor(tinyModel());
  async function episode(maxContext: number, settings: Record<string, unknown> = {}) {
    const runner = await loadAgentRunner(path.join(FIXTURES, 'echo-agent.ts'));
    if (runner.kind !== 'env') throw new Error('echo-agent.ts is an Env agent');
    const router = new EngineRouter([engines[0].url], TOKEN);
    const calls: { req: GenerateRequest; res: GenerateResponse }[] = [];
    const input: EpisodeInput = {
      env: runner.createEnv(settings), tokenizer: tokenizer(), maxContext, runSeed: 5,
      task: { groupIndex: 3, episode: 1, seed: deriveSeed(5, 3) },
      sampling: copyConfig().sampling,
      generate: async (req) => {
        const res = await router.generate('s', req);
        calls.push({ req, res });
        return res;
      },
    };
    return { result: await runEnvEpisode(input), calls };
  }

  test('the trajectory is observation tokens plus the engine\'s sampled ids, never re-encoded', async () => {
    const { result, calls } = await episode(256);
    const tok = tokenizer();
    const seed = deriveSeed(5, 3);
    const observations = [`task ${seed % 1000} ü>`, '\n<|im_start|>turn 1 got 3>', '\n<|im_start|>turn 2 got 2>'];
    // turn 0: 3 tokens; turn 1: 2 (the env's per-turn override); turn 2: back to 3
    expect(calls.map((c) => c.req.sampling.max_tokens)).toEqual([3, 2, 3]);
    const expected: number[] = [];
    const mask: number[] = [];
    calls.forEach((c, turn) => {
      const obs = tok.encode(observations[turn]);
      expected.push(...obs);
      mask.push(...obs.map(() => 0));
      expect(c.req.prompt_token_ids).toEqual(expected); // generation runs over the exact accumulated ids
      expected.push(...c.res.token_ids);
      mask.push(...c.res.token_ids.map(() => 1));
    });
    const t = result.trajectory;
    expect(t.tokens).toEqual(expected);
    expect(t.lossMask).toEqual(mask);
    expect(t.logprobs.filter((_, i) => mask[i])).toEqual(calls.flatMap((c) => c.res.logprobs));
    expect(t.logprobs.filter((_, i) => !mask[i]).every((x) => x === 0)).toBe(true);
    expect(t.versions).toEqual(mask.map((m) => (m ? 0 : -1)));
    expect(new Set(calls.map((c) => c.req.sampling.seed)).size).toBe(3); // one seed per turn
    expect(result).toMatchObject({ reward: 3, finish: 'terminated', turns: 3 });
  });

  test('the same seeds give the same episode', async () => {
    const a = await episode(256);
    const b = await episode(256);
    expect(b.result.trajectory).toEqual(a.result.trajectory);
  });

  test('a full context caps max_tokens and ends the episode', async () => {
    const promptLength = tokenizer().encode(`task ${deriveSeed(5, 3) % 1000} ü>`).length;
    const { result, calls } = await episode(promptLength + 2);
    expect(calls.map((c) => c.req.sampling.max_tokens)).toEqual([2]);
    expect(result.trajectory.tokens.length).toBe(promptLength + 2);
    expect(result).toMatchObject({ finish: 'context', reward: 1, turns: 1 });
  });
});

describe('EngineRouter', () => {
  const body: GenerateRequest = {
    prompt_token_ids: [99, 111], sampling: { max_tokens: 2, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [] },
  };

  test('new sessions spread over engines; a session stays on its engine', async () => {
    const router = new EngineRouter(engines.map((e) => e.url), TOKEN);
    await Promise.all([router.generate('s1', body), router.generate('s2', body)]);
    expect(new Set([router.engineFor('s1'), router.engineFor('s2')]).size).toBe(2);
    // Both idle now: a new session would go to engines[0]; the one on engines[1] stays there.
    const onSecond = router.engineFor('s1') === engines[1].url ? 's1' : 's2';
    await router.generate(onSecond, body);
    expect(router.engineFor(onSecond)).toBe(engines[1].url);
    router.endSession(onSecond);
    expect(router.engineFor(onSecond)).toBeUndefined();
    expect(router.load()).toEqual({ [engines[0].url]: 0, [engines[1].url]: 0 });
  });

  test('a request that cannot reach its engine is retried on another; a 4xx is not', async () => {
    const dead = `http://127.0.0.1:${await freePort()}`;
    const router = new EngineRouter([dead, engines[0].url], TOKEN);
    const res = await router.generate('s', body);
    expect(res.token_ids).toHaveLength(2);
    expect(router.engineFor('s')).toBe(engines[0].url);
    const badToken = new EngineRouter([engines[0].url, engines[1].url], 'wrong');
    await expect(badToken.generate('s', body)).rejects.toThrow(`POST ${engines[0].url}/generate: HTTP 401: missing or wrong bearer token`);
    const noEngine = new EngineRouter([dead], TOKEN);
    await expect(noEngine.generate('s', body)).rejects.toThrow(`POST ${dead}/generate failed`);
  });
});

describe('rolloutGroup', () => {
  const endpoints = (): ServiceEndpoints => ({ engines: engines.map((e) => e.url), actor: 'unused', token: TOKEN, storeRoot });

  async function run(runId: string, recipeDir: string, config: RecipeConfig, heartbeatDetails?: RolloutManifest) {
    const env = new MockActivityEnvironment(heartbeatDetails ? { heartbeatDetails } : {});
    const beats: RolloutManifest[] = [];
    env.on('heartbeat', (d) => beats.push(JSON.parse(JSON.stringify(d))));
    const router = new EngineRouter(endpoints().engines, TOKEN);
    const result = await (env.run(rolloutGroup, endpoints(), router, { runId, groupIndex: 4, recipeDir, config }) as Promise<GroupResult>);
    return { result, refs: groupRefs(runId, result), beats };
  }

  test('the copy recipe: G episodes of one task, each in the store with its reward', async () => {
    const config = copyConfig({ group_size: 4, seed: 9 });
    const { result, refs, beats } = await run('copy-run', path.join(REPO_ROOT, 'recipes', 'copy'), config);
    expect(refs).toEqual([0, 1, 2, 3].map((e) => `copy-run/trajectories/g4/e${e}-s0.safetensors`));
    expect(result).toMatchObject({ groupIndex: 4, failed: 0, tokens: 12, minVersion: 0, maxVersion: 0 });
    const prompt = tokenizerFor(tinyModel()).encode(`copy ${copyTarget(deriveSeed(9, 4), 'abcd', 3)}>`);
    refs.forEach((ref, e) => {
      const { trajectory, meta } = readTrajectory(storeRoot, ref);
      expect(trajectory.tokens.slice(0, prompt.length)).toEqual(prompt); // every episode of the group has the same task
      expect(trajectory.lossMask).toEqual([...prompt.map(() => 0), 1, 1, 1]);
      expect(meta).toMatchObject({ run: 'copy-run', group: 4, episode: e, segment: 0, finish: 'terminated', reward: result.rewards[e] });
      expect(result.rewards[e]).toBeGreaterThanOrEqual(0);
      expect(result.rewards[e]).toBeLessThanOrEqual(1);
    });
    expect(Object.keys(beats[beats.length - 1].done).sort()).toEqual(['0', '1', '2', '3']);
  });

  test('an agent module that does not load stops the activity without retries', async () => {
    const config = copyConfig({ group_size: 2, agent: 'no-runner-agent.ts' });
    await expect(run('bad-run', FIXTURES, config)).rejects.toMatchObject({
      name: 'ApplicationFailure', nonRetryable: true, type: 'AgentModuleError',
      message: expect.stringContaining('no-runner-agent.ts does not export an AgentRunner object'),
    });
  });

  test('an agent that throws fails its episode only; a retry reuses the manifest and runs only what is missing', async () => {
    const config = copyConfig({ group_size: 4, agent: 'echo-agent.ts', env: { failEpisode: 2, turns: 2 }, max_context: 128 });
    const first = await run('echo-run', FIXTURES, config);
    expect(first.result.failed).toBe(1);
    expect(first.refs.map((r) => path.basename(r))).toEqual(['e0-s0.safetensors', 'e1-s0.safetensors', 'e3-s0.safetensors']);
    expect(first.result.rewards).toEqual([2, 2, 2]);
    const manifest = first.beats[first.beats.length - 1];
    expect(Object.keys(manifest.failed)).toEqual(['2']);
    expect(manifest.failed[2]).toMatch(/episode 2 fails on purpose/);
    // Journals of finished and of failed episodes are deleted (short episodes write none), and the group's journal folder with them.
    const partials = path.join(storeRoot, 'echo-run', 'partials');
    expect(fs.existsSync(partials) ? fs.readdirSync(partials) : []).toEqual([]);

    // Retry as Temporal would, with the last heartbeat minus episode 1 (as if it had not finished).
    const inode = (ref: string) => fs.statSync(path.join(storeRoot, ref)).ino;
    const before = first.refs.map(inode);
    const partial: RolloutManifest = { done: { 0: manifest.done[0], 3: manifest.done[3] }, failed: manifest.failed };
    const second = await run('echo-run', FIXTURES, config, partial);
    expect(second.refs).toEqual(first.refs);
    expect(second.result.rewards).toEqual([2, 2, 2]);
    expect(second.result.failed).toBe(1);
    const after = second.refs.map(inode);
    expect([after[0] === before[0], after[1] === before[1], after[2] === before[2]]).toEqual([true, false, true]); // only e1 rewritten
  });
});
