// recipes/geo through the rolloutGroup activity: a real engine and a real actor process with a tiny random-init
// Qwen3-VL, the real loopback server and the stock `openai` client sending a Pillow-drawn triangle as an image_url
// data URL. The trajectory holds the exact expanded ids the engine generated over and names the episode's stored
// image; the actor's /logprobs over that trajectory and that image equals the engine's sampled logprobs. An image
// that does not decode fails its episode (a 400 naming message and part), not the activity. With env.python_tool the
// episode is multi-turn: the sandbox's output is a context turn of the one segment, the image stays stored once.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { evaluate, type EvaluateResult } from '../../activities/evaluate';
import type { GenerateChunk, GenerateRequest, GenerateResponse } from '../../activities/gpu-client';
import { rolloutGroup, type RolloutManifest } from '../../activities/rollout';
import { groupRefs, type Trajectory } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import type { GroupResult } from '../../activities/types';
import { ChatTemplate } from '../../agents/chat-template';
import { loadRecipe, REPO_ROOT } from '../../agents/recipe';
import { AgentRunner, geoProblem, geoReward } from '../../recipes/geo/agent';
import { deriveSeed } from '../../agents/env-runner';
import { EngineRouter } from '../../agents/router';
import { PYTHON, RecordingRouter, startActor, startEngine, TOKEN, type Service } from './gpu-services';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'geo');
const [IM_END, V_START, V_END, IMAGE_PAD] = [258, 259, 260, 261];
let dir: string;
let storeRoot: string;
let engine: Service;
let actor: Service;

beforeAll(async () => { // a loaded machine takes minutes to start two torch processes
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-geo-'));
  storeRoot = path.join(dir, 'store');
  execFileSync(PYTHON, ['recipes/geo/make_tiny_vlm.py', '--out', path.join(dir, 'model')], { cwd: REPO_ROOT, stdio: 'ignore' });
  [engine, actor] = await Promise.all([startEngine(path.join(dir, 'model')),
    startActor(path.join(dir, 'model'), path.join(dir, 'actor'))]);
}, 900_000);
afterAll(async () => {
  await Promise.all([engine?.stop(), actor?.stop()]);
  fs.rmSync(dir, { recursive: true, force: true });
});

async function run(runId: string, overrides: Record<string, string> = {}, agentDir = RECIPE_DIR,
  router = new RecordingRouter([engine.url], TOKEN)) {
  const config = loadRecipe(RECIPE_DIR, { model: path.join(dir, 'model'), group_size: '2', ...overrides });
  const env = new MockActivityEnvironment();
  const beats: RolloutManifest[] = [];
  env.on('heartbeat', (d) => beats.push(JSON.parse(JSON.stringify(d))));
  const endpoints = { engines: router.engines, actor: actor.url, token: TOKEN, storeRoot };
  const result = await (env.run(rolloutGroup, endpoints, router, { runId, groupIndex: 0, recipeDir: agentDir, config }) as
    Promise<GroupResult>);
  return { result, refs: groupRefs(runId, result), router, manifest: beats[beats.length - 1] };
}

// The actor's logprobs of a stored trajectory (fed its stored images) against the engine's, on the sampled tokens.
async function actorDiffs(t: Trajectory): Promise<number[]> {
  const res = await fetch(`${actor.url}/logprobs`, {
    method: 'POST', headers: { authorization: `Bearer ${TOKEN}`, 'content-type': 'application/json' },
    body: JSON.stringify({ token_ids: [t.tokens], images: [t.images!.map((p) => path.join(storeRoot, p))] }),
  });
  expect(res.status).toBe(200);
  const actorLogp: number[] = ((await res.json()) as { logprobs: number[][] }).logprobs[0];
  return t.lossMask.flatMap((m, i) => (m ? [Math.abs(actorLogp[i] - t.logprobs[i])] : []));
}

