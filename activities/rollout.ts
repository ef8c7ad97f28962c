// Activity rolloutGroup: the G episodes of one prompt group, run concurrently against the engines.
// Each finished episode is written to the trajectory store first (one file per segment), then
// recorded in the heartbeat manifest; a retried activity reads the manifest and runs only the
// episodes not yet recorded. An unfinished episode resumes from its journal in the store
// (activities/episode-journal.ts): its answered LLM calls are replayed to the agent and the call in
// progress continues from its saved ids. The two agent forms differ only in how one episode is run.
import { promises as fs } from 'node:fs';
import * as path from 'node:path';
import { Context } from '@temporalio/activity';
import { ApplicationFailure } from '@temporalio/common';
import { runChatEpisode, type ChatEpisode, type ChatPrompt } from '../agents/chat-runner';
import type { GenerateFn, ProcessImageFn } from '../agents/chat-session';
import { ChatTemplate } from '../agents/chat-template';
import {
  checkEnv, loadAgentRunner, type ChatAgentRunner, type EnvAgentRunner, type GroupTask, type Pools,
} from '../agents/contract';
import { AgentError, deriveSeed, runEnvEpisode } from '../agents/env-runner';
import { LoopbackServer } from '../agents/loopback';
import { REPO_ROOT, resolveModelDir, type RecipeConfig } from '../agents/recipe';
import type { EngineRouter } from '../agents/router';
import { tokenizerFor } from '../agents/tokenizer';
import { EpisodeJournal, journalKey, readJournal } from './episode-journal';
import { ServiceError, type GenerateRequest, type GenerateResponse } from './gpu-client';
import { trajectoryKey, writeTrajectory, type Trajectory } from './store';
import { carriesSample, type EpisodeSample, type GroupResult, type ResolvedGroupInput, type ServiceEndpoints } from './types';

interface EpisodeRecord {
  refs: string[];
  reward: number;
  tokens: number; // sampled tokens
  minVersion: number;
  maxVersion: number;
  metrics?: Record<string, number>; // agent/<name> and pool/<name>/calls|seconds of this episode
}

// What the activity heartbeats: small (refs, no tokens), and enough to resume.
export interface RolloutManifest {
  done: Record<number, EpisodeRecord>; // episode index -> its store refs and reward
  failed: Record<number, string>; // episode index -> the agent's error
  partial?: Record<number, { ref: string; tokens: number }>; // unfinished episode -> its journal, sampled tokens saved
}

// How one episode is run, by either agent form: given its index and the engine call bound to its
// router session, it returns the episode's segments (one trajectory each) and its reward.
// Evaluation (activities/evaluate.ts) runs its episodes through the same runners.
export interface Episode { segments: Trajectory[]; reward: number; finish: string; metrics?: Record<string, number> }
// generate streams the sampled ids to onToken when given (see EpisodeJournal.generate); pools: the
// recipe's other pools, bound to the episode (poolClients); processImage: an image of the episode processed by
// its engine and stored in the episode's image folder (vision-language policies).
export type EpisodeRunner = (episode: number,
  generate: (body: GenerateRequest, onToken?: (id: number) => boolean) => Promise<GenerateResponse>,
  pools?: Pools, processImage?: ProcessImageFn) => Promise<Episode>;

