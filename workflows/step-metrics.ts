// The record of one step in metrics.jsonl: every actor metric as the actor named it, plus what only
// the loop sees: rewards and pass rate of the batch, tokens, staleness, drops, and where the time went.
import type { EvaluateResult } from '../activities/evaluate';
import type { GroupResult } from '../activities/types';
import type { AlgoConfig } from '../agents/recipe';
import type { Dropped } from './train-run';

export interface StepTimes { batchReady: number; trained: number; refitted: number; transferSeconds: number } // epoch ms, and the refit activity's own measure

export function stepMetrics(o: {
  step: number; batch: GroupResult[]; algo: AlgoConfig; actor: Record<string, number>; // algo: what the step trained with
  dropped: Dropped; times: StepTimes; lastStepAt: number;
  generated: number; // tokens of all groups that arrived since the last step (trained or not)
}): Record<string, number> {
  const rewards = o.batch.flatMap((g) => g.rewards);
  const mean = rewards.reduce((a, b) => a + b, 0) / rewards.length;
  const std = Math.sqrt(rewards.reduce((a, r) => a + (r - mean) ** 2, 0) / rewards.length);
  const staleness = o.batch.map((g) => o.step - 1 - g.minVersion); // versions behind the policy being trained
  const tokens = o.batch.reduce((n, g) => n + g.tokens, 0);
  const seconds = (from: number, to: number) => Math.max(0, (to - from) / 1000);
  const stepSeconds = seconds(o.lastStepAt, o.times.refitted);
  const summed: Record<string, number> = {}; // agent/<name>, pool/<name>/calls|seconds: sums over the batch
  for (const [k, v] of o.batch.flatMap((g) => Object.entries(g.metrics ?? {}))) summed[k] = (summed[k] ?? 0) + v;
  return {
    ...o.actor,
    ...summed,
    'rollout/reward_mean': mean,
    'rollout/reward_std': std,
    'rollout/pass_rate': rewards.filter((r) => r >= 1).length / rewards.length, // episodes with full reward
    'rollout/episodes': rewards.length,
    'rollout/failed_episodes': o.batch.reduce((n, g) => n + g.failed, 0),
    'rollout/tokens': tokens,
    'rollout/tokens_per_s': stepSeconds > 0 ? o.generated / stepSeconds : 0, // generation throughput over the step
    'rollout/staleness_max': Math.max(...staleness),
    'rollout/staleness_mean': staleness.reduce((a, b) => a + b, 0) / staleness.length,
    'dropped/stale': o.dropped.stale, // cumulative over the run
    'dropped/empty': o.dropped.empty,
    // Time split of the step, seconds: the actor idles while the batch fills; the engines idle only
    // while paused for the refit (pause, transfer, resume); generation is the mean wall time of a group.
    'time/generation': o.batch.reduce((a, g) => a + g.seconds, 0) / o.batch.length,
    'time/actor_idle': seconds(o.lastStepAt, o.times.batchReady),
    'time/train_step': seconds(o.times.batchReady, o.times.trained),
    'time/refit_transfer': o.times.transferSeconds,
    'time/engine_idle': seconds(o.times.trained, o.times.refitted),
    'time/step': stepSeconds,
    'control/lr': o.algo.lr,
    'control/batch_groups': o.batch.length,
  };
}

// An evaluation's figures as eval/... keys, merged into the line of the step it evaluated.
export function evalMetrics(r: EvaluateResult): Record<string, number> {
  const metrics: Record<string, number> = {
    'eval/sample_reward_mean': r.sample_reward_mean, 'eval/pass@1': r['pass@1'], [`eval/pass@${r.samples}`]: r['pass@n'],
    'eval/prompts': r.prompts, 'eval/failed_episodes': r.failed, 'eval/version_min': r.version_min, 'eval/version_max': r.version_max,
  };
  if (r.greedy_reward !== null) metrics['eval/greedy_reward'] = r.greedy_reward;
  return metrics;
}