test('a geo episode: expanded ids, the image stored once with the episode, actor logprobs = engine logprobs', async () => {
  const { result, refs, router } = await run('geo');
  expect(result.failed).toBe(0);
  expect(refs).toHaveLength(2);
  const problem = geoProblem(deriveSeed(0, 0), { kinds: ['angle', 'perimeter'], size: 128 });
  const diffs: number[] = [];
  for (const [e, ref] of refs.entries()) {
    const { trajectory: t } = readTrajectory(storeRoot, ref);
    const call = router.calls.find((c) => c.session === `geo/g0/e${e}`)!;
    // the engine generated over these ids with this image; the trajectory is exactly them plus what it sampled
    expect(t.tokens).toEqual([...call.body.prompt_token_ids, ...call.res.token_ids]);
    const start = t.tokens.indexOf(V_START);
    expect(t.tokens.slice(start + 1, t.tokens.indexOf(V_END))).toEqual(Array(64).fill(IMAGE_PAD)); // 128x128: 8x8 merged patches
    expect(t.images).toEqual([`geo/images/g0/e${e}/${path.basename(call.body.images![0])}`]);
    expect(call.body.images).toEqual([path.join(storeRoot, t.images![0])]);
    expect(fs.readdirSync(path.join(storeRoot, 'geo', 'images', 'g0', `e${e}`))).toHaveLength(1);
    diffs.push(...await actorDiffs(t));
  }
  expect(result.rewards.every((r) => r === 0 || r === 1)).toBe(true);
  expect([geoReward('C = 86', problem.answer), geoReward(`${problem.answer}`, problem.answer)]).toEqual([+(problem.answer === 86), 1]);
  const imageDir = path.join(storeRoot, 'geo', 'images', 'g0', 'e0');
  const imageBytes = fs.readdirSync(imageDir).reduce((n, f) => n + fs.statSync(path.join(imageDir, f)).size, 0);
  const trajBytes = fs.statSync(path.join(storeRoot, refs[0])).size;
  console.log(`geo: engine vs actor max |logprob diff| on ${diffs.length} sampled tokens ${Math.max(...diffs).toExponential(2)}; `
    + `stored bytes per episode: image ${imageBytes}, trajectory ${trajBytes}`);
  expect(diffs.length).toBeGreaterThan(0);
  expect(Math.max(...diffs)).toBeLessThan(1e-4);
}, 600_000);

// A policy that calls the python tool on its first turn (which the random tiny VLM cannot write): the first request
// of each session gets `replies[0]` as if sampled, later ones `replies[turn]` when given, else the real engine.
class ScriptedRouter extends RecordingRouter {
  constructor(urls: string[], private replies: (session: string) => (string | undefined)[]) { super(urls, TOKEN); }
  async generate(session: string, body: GenerateRequest, signal?: AbortSignal,
    onChunk?: (chunk: GenerateChunk) => boolean): Promise<GenerateResponse> {
    const reply = this.replies(session)[this.calls.filter((c) => c.session === session).length];
    if (reply === undefined) return super.generate(session, body, signal, onChunk);
    const ids = [...Buffer.from(reply), IM_END];
    const res = { request_id: 'scripted', token_ids: ids, logprobs: ids.map(() => -1), versions: ids.map(() => 0),
      finish_reason: 'stop' as const };
    this.calls.push({ session, body, res });
    return res;
  }
}