// The recipe's pools (`pools`) as one episode's clients: each call journaled when a journal is given
// (a retried episode does not ask again), and each call asked (not replayed) counted in metrics as
// pool/<name>/calls and pool/<name>/seconds. A pool engine that fails (unreachable, hung, 5xx) is kept in
// `failed`: the episode's code sees the error, but the activity fails with it (and is retried), as for the
// policy's engines; it is not the recipe's fault, so it is not counted against the failure budget.
export function poolClients(routers: Record<string, EngineRouter>, config: RecipeConfig, session: string,
  signal: AbortSignal, journal: EpisodeJournal | null, metrics: Record<string, number>, failed: { error?: unknown } = {}): Pools {
  const missing = Object.keys(config.pools).filter((name) => !routers[name]);
  if (missing.length) {
    throw ApplicationFailure.nonRetryable(`the recipe's pools ${missing.join(', ')} have no engines on this worker `
      + `(MOLT_POOLS has ${Object.keys(routers).join(', ') || 'none'}): start the stack with the recipe's pools`, 'PoolMissing');
  }
  return Object.fromEntries(Object.keys(config.pools).map((name) => {
    const router = routers[name];
    const asked = <T>(ask: () => Promise<T>) => async () => {
      const started = Date.now();
      try {
        return await ask();
      } catch (e) {
        if (e instanceof ServiceError && (e.status === undefined || e.status >= 500)) failed.error ??= e;
        throw e;
      } finally {
        metrics[`pool/${name}/calls`] = (metrics[`pool/${name}/calls`] ?? 0) + 1;
        metrics[`pool/${name}/seconds`] = (metrics[`pool/${name}/seconds`] ?? 0) + (Date.now() - started) / 1000;
      }
    };
    const call = <T>(request: object, ask: () => Promise<T>) => (journal ? journal.pool(name, request, asked(ask)) : asked(ask)());
    const at = `${session}/${name}`;
    return [name, {
      generate: (body: GenerateRequest) => call({ generate: body }, () => router.generate(at, body, signal)),
      score: (ids: number[]) => call({ score: ids }, () => router.score(at, ids, signal)),
    }];
  }));
}

const addTo = (sum: Record<string, number>, add: Record<string, number> = {}) => {
  for (const [k, v] of Object.entries(add)) sum[k] = (sum[k] ?? 0) + v;
  return sum;
};

// The recipe's agent module; one that does not load fails the same way on every retry: stop at once.
export async function loadRecipeAgent(recipeDir: string, config: RecipeConfig): Promise<{ modulePath: string; runner: EnvAgentRunner | ChatAgentRunner }> {
  const modulePath = path.resolve(recipeDir, config.agent);
  const runner = await loadAgentRunner(modulePath).catch((e) => {
    throw ApplicationFailure.nonRetryable((e as Error).message, 'AgentModuleError');
  });
  return { modulePath, runner };
}

// The episodes of one prompt group (one task), in either agent form.
export function episodeRunner(runner: EnvAgentRunner | ChatAgentRunner, modulePath: string, config: RecipeConfig, task: GroupTask): EpisodeRunner {
  return runner.kind === 'env' ? envEpisodes(runner, modulePath, config, task) : chatEpisodes(runner, modulePath, config, task);
}

// The env failed, or the engine refused this episode's request (e.g. a prompt too long for it): the
// episode fails, not the activity.
export const episodeFailed = (e: unknown) => e instanceof AgentError || (e instanceof ServiceError && e.status === 400);

// A failed episode's error names the recipe, the file (and line) where the recipe's own code threw
// (the first stack frame outside the framework in the causes the AgentError wraps; else the module)
// and the episode: "recipe math (recipes/math/problems.ts:57), group 3 episode 1: env step threw: ...".
const FRAMEWORK_DIRS = ['agents', 'activities', 'workflows', 'client', 'infra'].map((d) => path.join(REPO_ROOT, d) + path.sep);
const ownFrame = (file: string) => !file.includes(`${path.sep}node_modules${path.sep}`) && !FRAMEWORK_DIRS.some((d) => file.startsWith(d));
export function episodeFailure(e: Error, recipe: string, modulePath: string, groupIndex: number, episode: number): string {
  let where = modulePath;
  for (let c: unknown = e.cause; c instanceof Error && where === modulePath; c = c.cause) {
    const frames = (c.stack ?? '').matchAll(/^\s+at (?:.* \()?(\/[^():\s]+):(\d+):\d+\)?$/gm); // "at f (/file:1:2)", "at /file:1:2"
    const own = [...frames].find((m) => ownFrame(m[1]));
    if (own) where = `${own[1]}:${own[2]}`;
  }
  const shown = where.startsWith(REPO_ROOT + path.sep) ? path.relative(REPO_ROOT, where) : where;
  return `recipe ${recipe} (${shown}), group ${groupIndex} episode ${episode}: ${e.message}`;
}

