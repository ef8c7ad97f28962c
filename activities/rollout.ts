// Activity rolloutGroup: the G episodes of one prompt group, run concurrently against the engines.
// Each finished episode is written to the trajectory store first, then recorded in the heartbeat
// manifest; a retried activity reads the manifest and runs only the episodes not yet recorded.
import * as path from 'node:path';
import { Context } from '@temporalio/activity';
import { ApplicationFailure } from '@temporalio/common';
import { checkEnv, loadAgentRunner, type Env } from '../agents/contract';
import { AgentError, deriveSeed, runEnvEpisode } from '../agents/env-runner';
import { resolveModelDir } from '../agents/recipe';
import type { EngineRouter } from '../agents/router';
import { tokenizerFor } from '../agents/tokenizer';
import { ServiceError } from './gpu-client';
import { trajectoryKey, writeTrajectory } from './store';
import type { GroupResult, RolloutGroupInput, ServiceEndpoints } from './types';

interface EpisodeRecord {
  refs: string[];
  reward: number;
  tokens: number; // sampled tokens
  minVersion: number;
  maxVersion: number;
}

// What the activity heartbeats: small, and enough to resume.
export interface RolloutManifest {
  done: Record<number, EpisodeRecord>; // episode index -> its store refs and reward
  failed: Record<number, string>; // episode index -> the agent's error
}

export async function rolloutGroup(endpoints: ServiceEndpoints, router: EngineRouter, input: RolloutGroupInput): Promise<GroupResult> {
  const started = Date.now();
  const ctx = Context.current();
  const { runId, groupIndex, config } = input;
  const modulePath = path.resolve(input.recipeDir, config.agent);
  // A module that does not load fails the same way on every retry: stop at once.
  const runner = await loadAgentRunner(modulePath).catch((e) => {
    throw ApplicationFailure.nonRetryable((e as Error).message, 'AgentModuleError');
  });
  const tokenizer = tokenizerFor(resolveModelDir(config.model));

  const previous = ctx.info.heartbeatDetails as RolloutManifest | undefined;
  const manifest: RolloutManifest = { done: { ...previous?.done }, failed: { ...previous?.failed } };
  if (previous) ctx.log.info('rolloutGroup resumed', { groupIndex, reused: Object.keys(manifest.done).length });

  const taskSeed = deriveSeed(config.seed, groupIndex); // one task per group
  const runEpisode = async (episode: number) => {
    const session = `${runId}/g${groupIndex}/e${episode}`;
    let env: Env;
    try {
      env = checkEnv(runner.createEnv(config.env), modulePath);
    } catch (e) {
      throw new AgentError(`createEnv: ${(e as Error).message}`, { cause: e });
    }
    try {
      const result = await runEnvEpisode({
        env, tokenizer, sampling: config.sampling, maxContext: config.max_context, runSeed: config.seed,
        task: { groupIndex, episode, seed: taskSeed },
        generate: (body) => router.generate(session, body, ctx.cancellationSignal),
      });
      const ref = trajectoryKey(runId, groupIndex, episode, 0);
      await writeTrajectory(endpoints.storeRoot, ref, result.trajectory,
        { run: runId, group: groupIndex, episode, segment: 0, reward: result.reward, finish: result.finish });
      const sampled = result.trajectory.versions.filter((_, i) => result.trajectory.lossMask[i]);
      manifest.done[episode] = {
        refs: [ref], reward: result.reward, tokens: sampled.length,
        minVersion: sampled.length ? Math.min(...sampled) : -1, maxVersion: sampled.length ? Math.max(...sampled) : -1,
      };
    } finally {
      router.endSession(session);
      await env.close?.();
    }
    ctx.heartbeat(manifest);
  };

  const todo = Array.from({ length: config.group_size }, (_, e) => e).filter((e) => !(e in manifest.done) && !(e in manifest.failed));
  const outcomes = await Promise.allSettled(todo.map(runEpisode));
  let fatal: unknown;
  outcomes.forEach((o, i) => {
    if (o.status === 'fulfilled') return;
    // The env failed, or the engine refused this episode's request (e.g. a prompt too long for it).
    if (o.reason instanceof AgentError || (o.reason instanceof ServiceError && o.reason.status === 400)) {
      manifest.failed[todo[i]] = o.reason.message;
      ctx.log.warn('episode failed', { groupIndex, episode: todo[i], error: o.reason.message });
    } else {
      fatal ??= o.reason;
    }
  });
  ctx.heartbeat(manifest);
  if (fatal) throw fatal; // the engines failed us: Temporal retries, finished episodes are kept

  const done = Object.keys(manifest.done).map(Number).sort((a, b) => a - b).map((e) => manifest.done[e]);
  const versions = done.filter((d) => d.tokens > 0);
  return {
    groupIndex,
    refs: done.flatMap((d) => d.refs),
    rewards: done.map((d) => d.reward),
    failed: Object.keys(manifest.failed).length,
    tokens: done.reduce((n, d) => n + d.tokens, 0),
    minVersion: versions.length ? Math.min(...versions.map((d) => d.minVersion)) : -1,
    maxVersion: versions.length ? Math.max(...versions.map((d) => d.maxVersion)) : -1,
    seconds: (Date.now() - started) / 1000,
  };
}
