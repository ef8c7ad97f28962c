// A rollout worker dies (kill -9) in the middle of a generation; the retried rolloutGroup reuses the
// finished episodes without asking the engine again, replays the answered LLM calls of the
// unfinished ones from their journals (Env form: the framework's turns; ChatAgent form: the loopback
// server answers from the journal) and continues the call in progress from its saved ids, so the
// tokens, logprobs and versions saved before the kill are a prefix of the final trajectory.
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { RecipeConfig, REPO_ROOT } from '../../agents/recipe';
import type { GenerateChunk, GenerateRequest } from '../../activities/gpu-client';
import { EpisodeJournal, journalKey, readJournal, type JournalFile } from '../../activities/episode-journal';
import { rolloutGroup, type RolloutManifest } from '../../activities/rollout';
import { groupRefs } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import type { GroupResult, ResolvedGroupInput, ServiceEndpoints } from '../../activities/types';
import { RecordingRouter, startEngine, tinyModel, TOKEN, type Service } from './gpu-services';

const FIXTURES = path.join(__dirname, 'fixtures');
const SHORT = 4;
const LONG = 600;

let engine: Service;
let storeRoot: string;
beforeAll(async () => {
  engine = await startEngine(tinyModel());
  storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-resume-'));
});
afterAll(async () => {
  await engine.stop();
  fs.rmSync(storeRoot, { recursive: true, force: true });
});

const jsonLines = (file: string) => (fs.existsSync(file) ? fs.readFileSync(file, 'utf8').split('\n') : [])
  .flatMap((line) => { try { return [JSON.parse(line)]; } catch { return []; } }); // a line cut by the kill is skipped

// Runs the first attempt in a child process and kills it with SIGKILL once `ready` says so.
async function killedAttempt(input: ResolvedGroupInput, endpoints: ServiceEndpoints, ready: (beats: RolloutManifest[]) => boolean, jitterMs = 0) {
  const dir = fs.mkdtempSync(path.join(storeRoot, 'child-'));
  const heartbeats = path.join(dir, 'heartbeats.jsonl');
  const responses = path.join(dir, 'responses.jsonl');
  // node itself (not the tsx wrapper, which would leave its node child running after the kill).
  const child = spawn(process.execPath,
    ['--import', 'tsx', path.join(FIXTURES, 'rollout-child.ts'), JSON.stringify({ input, endpoints, heartbeats, responses })],
    { cwd: REPO_ROOT, stdio: ['ignore', 'ignore', 'pipe'] });
  let stderr = '';
  child.stderr!.on('data', (d) => (stderr += d));
  const exited = new Promise<number | null>((resolve) => child.once('exit', (code) => resolve(code)));
  let finished = false;
  void exited.then(() => (finished = true));
  while (!finished && !ready(jsonLines(heartbeats))) await new Promise((r) => setTimeout(r, 10));
  await new Promise((r) => setTimeout(r, Math.random() * jitterMs)); // so the kill lands anywhere in a chunk
  if (finished) throw new Error(`the first attempt ended before the kill: ${stderr}`);
  child.kill('SIGKILL');
  await exited;
  const beats: RolloutManifest[] = jsonLines(heartbeats);
  return { lastBeat: beats[beats.length - 1], responses: jsonLines(responses) as { session: string; tokens: number }[] };
}

async function retry(input: ResolvedGroupInput, endpoints: ServiceEndpoints, heartbeatDetails: RolloutManifest) {
  const router = new RecordingRouter(endpoints.engines, TOKEN);
  const env = new MockActivityEnvironment({ heartbeatDetails });
  const result = await (env.run(rolloutGroup, endpoints, router, input) as Promise<GroupResult>);
  return { result, refs: groupRefs(input.runId, result), router };
}

const sampledPart = (t: { tokens: number[]; logprobs: number[]; versions: number[]; lossMask: number[] }) => ({
  tokens: t.tokens.filter((_, i) => t.lossMask[i]), logprobs: t.logprobs.filter((_, i) => t.lossMask[i]),
  versions: t.versions.filter((_, i) => t.lossMask[i]),
});
const journalSampled = (j: JournalFile) => ({
  tokens: [...j.calls.flatMap((c) => c.token_ids), ...(j.current?.token_ids ?? [])],
  logprobs: [...j.calls.flatMap((c) => c.logprobs), ...(j.current?.logprobs ?? [])],
  versions: [...j.calls.flatMap((c) => c.versions), ...(j.current?.versions ?? [])],
});
const prefixOf = (a: ReturnType<typeof journalSampled>, b: ReturnType<typeof journalSampled>) => ({
  tokens: b.tokens.slice(0, a.tokens.length), logprobs: b.logprobs.slice(0, a.logprobs.length), versions: b.versions.slice(0, a.versions.length),
});

// What the killed attempt received from the engine for an episode but had not saved: regenerated.
function regenerated(responses: { session: string; tokens: number }[], session: string, saved: number) {
  return responses.filter((r) => r.session === session).reduce((n, r) => n + r.tokens, 0) - saved;
}

