// What the Temporal UI shows of a run: search attributes to filter and sort runs by
// (e.g. `MoltRecipe = "copy" ORDER BY MoltReward DESC`), one-line summaries, and markdown details.
import { defineSearchAttributeKey, SearchAttributeType } from '@temporalio/common';
import type { RecipeConfig } from '../agents/recipe';

// Registered by the local stack (`temporal server start-dev --search-attribute MoltStep=Int ...`)
// or on a cluster with `temporal operator search-attribute create`.
export const MoltRecipe = defineSearchAttributeKey('MoltRecipe', SearchAttributeType.KEYWORD);
export const MoltStep = defineSearchAttributeKey('MoltStep', SearchAttributeType.INT);
export const MoltVersion = defineSearchAttributeKey('MoltVersion', SearchAttributeType.INT);
export const MoltReward = defineSearchAttributeKey('MoltReward', SearchAttributeType.DOUBLE);
export const SEARCH_ATTRIBUTE_TYPES = { MoltRecipe: 'Keyword', MoltStep: 'Int', MoltVersion: 'Int', MoltReward: 'Double' } as const;

export function runSummary(config: RecipeConfig): string {
  return `${config.name}: ${config.train.steps} steps of ${config.batch.groups} groups x ${config.group_size} episodes, model ${config.model}`;
}

export function runDetails(recipeDir: string, config: RecipeConfig): string {
  return [
    `**recipe** \`${recipeDir}\``,
    `**algo** ${config.algo.advantage} / ${config.algo.policy_loss}, lr ${config.algo.lr}`,
    `**pool** ${config.pool.inflight} groups in flight, **batch** ${config.batch.groups} groups, **checkpoint** every ${config.checkpoint.every} steps`,
  ].join('\n\n');
}

export interface StepView {
  runId: string; summary: string; details: string; // the run's static summary and details (the first execution's)
  execution: number; firstStep: number; // which execution of the chain this is, and the step it started from
  step: number; totalSteps: number; rewardMean: number | null; paused: boolean; state: 'running' | 'stopping' | 'done';
  lr: number; batchGroups: number; inflight: number; ready: number; checkpoint: string | null;
  waitingFor?: string | null;
}

// The run's "current details" in the UI, rewritten after each step and on each control change.
// Continue-as-new cannot give the next execution a static summary or details (neither the SDK's
// options nor the command carry them), so every execution shows them here: each one says which
// run, which link of its chain, and which step it is.
export function stepDetails(v: StepView): string {
  const state = v.waitingFor ? `**waiting for the actor, held by run ${v.waitingFor}**`
    : v.state === 'running' && v.paused ? '**paused**' : v.state;
  const chain = v.execution > 1 ? `execution ${v.execution} of the run, continued as new at step ${v.firstStep}` : 'first execution of the run';
  return [
    `run **${v.runId}**: ${v.summary}`,
    `step **${v.step}/${v.totalSteps}** (${state}), reward mean ${v.rewardMean?.toFixed(4) ?? '-'}; ${chain}`,
    `lr ${v.lr}, batch ${v.batchGroups} groups; ${v.inflight} groups running, ${v.ready} ready`,
    `checkpoint: ${v.checkpoint ?? 'none yet'}`,
    v.details,
  ].join('\n\n');
}