export async function rolloutGroup(endpoints: ServiceEndpoints, router: EngineRouter, input: ResolvedGroupInput,
  pools: Record<string, EngineRouter> = {}): Promise<GroupResult> {
  const started = Date.now();
  const ctx = Context.current();
  const { runId, groupIndex, config } = input;
  const engines = input.engines ?? endpoints.engines; // the run's engines when the group started
  const { modulePath, runner } = await loadRecipeAgent(input.recipeDir, config);

  const previous = ctx.info.heartbeatDetails as RolloutManifest | undefined;
  const manifest: RolloutManifest = { done: { ...previous?.done }, failed: { ...previous?.failed }, partial: { ...previous?.partial } };
  if (previous) ctx.log.info('rolloutGroup resumed', { groupIndex, reused: Object.keys(manifest.done).length });

  const task: GroupTask = { groupIndex, seed: deriveSeed(config.seed, groupIndex) }; // one task per group
  const runAgentEpisode = episodeRunner(runner, modulePath, config, task);
  const carrying = carriesSample(groupIndex, config.batch.groups);
  let sample: EpisodeSample | undefined; // the first episode this attempt finished, in a group that carries one

  const runEpisode = async (episode: number) => {
    const session = `${runId}/g${groupIndex}/e${episode}`;
    // The journal's key is deterministic: a retry finds it even if the heartbeat naming it was lost.
    const key = journalKey(runId, groupIndex, episode);
    const every = { tokens: config.rollout.partial_tokens, seconds: config.rollout.partial_seconds };
    const journal = new EpisodeJournal(endpoints.storeRoot, key, readJournal(endpoints.storeRoot, key), every, () => {
      if (episode in manifest.done) return;
      manifest.partial![episode] = { ref: key, tokens: journal.tokens() };
      ctx.heartbeat(manifest);
    });
    const poolMetrics: Record<string, number> = {};
    const poolFailure: { error?: unknown } = {};
    try {
      const clients = poolClients(pools, config, session, ctx.cancellationSignal, journal, poolMetrics, poolFailure);
      // Content-addressed: an image sent in several turns (or on a retry) is one file of the episode's folder.
      const imageDir = path.join(endpoints.storeRoot, runId, 'images', `g${groupIndex}`, `e${episode}`);
      const result = await runAgentEpisode(episode, (body, onToken) =>
        journal.generate(body, (part, onChunk) => router.generate(session, part, ctx.cancellationSignal, onChunk, engines), onToken),
      clients, (data) => router.image(session, { data, dir: imageDir }, ctx.cancellationSignal, engines));
      if (poolFailure.error) throw poolFailure.error; // even if the agent carried on without the answer
      // On-policy distillation: the teacher pool scores the exact ids of every segment (journaled like any pool call).
      if (config.teacher) {
        for (const t of result.segments) {
          const scored = await clients[config.teacher].score(t.tokens);
          if (scored.length !== t.tokens.length) throw new Error(`teacher ${config.teacher}: ${scored.length} logprobs for ${t.tokens.length} ids`);
          t.teacherLogprobs = scored.map((lp, i) => (t.lossMask[i] ? lp : 0));
        }
      }
      if (journal.stats.replayedCalls || journal.stats.resumedTokens) {
        ctx.log.info('episode resumed from its journal', { groupIndex, episode, ...journal.stats });
      }
      const refs = result.segments.map((_, segment) => trajectoryKey(runId, groupIndex, episode, segment));
      for (const [segment, trajectory] of result.segments.entries()) {
        await writeTrajectory(endpoints.storeRoot, refs[segment], trajectory,
          { run: runId, group: groupIndex, episode, segment, reward: result.reward, finish: result.finish });
      }
      const sampled = result.segments.flatMap((t) => t.versions.filter((_, i) => t.lossMask[i]));
      manifest.done[episode] = {
        refs, reward: result.reward, tokens: sampled.length,
        minVersion: sampled.length ? Math.min(...sampled) : -1, maxVersion: sampled.length ? Math.max(...sampled) : -1,
        metrics: addTo(Object.fromEntries(Object.entries(result.metrics ?? {}).map(([k, v]) => [`agent/${k}`, v])), poolMetrics),
      };
      delete manifest.partial![episode];
      if (carrying) sample ??= describeEpisode(episode, result, config);
      await journal.discard();
    } catch (e) {
      const error = poolFailure.error ?? e; // a pool engine's failure, even if the env wrapped it in its own
      if (episodeFailed(error)) await journal.discard(); // a failed episode is never run again
      throw error;
    } finally {
      router.endSession(session);
      for (const [name, r] of Object.entries(pools)) r.endSession(`${session}/${name}`);
    }
    ctx.heartbeat(manifest);
  };

  const todo = Array.from({ length: config.group_size }, (_, e) => e).filter((e) => !(e in manifest.done) && !(e in manifest.failed));
  const outcomes = await Promise.allSettled(todo.map(runEpisode));
  let fatal: unknown;
  outcomes.forEach((o, i) => {
    if (o.status === 'fulfilled') return;
    if (episodeFailed(o.reason)) {
      const message = episodeFailure(o.reason, config.name, modulePath, groupIndex, todo[i]);
      manifest.failed[todo[i]] = message.slice(0, 500); // the manifest stays small; the log has it all
      ctx.log.warn('episode failed', { groupIndex, episode: todo[i], error: message });
    } else {
      fatal ??= o.reason;
    }
  });
  ctx.heartbeat(manifest);
  if (fatal) throw fatal; // the engines failed us: Temporal retries, finished episodes are kept
  // Every journal of the group is gone: its folder too (store GC removes any left by a lost worker).
  await fs.rmdir(path.join(endpoints.storeRoot, path.dirname(journalKey(runId, groupIndex, 0)))).catch(() => undefined);
  const failed = Object.keys(manifest.failed).length;
  if (failed > config.rollout.max_failed_fraction * config.group_size) {
    const first = Object.entries(manifest.failed)[0];
    throw ApplicationFailure.nonRetryable(
      `group ${groupIndex}: ${failed} of ${config.group_size} episodes failed, over the failure budget ` +
      `rollout.max_failed_fraction=${config.rollout.max_failed_fraction}; ${first[1]}`,
      'FailureBudgetExceeded');
  }

  const episodes = Object.keys(manifest.done).map(Number).sort((a, b) => a - b);
  const done = episodes.map((e) => manifest.done[e]);
  const versions = done.filter((d) => d.tokens > 0);
  return {
    groupIndex,
    episodes,
    segments: done.map((d) => d.refs.length),
    rewards: done.map((d) => d.reward),
    failed,
    tokens: done.reduce((n, d) => n + d.tokens, 0),
    minVersion: versions.length ? Math.min(...versions.map((d) => d.minVersion)) : -1,
    maxVersion: versions.length ? Math.max(...versions.map((d) => d.maxVersion)) : -1,
    seconds: (Date.now() - started) / 1000,
    metrics: done.reduce((sum, d) => addTo(sum, d.metrics), {} as Record<string, number>),
    ...(sample ? { sample } : {}),
  };
}