const config = (agent: string, seed: number, env: Record<string, unknown>, sampling: Record<string, unknown>) => RecipeConfig.parse({
  name: 'resume', agent, model: 'tiny', seed, group_size: 3, pool: { inflight: 1 }, batch: { groups: 1 }, train: { steps: 1 },
  checkpoint: { every: 1 }, max_context: 1000, sampling, algo: {}, env, rollout: { partial_tokens: 8 },
});

test('Env form: kill -9 mid-generation; finished episodes reused, answered turns replayed, the partial continued token-exactly', async () => {
  const runId = 'resume-env';
  const endpoints: ServiceEndpoints = { engines: [engine.url], actor: 'unused', token: TOKEN, storeRoot };
  const input: ResolvedGroupInput = {
    runId, groupIndex: 0, recipeDir: FIXTURES,
    config: config('long-agent.ts', 1, { long: LONG }, { max_tokens: SHORT, stop_token_ids: [] }),
  };
  // Kill once episode 0 is done and episodes 1 and 2 have saved part of their long turn.
  const { lastBeat, responses } = await killedAttempt(input, endpoints, (beats) => {
    const last = beats[beats.length - 1];
    return !!last?.done[0] && [1, 2].every((e) => (last.partial?.[e]?.tokens ?? 0) >= SHORT + 16);
  }, 300);
  expect(Object.keys(lastBeat.done)).toEqual(['0']);
  expect(JSON.stringify(lastBeat).length).toBeLessThan(2048); // refs and counts only, never tokens
  const saved = [1, 2].map((e) => readJournal(storeRoot, journalKey(runId, 0, e))!);
  saved.forEach((j) => {
    expect(j.calls.map((c) => c.token_ids.length)).toEqual([SHORT]); // turn 0 answered
    expect(j.current!.token_ids.length).toBeGreaterThanOrEqual(16); // turn 1 in progress
    expect(j.current!.token_ids.length).toBeLessThan(LONG);
  });
  const e0 = path.join(storeRoot, lastBeat.done[0].refs[0]);
  const e0Before = fs.statSync(e0).mtimeMs;

  const { result, refs, router } = await retry(input, endpoints, lastBeat);
  expect(result.failed).toBe(0);
  expect(refs).toHaveLength(3);
  expect(fs.statSync(e0).mtimeMs).toBe(e0Before); // episode 0 not rewritten
  expect(router.calls.map((c) => c.session).filter((s) => s.endsWith('/e0'))).toEqual([]); // nor regenerated
  for (const [i, e] of [1, 2].entries()) {
    const calls = router.calls.filter((c) => c.session === `${runId}/g0/e${e}`);
    const { trajectory } = readTrajectory(storeRoot, refs[e]);
    const final = sampledPart(trajectory);
    const partial = journalSampled(saved[i]);
    // Turn 0 was not asked again: the first request continues turn 1 right after the saved ids.
    const turn1Prompt = trajectory.tokens.slice(0, trajectory.tokens.length - (final.tokens.length - SHORT));
    expect(calls[0].body.prompt_token_ids).toEqual([...turn1Prompt, ...saved[i].current!.token_ids]);
    expect(prefixOf(partial, final)).toEqual(partial); // token-exact: ids, logprobs, versions
    expect(final.tokens).toHaveLength(SHORT + LONG);
    const lost = regenerated(responses, `${runId}/g0/e${e}`, partial.tokens.length);
    console.log(`Env resume, episode ${e}: ${partial.tokens.length} sampled tokens saved before the kill, ` +
      `${lost} received but unsaved (regenerated), ${calls.reduce((n, c) => n + c.res.token_ids.length, 0)} generated after the retry`);
    expect(lost).toBeLessThanOrEqual(2 * input.config.rollout.partial_tokens);
  }
});

