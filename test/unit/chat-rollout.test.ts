// The ChatAgent form end to end through the rolloutGroup activity: a real engine process (tiny
// model), the real loopback server and the stock `openai` client. The same copy task as an Env
// recipe (recipes/copy) and as a ChatAgent recipe (recipes/copy-chat) must reach the actor in the
// same shape, token-exact, and the Python loader must accept both.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { ChatTemplate } from '../../agents/chat-template';
import { loadAgentRunner } from '../../agents/contract';
import { deriveSeed } from '../../agents/env-runner';
import { loadRecipe, REPO_ROOT } from '../../agents/recipe';
import type { GenerateResponse } from '../../activities/gpu-client';
import { rolloutGroup, type RolloutManifest } from '../../activities/rollout';
import { groupRefs, type Trajectory } from '../../activities/store';
import { decodeSafetensors, readTrajectory } from '../helpers/store';
import type { GroupResult } from '../../activities/types';
import { copyReward, copyTarget } from '../../recipes/copy/agent';
import { RecordingRouter, freePort, PYTHON, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const FIXTURES = path.join(__dirname, 'fixtures');
const GROUP = 4;
const SEED = 9;

let engine: Service;
let storeRoot: string;
beforeAll(async () => {
  engine = await startEngine(tinyModel());
  storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-chat-rollout-'));
});
afterAll(async () => {
  await engine.stop();
  fs.rmSync(storeRoot, { recursive: true, force: true });
});

// rolloutGroup as the worker runs it, with the recipe's config (group of 3) and its agent module
// from agentDir (a fixture folder, or the recipe's own).
async function run(runId: string, recipe: string, opts: { overrides?: Record<string, string>; agentDir?: string; router?: RecordingRouter } = {}) {
  const recipeDir = path.join(REPO_ROOT, 'recipes', recipe);
  const config = loadRecipe(recipeDir, { group_size: '3', seed: String(SEED), ...opts.overrides });
  const router = opts.router ?? new RecordingRouter([engine.url], TOKEN);
  const env = new MockActivityEnvironment();
  const beats: RolloutManifest[] = [];
  env.on('heartbeat', (d) => beats.push(JSON.parse(JSON.stringify(d))));
  const endpoints = { engines: router.engines, actor: 'unused', token: TOKEN, storeRoot };
  const input = { runId, groupIndex: GROUP, recipeDir: opts.agentDir ?? recipeDir, config };
  const result = await (env.run(rolloutGroup, endpoints, router, input) as Promise<GroupResult>);
  return { result, refs: groupRefs(runId, result), beats, router };
}

// The trajectory is the prompt ids, then exactly the ids the engine sampled for it, with their
// logprobs (stored as float32) and versions; loss_mask, logprobs and versions are set only there.
function expectPromptPlusSampled(t: Trajectory, prompt: number[], res: GenerateResponse) {
  const n = res.token_ids.length;
  expect(n).toBeGreaterThan(0);
  expect(t.tokens).toEqual([...prompt, ...res.token_ids]);
  expect(t.lossMask).toEqual([...prompt.map(() => 0), ...res.token_ids.map(() => 1)]);
  expect(t.logprobs).toEqual([...prompt.map(() => 0), ...res.logprobs.map(Math.fround)]);
  expect(t.versions).toEqual([...prompt.map(() => -1), ...res.versions]);
}

describe('an Env recipe and a ChatAgent recipe of the same task', () => {
  const target = copyTarget(deriveSeed(SEED, GROUP), 'abcd', 3);
  let envRun: Awaited<ReturnType<typeof run>>;
  let chatRun: Awaited<ReturnType<typeof run>>;
  beforeAll(async () => {
    envRun = await run('env-form', 'copy');
    chatRun = await run('chat-form', 'copy-chat');
  });

  test('each episode is one request to the engine and one trajectory in the store, recorded in the manifest', () => {
    for (const { result, refs, beats, router } of [envRun, chatRun]) {
      expect(result.failed).toBe(0);
      expect(refs.map((r) => r.split('/').slice(1).join('/'))).toEqual([0, 1, 2].map((e) => `trajectories/g${GROUP}/e${e}-s0.safetensors`));
      expect(router.calls.map((c) => c.session).sort()).toEqual(refs.map((_, e) => `${refs[0].split('/')[0]}/g${GROUP}/e${e}`));
      const manifest = beats[beats.length - 1];
      expect(Object.values(manifest.done).flatMap((d) => d.refs)).toEqual(refs);
      expect(result.tokens).toBe(router.calls.reduce((n, c) => n + c.res.token_ids.length, 0));
      expect([result.minVersion, result.maxVersion]).toEqual([0, 0]);
    }
  });

  test('the store files have the same tensor names, dtypes and metadata keys', () => {
    const header = (ref: string) => {
      const { tensors, metadata } = decodeSafetensors(fs.readFileSync(path.join(storeRoot, ref)), ref);
      return {
        tensors: Object.fromEntries(Object.entries(tensors).map(([name, t]) => [name, [t.dtype, t.shape.length]])),
        metadata: Object.keys(metadata).sort(),
      };
    };
    const envHeader = header(envRun.refs[0]);
    expect(envHeader.tensors).toEqual({ tokens: ['I32', 1], logprobs: ['F32', 1], versions: ['I32', 1], loss_mask: ['U8', 1] });
    for (const ref of [...envRun.refs, ...chatRun.refs]) expect(header(ref)).toEqual(envHeader);
  });

  test('Env trajectories: the observation tokenization plus the sampled ids', () => {
    const prompt = ChatTemplate.load(tinyModel()).tokenizer.encode(`copy ${target}>`);
    envRun.refs.forEach((ref, e) => {
      const call = envRun.router.calls.find((c) => c.session === `env-form/g${GROUP}/e${e}`)!;
      expect(call.body.prompt_token_ids).toEqual(prompt);
      expectPromptPlusSampled(readTrajectory(storeRoot, ref).trajectory, prompt, call.res);
    });
  });

  test('ChatAgent trajectories: the chat template render, tokenized, plus the sampled ids; the same task, rewarded from them', () => {
    const template = ChatTemplate.load(tinyModel());
    const render = template.render([{ role: 'user', content: `copy ${target}>` }], undefined, true);
    expect(render).toBe(`<|im_start|>user\ncopy ${target}><|im_end|>\n<|im_start|>assistant\n`);
    const prompt = template.tokenizer.encode(render);
    chatRun.refs.forEach((ref, e) => {
      const call = chatRun.router.calls.find((c) => c.session === `chat-form/g${GROUP}/e${e}`)!;
      expect(call.body.prompt_token_ids).toEqual(prompt);
      expect(call.body.sampling).toMatchObject({ max_tokens: 3, stop_token_ids: template.endOfTurnIds(), seed: deriveSeed(SEED, GROUP, e, 0) });
      const { trajectory, meta } = readTrajectory(storeRoot, ref);
      expectPromptPlusSampled(trajectory, prompt, call.res);
      // The agent saw the reply without its end-of-turn token and scored it with the copy reward.
      const ids = call.res.token_ids.filter((id) => !template.endOfTurnIds().includes(id));
      const reward = copyReward(template.tokenizer.decode(ids), target);
      expect(meta).toMatchObject({ run: 'chat-form', group: GROUP, episode: e, segment: 0, reward, finish: call.res.finish_reason });
      expect(chatRun.result.rewards[e]).toBe(reward);
    });
  });

  test('the Python actor loader accepts both', () => {
    const refs = [...envRun.refs, ...chatRun.refs];
    const script = `
import json, sys
sys.path.insert(0, "gpu-services")
from trajectories import load_segment
out = []
for ref in json.loads(sys.argv[2]):
    s = load_segment(sys.argv[1], ref)
    out.append({"tokens": s.tokens.tolist(), "mask": s.loss_mask.tolist(), "reward": s.reward, "segment": s.segment})
print(json.dumps(out))`;
    const loaded = JSON.parse(execFileSync(PYTHON, ['-c', script, storeRoot, JSON.stringify(refs)], {
      cwd: REPO_ROOT, env: { ...process.env, OMP_NUM_THREADS: '1' },
    }).toString());
    expect(loaded).toEqual(refs.map((ref) => {
      const { trajectory, meta } = readTrajectory(storeRoot, ref);
      return { tokens: trajectory.tokens, mask: trajectory.lossMask, reward: meta.reward, segment: 0 };
    }));
  });
});

describe('ChatAgent failures', () => {
  const fixtureRun = (runId: string, mode: string, router?: RecordingRouter) =>
    // No failure budget here: these tests look at each failed episode (test/unit/bad-input.test.ts tests the budget).
    run(runId, 'copy-chat', { overrides: { agent: 'chat-fixture-agent.ts', 'env.mode': mode, 'rollout.max_failed_fraction': '1' }, agentDir: FIXTURES, router });

  test('a conversation rewritten mid-episode: each segment is its own trajectory, all with the episode\'s reward', async () => {
    const { result, refs, beats, router } = await fixtureRun('compact', 'compact');
    expect(refs.map((r) => path.basename(r))).toEqual(['e0-s0', 'e0-s1', 'e1-s0', 'e1-s1', 'e2-s0', 'e2-s1'].map((k) => `${k}.safetensors`));
    expect(Object.values(beats[beats.length - 1].done).map((d) => d.refs.length)).toEqual([2, 2, 2]);
    expect(result.tokens).toBe(router.calls.reduce((n, c) => n + c.res.token_ids.length, 0));
    const template = ChatTemplate.load(tinyModel());
    for (const ref of refs) {
      const { trajectory, meta } = readTrajectory(storeRoot, ref);
      const call = router.calls.filter((c) => c.session === `compact/g${GROUP}/e${meta.episode}`)[meta.segment]; // one call per segment, in order
      const content = meta.segment === 0 ? 'hi>' : 'summary>';
      expectPromptPlusSampled(trajectory, template.tokenizer.encode(template.render([{ role: 'user', content }], undefined, true)), call.res);
      expect(meta.reward).toBe(0.5);
    }
  });

  test('a module without prompt() is named, and stops the activity without retries', async () => {
    const p = path.join(FIXTURES, 'chat-no-prompt-agent.ts');
    await expect(loadAgentRunner(p)).rejects.toThrow(`agent module ${p}: a 'chat' AgentRunner needs prompt: a function (task, settings) => ChatPrompt`);
    await expect(run('no-prompt', 'copy-chat', { overrides: { agent: 'chat-no-prompt-agent.ts' }, agentDir: FIXTURES })).rejects.toMatchObject({
      name: 'ApplicationFailure', nonRetryable: true, type: 'AgentModuleError', message: expect.stringContaining(`${p}: a 'chat' AgentRunner needs prompt`),
    });
  });

  test('an agent that throws fails its episode only', async () => {
    const { result, refs, beats } = await fixtureRun('throw-once', 'throw-once');
    expect(result.failed).toBe(1);
    expect(result.rewards).toEqual([0.5, 0.5]);
    const failed = Object.values(beats[beats.length - 1].failed);
    expect(failed).toEqual([expect.stringMatching(new RegExp(`^recipe copy-chat \\(test/unit/fixtures/chat-fixture-agent\\.ts:16\\), group ${GROUP} episode \\d: ` +
      'chat agent run\\(\\) failed: the first run fails on purpose$'))]);
  });

  test('an agent that never calls the policy, or gives no prompt messages, fails its episodes with the reason', async () => {
    const silent = await fixtureRun('silent', 'silent');
    expect([silent.result.failed, silent.refs]).toEqual([3, []]);
    expect(Object.values(silent.beats[silent.beats.length - 1].failed)[0]).toMatch(/run\(\): no token was sampled from the policy/);
    const badPrompt = await fixtureRun('bad-prompt', 'bad-prompt');
    expect(badPrompt.result.failed).toBe(3);
    expect(Object.values(badPrompt.beats[badPrompt.beats.length - 1].failed)[0]).toMatch(/prompt\(\): must return \{ messages: \[at least one\]/);
  });

  test('an engine failure the agent only saw as an HTTP error fails the activity (retried), not the episode', async () => {
    const dead = `http://127.0.0.1:${await freePort()}`;
    await expect(fixtureRun('dead-engine', 'plain', new RecordingRouter([dead], TOKEN)))
      .rejects.toMatchObject({ name: 'ServiceError', message: expect.stringContaining(`POST ${dead}/generate failed`) });
  });
});