// Decoded for reading only (never re-encoded): the prompt is what precedes the first sampled token
// of the first segment, the completion what follows it in the last segment, tool results included.
const SAMPLE_CHARS = 400;
function describeEpisode(episode: number, result: Episode, config: RecipeConfig): EpisodeSample {
  const tokenizer = tokenizerFor(resolveModelDir(config.model));
  const firstSampled = (t: Trajectory) => Math.max(0, t.lossMask.findIndex((m) => m > 0));
  const [first, last] = [result.segments[0], result.segments[result.segments.length - 1]];
  const prompt = tokenizer.decode(first.tokens.slice(0, firstSampled(first)), true);
  const completion = tokenizer.decode(last.tokens.slice(firstSampled(last)));
  return {
    episode, reward: result.reward,
    prompt: prompt.length > SAMPLE_CHARS ? `...${prompt.slice(-SAMPLE_CHARS)}` : prompt,
    completion: completion.length > SAMPLE_CHARS ? `${completion.slice(0, SAMPLE_CHARS)}...` : completion,
  };
}

function envEpisodes(runner: EnvAgentRunner, modulePath: string, config: RecipeConfig, task: GroupTask): EpisodeRunner {
  const tokenizer = tokenizerFor(resolveModelDir(config.model));
  return async (episode, generate, pools = {}, processImage) => {
    let env;
    try {
      env = checkEnv(runner.createEnv(config.env, { pools }), modulePath);
    } catch (e) {
      throw new AgentError(`createEnv: ${(e as Error).message}`, { cause: e });
    }
    try {
      const result = await runEnvEpisode({
        env, tokenizer, sampling: config.sampling, maxContext: config.max_context, runSeed: config.seed,
        task: { ...task, episode }, generate, routedExperts: config.algo.routing_replay, processImage,
      });
      return { segments: [result.trajectory], reward: result.reward, finish: result.finish, metrics: result.metrics };
    } finally {
      await env.close?.();
    }
  };
}