test('env.python_tool: the policy runs Python between turns; the tool turn is context, the image stored once', async () => {
  const problem = geoProblem(deriveSeed(0, 0), { kinds: ['angle', 'perimeter'], size: 128 });
  const call = '<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>';
  // episode 0 answers from the real engine after the tool turn; episode 1 with the right number (reward 1)
  const router = new ScriptedRouter([engine.url], (s) => (s.endsWith('e0') ? [call] : [call, `It is ${problem.answer}`]));
  const { result, refs } = await run('geo-tool', { 'env.python_tool': 'true', max_context: '1024', 'sampling.max_tokens': '8' },
    RECIPE_DIR, router);
  expect(result.failed).toBe(0);
  expect(refs).toHaveLength(2); // one segment per episode: each turn extends the conversation
  const template = ChatTemplate.load(path.join(dir, 'model'));
  // (the tiny VLM's template, rendered with trim_blocks as transformers does, drops the newline before the close)
  const toolTurn = template.tokenizer.encode(
    '\n<|im_start|>user\n<tool_response>\n42</tool_response><|im_end|>\n<|im_start|>assistant\n');
  for (const [e, ref] of refs.entries()) {
    const { trajectory: t } = readTrajectory(storeRoot, ref);
    const [first, second] = router.calls.filter((c) => c.session === `geo-tool/g0/e${e}`);
    const afterCall = first.body.prompt_token_ids.length + first.res.token_ids.length;
    // the second turn's prompt: the first, the sampled call, then the sandbox's output as a context turn
    expect(second.body.prompt_token_ids).toEqual([...first.body.prompt_token_ids, ...first.res.token_ids, ...toolTurn]);
    expect(t.tokens).toEqual([...second.body.prompt_token_ids, ...second.res.token_ids]);
    expect(t.lossMask).toEqual([...first.body.prompt_token_ids.map(() => 0), ...first.res.token_ids.map(() => 1),
      ...toolTurn.map(() => 0), ...second.res.token_ids.map(() => 1)]);
    expect(t.tokens.slice(afterCall, afterCall + toolTurn.length)).toEqual(toolTurn);
    // the image: in the context once, processed and stored once for the episode, named once by the trajectory
    expect(t.tokens.filter((id) => id === IMAGE_PAD)).toHaveLength(64);
    expect(second.body.images).toEqual(first.body.images);
    expect(t.images).toHaveLength(1);
    expect(fs.readdirSync(path.join(storeRoot, 'geo-tool', 'images', 'g0', `e${e}`))).toHaveLength(1);
    const answer = Buffer.from(second.res.token_ids.filter((id) => id < 256)).toString();
    expect(result.rewards[e]).toBe(geoReward(answer, problem.answer));
  }
  expect(result.rewards[1]).toBe(1);
  // the tokens the engine sampled after the tool turn, over the image: the actor computes the engine's logprobs
  const { trajectory: t0 } = readTrajectory(storeRoot, refs[0]);
  const sampled = router.calls.find((c) => c.session === 'geo-tool/g0/e0' && c.res.request_id !== 'scripted')!.res;
  const diffs = (await actorDiffs(t0)).slice(-sampled.token_ids.length);
  console.log(`geo with the python tool: ${t0.tokens.length} tokens, engine vs actor max |logprob diff| on the `
    + `${diffs.length} tokens sampled after the tool turn ${Math.max(...diffs).toExponential(2)}`);
  expect(Math.max(...diffs)).toBeLessThan(1e-4);
  expect(() => AgentRunner.prompt({ groupIndex: 0, seed: 1 }, { python_tool: 'yes' }))
    .toThrow('env.python_tool must be true or false, got "yes"');
  expect(() => AgentRunner.prompt({ groupIndex: 0, seed: 1 }, { python_tool: true, max_turns: 0 }))
    .toThrow('env.max_turns must be a whole number of replies >= 1, got 0');
}, 600_000);

test('an image that does not decode fails its episode with a 400 naming message and part, not the activity', async () => {
  const { result, refs, manifest } = await run('geo-bad', { 'rollout.max_failed_fraction': '1' },
    path.join(__dirname, 'fixtures', 'geo-bad-image'));
  expect(result.failed).toBe(2);
  expect(refs).toEqual([]);
  for (const message of Object.values(manifest.failed)) {
    expect(message).toMatch(/400 messages\[0\]\.content\[1\]: .*image does not decode/);
  }
}, 600_000);

test('the Env form: observations carry images, the same picture twice is one stored file', async () => {
  const { result, refs, router } = await run('geo-env', {}, path.join(__dirname, 'fixtures', 'geo-env'));
  expect(result.failed).toBe(0);
  const { trajectory: t } = readTrajectory(storeRoot, refs[0]);
  const turns = router.calls.filter((c) => c.session === 'geo-env/g0/e0');
  expect(turns).toHaveLength(2);
  expect(turns[1].body.images).toHaveLength(2);
  expect(turns[1].body.images![0]).toBe(turns[1].body.images![1]); // content-addressed: one file
  expect(t.images).toEqual([0, 1].map(() => `geo-env/images/g0/e0/${path.basename(turns[0].body.images![0])}`));
  expect(t.tokens.filter((id) => id === IMAGE_PAD)).toHaveLength(128);
  expect(t.tokens.slice(0, turns[1].body.prompt_token_ids.length)).toEqual(turns[1].body.prompt_token_ids);
  const diffs = await actorDiffs(t);
  console.log(`geo env form: engine vs actor max |logprob diff| on ${diffs.length} sampled tokens ${Math.max(...diffs).toExponential(2)}`);
  expect(Math.max(...diffs)).toBeLessThan(1e-4);
}, 600_000);

test('evaluation episodes take images too; their folder is removed afterwards', async () => {
  const config = loadRecipe(RECIPE_DIR, { model: path.join(dir, 'model'), 'eval.prompts': '1', 'eval.samples': '2' });
  const res = await (new MockActivityEnvironment().run(evaluate, new EngineRouter([engine.url], TOKEN),
    { runId: 'geo-eval', step: 1, recipeDir: RECIPE_DIR, config }, {}, storeRoot) as Promise<EvaluateResult>);
  expect(res.failed).toBe(0);
  expect(fs.existsSync(path.join(storeRoot, 'geo-eval', 'images', 'eval-s1'))).toBe(false);
}, 600_000);