test('ChatAgent form: the loopback server answers the journaled request, the interrupted one continues from its saved ids', async () => {
  const runId = 'resume-chat';
  const endpoints: ServiceEndpoints = { engines: [engine.url], actor: 'unused', token: TOKEN, storeRoot };
  const input: ResolvedGroupInput = {
    runId, groupIndex: 0, recipeDir: FIXTURES,
    config: { ...config('long-chat-agent.ts', 3, { short: SHORT, long: LONG }, { max_tokens: LONG }), group_size: 2 },
  };
  // Kill once both episodes have saved part of their second request (the seed keeps it from stopping early).
  const { lastBeat, responses } = await killedAttempt(input, endpoints, () =>
    [0, 1].every((e) => (readJournal(storeRoot, journalKey(runId, 0, e))?.current?.token_ids.length ?? 0) >= 16));
  expect(lastBeat.done).toEqual({});
  expect(Object.keys(lastBeat.partial!)).toEqual(['0', '1']);
  const saved = [0, 1].map((e) => readJournal(storeRoot, journalKey(runId, 0, e))!);
  saved.forEach((j) => expect(j.calls).toHaveLength(1));

  const { result, refs, router } = await retry(input, endpoints, lastBeat);
  expect(result.failed).toBe(0);
  for (const e of [0, 1]) {
    const calls = router.calls.filter((c) => c.session === `${runId}/g0/e${e}`);
    // A reply that does not re-render as sampled starts a new segment: the episode's sampled ids
    // are those of its segments in order.
    const segments = refs.filter((r) => path.basename(r).startsWith(`e${e}-`)).map((r) => sampledPart(readTrajectory(storeRoot, r).trajectory));
    const final = { tokens: segments.flatMap((s) => s.tokens), logprobs: segments.flatMap((s) => s.logprobs), versions: segments.flatMap((s) => s.versions) };
    const partial = journalSampled(saved[e]);
    // The first request was answered from the journal: the engine saw only the continuation.
    expect(calls[0].body.prompt_token_ids.slice(-saved[e].current!.token_ids.length)).toEqual(saved[e].current!.token_ids);
    expect(calls[0].body.prompt_token_ids.length).toBeGreaterThan(saved[e].calls[0].token_ids.length + saved[e].current!.token_ids.length);
    expect(prefixOf(partial, final)).toEqual(partial);
    const lost = regenerated(responses, `${runId}/g0/e${e}`, partial.tokens.length);
    console.log(`ChatAgent resume, episode ${e}: ${partial.tokens.length} sampled tokens saved before the kill, ` +
      `${lost} received but unsaved (regenerated), ${calls.reduce((n, c) => n + c.res.token_ids.length, 0)} generated after the retry`);
  }
});

test('an agent that asks something else than its journal recorded gets fresh generations from that call on', async () => {
  const router = new RecordingRouter([engine.url], TOKEN);
  const engineCall = (body: GenerateRequest) => router.generate('s', body);
  const every = { tokens: 8, seconds: 60 };
  const sampling = { max_tokens: 4, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [], seed: 1 };
  const first = new EpisodeJournal(storeRoot, 'nondeterministic/e0.json', null, every, () => undefined);
  const a = await first.generate({ prompt_token_ids: [104, 105], sampling }, engineCall);
  await first.generate({ prompt_token_ids: [104, 105, ...a.token_ids, 62], sampling }, engineCall);
  expect(router.calls).toHaveLength(2);

  const again = new EpisodeJournal(storeRoot, 'nondeterministic/e0.json', readJournal(storeRoot, 'nondeterministic/e0.json'), every, () => undefined);
  expect(await again.generate({ prompt_token_ids: [104, 105], sampling }, engineCall)).toMatchObject({ token_ids: a.token_ids, logprobs: a.logprobs });
  expect(router.calls).toHaveLength(2); // answered from the journal
  await again.generate({ prompt_token_ids: [104, 105, ...a.token_ids, 63], sampling }, engineCall); // another observation
  expect(router.calls).toHaveLength(3);
  expect(again.stats).toMatchObject({ replayedCalls: 1, resumedTokens: 0, generatedTokens: 4 });
});

test('a short call is asked unstreamed and its journal written only once a save is due, or a save interval later', async () => {
  const router = new RecordingRouter([engine.url], TOKEN);
  const streamed: boolean[] = [];
  const engineCall = (body: GenerateRequest, onChunk?: (c: GenerateChunk) => boolean) => {
    streamed.push(onChunk !== undefined);
    return router.generate('s', body, undefined, onChunk);
  };
  const sampling = { max_tokens: 4, temperature: 1, top_p: 1, top_k: 0, stop_token_ids: [], seed: 1 };
  const file = path.join(storeRoot, 'short/e0.json');
  const journal = new EpisodeJournal(storeRoot, 'short/e0.json', null, { tokens: 8, seconds: 0.2 }, () => undefined);
  const a = await journal.generate({ prompt_token_ids: [104, 105], sampling }, engineCall);
  expect(fs.existsSync(file)).toBe(false); // 4 of 8 tokens: not due yet
  for (let waited = 0; !fs.existsSync(file) && waited < 10_000; waited += 50) await new Promise((r) => setTimeout(r, 50));
  expect(readJournal(storeRoot, 'short/e0.json')!.calls).toHaveLength(1); // saved a save interval later
  await journal.generate({ prompt_token_ids: [104, 105, ...a.token_ids, 62], sampling }, engineCall);
  expect(readJournal(storeRoot, 'short/e0.json')!.calls).toHaveLength(2); // 8 tokens since the last save: at once
  await journal.generate({ prompt_token_ids: [104], sampling: { ...sampling, max_tokens: 9 } }, engineCall);
  expect(streamed).toEqual([false, false, true]); // only a call longer than a save interval streams
  await journal.discard();
  expect(fs.existsSync(file)).toBe(false);

  // An episode over before its deferred save never writes a journal.
  const quick = new EpisodeJournal(storeRoot, 'short/e1.json', null, { tokens: 8, seconds: 0.2 }, () => undefined);
  await quick.generate({ prompt_token_ids: [104, 105], sampling }, engineCall);
  await quick.discard();
  await new Promise((r) => setTimeout(r, 400));
  expect(fs.existsSync(path.join(storeRoot, 'short/e1.json'))).toBe(false);
});