// One loopback chat server per worker process, started when the first chat episode needs it.
let loopback: Promise<LoopbackServer> | undefined;
const templates = new Map<string, ChatTemplate>(); // model dir -> its chat template

function chatEpisodes(runner: ChatAgentRunner, modulePath: string, config: RecipeConfig, task: GroupTask): EpisodeRunner {
  const modelDir = resolveModelDir(config.model);
  if (!templates.has(modelDir)) templates.set(modelDir, ChatTemplate.load(modelDir));
  const template = templates.get(modelDir)!;
  const agentError = (what: string, e: unknown) =>
    new AgentError(`chat agent ${what}: ${(e as Error)?.message ?? e}`, { cause: e });
  // Every episode of the group starts from the same prompt: ask for it once.
  let prompt: Promise<ChatPrompt> | undefined;

  return async (episode, generateOnEngine, pools = {}, processImage) => {
    const server = await (loopback ??= LoopbackServer.start().catch((e) => { loopback = undefined; throw e; }));
    prompt ??= Promise.resolve().then(() => runner.prompt(task, config.env));
    const start = await prompt.catch((e) => { throw agentError('prompt() threw', e); });
    if (!Array.isArray(start?.messages) || !start.messages.length) {
      throw agentError('prompt()', `must return { messages: [at least one], tools?, label? }, got ${JSON.stringify(start)}`);
    }
    // The agent sees an engine failure only as an HTTP error from the loopback server; remember the
    // real one, so it fails the episode (a 400) or the activity (retried) exactly as in the Env form.
    let engineError: unknown;
    let call = 0;
    const generate: GenerateFn = async (_chatSession, ids, sampling, onToken, images = []) => {
      try {
        // Unless the agent asked for a seed: a reproducible stream per (run, group, episode, call).
        const seed = sampling.seed ?? deriveSeed(config.seed, task.groupIndex, episode, call++);
        const body = { prompt_token_ids: ids, sampling: { ...sampling, seed }, ...(images.length ? { images } : {}) };
        return await generateOnEngine(body, onToken);
      } catch (e) {
        engineError ??= e;
        throw e;
      }
    };
    const result: ChatEpisode = await runChatEpisode({
      server, agent: runner, template, generate, prompt: start, sampling: config.sampling, maxContext: config.max_context,
      pools, processImage: processImage && (async (data) => processImage(data).catch((e) => {
        if (!episodeFailed(e)) engineError ??= e; // an engine that failed us (not a bad image): the activity retries
        throw e;
      })),
    }).catch((e) => { throw engineError ?? agentError('run() failed', e); });
    if (engineError) throw engineError; // even if the agent carried on, its conversation is broken
    if (!result.segments.length || result.finish === null) throw agentError('run()', 'no token was sampled from the policy: nothing to train');
    return {
      segments: result.segments.map((s) => ({
        tokens: s.tokens, logprobs: s.logprobs, versions: s.versions, lossMask: s.loss_mask, images: s.images,
      })),
      reward: result.reward,
      finish: result.finish,
      metrics: result.metrics,
    };
  };
}
