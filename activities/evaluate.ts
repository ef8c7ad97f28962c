// Activity evaluate: the policy on held-out prompt groups, nothing trained and nothing written to the
// trajectory store. Held-out group i is group index EVAL_GROUP_BASE + i (training counts up from 0,
// so it never reaches them); each gets one greedy episode (temperature 0) and `samples` sampled ones
// (the recipe's sampling), through the same episode runners as rolloutGroup.
//
// An episode "passes" when its reward is >= 1: a recipe whose reward is 1 for a solved task (and
// less otherwise) gets pass@k in the usual sense. With c passing samples out of n for a prompt:
//   pass@1 = mean over prompts of c / n
//   pass@n = mean over prompts of [c > 0]
// An episode the agent or the engine refused (AgentError, a 400) counts as reward 0, failed.
// Images (vision-language policies) are processed into <store>/<runId>/images/eval-s<step>, removed at the end.
import { promises as fs } from 'node:fs';
import * as path from 'node:path';
import { Context } from '@temporalio/activity';
import { deriveSeed } from '../agents/env-runner';
import type { RecipeConfig } from '../agents/recipe';
import type { EngineRouter } from '../agents/router';
import { episodeFailed, episodeRunner, loadRecipeAgent, poolClients, type EpisodeRunner } from './rollout';

export const EVAL_GROUP_BASE = 1_000_000_000;

export interface EvaluateInput { runId: string; step: number; recipeDir: string; config: RecipeConfig }
export interface EvaluateResult {
  step: number;
  prompts: number;
  samples: number; // n
  greedy_reward: number | null; // mean over prompts; null when config.eval.greedy is off
  sample_reward_mean: number;
  'pass@1': number;
  'pass@n': number;
  failed: number; // episodes refused by the agent or the engine
  version_min: number; // policy versions the sampled tokens came from (the loop keeps training meanwhile)
  version_max: number;
}

export async function evaluate(router: EngineRouter, input: EvaluateInput, pools: Record<string, EngineRouter> = {},
  storeRoot?: string): Promise<EvaluateResult> {
  const ctx = Context.current();
  const { runId, step, config } = input;
  const { prompts, samples, greedy } = config.eval;
  const { modulePath, runner } = await loadRecipeAgent(input.recipeDir, config);
  const greedyConfig = { ...config, sampling: { ...config.sampling, temperature: 0 } };
  const versions = { min: Infinity, max: -Infinity };
  let failed = 0;

  // At most as many episodes at once as training keeps in flight (pool.inflight groups): the engines
  // are sized for that, and hundreds of multi-turn episodes at once would run past the engine-call deadline.
  let running = 0;
  const waiting: (() => void)[] = [];
  const maxRunning = config.pool.inflight * config.group_size;
  const imageDir = storeRoot && path.join(storeRoot, runId, 'images', `eval-s${step}`); // the images of this evaluation

  // One episode: its reward, 0 if the agent or the engine refused it.
  const run = async (episodes: EpisodeRunner, groupIndex: number, episode: number): Promise<number> => {
    const session = `eval/${runId}/s${step}/g${groupIndex}/e${episode}`;
    if (running < maxRunning) running++;
    else await new Promise<void>((start) => waiting.push(start)); // a finished episode hands over its slot
    const poolFailure: { error?: unknown } = {};
    try {
      const clients = poolClients(pools, config, session, ctx.cancellationSignal, null, {}, poolFailure);
      const result = await episodes(episode, (body) => router.generate(session, body, ctx.cancellationSignal), clients,
        imageDir ? (data) => router.image(session, { data, dir: imageDir }, ctx.cancellationSignal) : undefined);
      if (poolFailure.error) throw poolFailure.error; // even if the agent carried on without the answer
      result.segments.forEach((t) => t.versions.forEach((v, i) => {
        if (t.lossMask[i]) { versions.min = Math.min(versions.min, v); versions.max = Math.max(versions.max, v); }
      }));
      return result.reward;
    } catch (e) {
      // A pool engine that failed inside the recipe's code (a judge down) fails the activity, which is retried, as in
      // rolloutGroup: not the episode's fault.
      if (poolFailure.error) throw poolFailure.error;
      if (!episodeFailed(e)) throw e; // engines down: retry
      failed++;
      ctx.log.warn('eval episode failed', { groupIndex, episode, error: (e as Error).message });
      return 0;
    } finally {
      router.endSession(session);
      for (const [name, r] of Object.entries(pools)) r.endSession(`${session}/${name}`);
      ctx.heartbeat();
      const next = waiting.shift();
      if (next) next();
      else running--;
    }
  };

  const perPrompt = await Promise.all(Array.from({ length: prompts }, async (_, i) => {
    const groupIndex = EVAL_GROUP_BASE + i;
    const task = { groupIndex, seed: deriveSeed(config.seed, groupIndex) };
    const sampled = episodeRunner(runner, modulePath, config, task);
    // Episode indexes after the samples', so a chat agent's greedy calls get seeds of their own.
    const [greedyReward, sampleRewards] = await Promise.all([
      greedy ? run(episodeRunner(runner, modulePath, greedyConfig, task), groupIndex, samples) : null,
      Promise.all(Array.from({ length: samples }, (_, e) => run(sampled, groupIndex, e))),
    ]);
    return { greedyReward, sampleRewards };
  })).finally(() => imageDir && fs.rm(imageDir, { recursive: true, force: true }));

  const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;
  const passes = perPrompt.map((p) => p.sampleRewards.filter((r) => r >= 1).length); // c per prompt
  return {
    step, prompts, samples,
    greedy_reward: greedy ? mean(perPrompt.map((p) => p.greedyReward!)) : null,
    sample_reward_mean: mean(perPrompt.flatMap((p) => p.sampleRewards)),
    'pass@1': mean(passes.map((c) => c / samples)),
    'pass@n': mean(passes.map((c) => (c > 0 ? 1 : 0))),
    failed,
    version_min: Number.isFinite(versions.min) ? versions.min : -1,
    version_max: Number.isFinite(versions.max) ? versions.max : -1,
  };
}
