// What crosses Temporal between the loop and its activities: references and small records only,
// never token arrays (the trajectory store holds those).
import type { AlgoConfig, RecipeConfig } from '../agents/recipe';
import type { GcPolicy, GcResult } from './run-folder';

// A group's activity input names the group only. Its run's config comes from <run>/config.json, which
// the run writes before it starts any group: sent with each of thousands of groups, the ~1 KB config was
// most of a group's history bytes and ~40% of the orchestration's CPU (bench/ item 4).
export interface RolloutGroupInput {
  runId: string;
  groupIndex: number; // the prompt group: all G episodes of a group get the same task
  engines?: string[]; // the engines the run had when the group started (default: the worker's)
}
// The same with the run's config, as the rollout runs it.
export interface ResolvedGroupInput extends RolloutGroupInput {
  recipeDir: string; // absolute path of the recipe folder (its agent module is loaded from there)
  config: RecipeConfig; // resolved config
}

export interface GroupResult {
  groupIndex: number;
  // The finished episodes (a failed one is left out) and each one's segments, a trajectory each, at
  // trajectoryKey(run, group, episode, 0..segments-1) in the store (groupRefs): a result stays in the run's
  // history, and ~65-byte keys were most of its bytes (and of a step's input, which names them again).
  episodes: number[];
  segments: number[];
  rewards: number[]; // one per finished episode
  failed: number; // episodes whose agent threw
  tokens: number; // generated tokens in the group
  minVersion: number; // oldest policy version among the group's sampled tokens
  maxVersion: number;
  seconds: number;
  // summed over the group's episodes: agent/<name> from the agent, pool/<name>/calls|seconds of the pools' calls
  metrics?: Record<string, number>;
  fatal?: string; // the group broke the recipe's failure budget: the run must stop (the message says why)
  sample?: EpisodeSample; // one finished episode, decoded, for people to read (samples.jsonl)
}

// An episode as text: what the policy was asked and what it answered (with any tool turns), cut to
// a few hundred characters each so that results stay small.
export interface EpisodeSample { episode: number; reward: number; prompt: string; completion: string }
// A step writes SAMPLES_PER_STEP of them, so only about that many of a batch's groups carry one: every k-th
// group, for k = batch.groups / SAMPLES_PER_STEP (a batch is mostly consecutive groups). A sample is up to
// ~1 KB of text, about as large as the rest of a group's result, and every result stays in the run's history.
export const SAMPLES_PER_STEP = 4;
export const carriesSample = (groupIndex: number, batchGroups: number) =>
  groupIndex % Math.max(1, Math.floor(batchGroups / SAMPLES_PER_STEP)) === 0;

// A step's trajectories: its groups' finished episodes (the activity names their store keys).
export type GroupTrajectories = Pick<GroupResult, 'groupIndex' | 'episodes' | 'segments'>;
export interface TrainStepInput { runId: string; step: number; groups: GroupTrajectories[]; algo: AlgoConfig }
export const stepGroups = (batch: GroupResult[]): GroupTrajectories[] =>
  batch.map(({ groupIndex, episodes, segments }) => ({ groupIndex, episodes, segments }));
export interface TrainStepResult { step: number; version: number; replayed: boolean; metrics: Record<string, number> }

// An SFT step (workflows/sft-run.ts): the activity tokenizes the recipe's demonstrations itself.
export interface SftStepInput { runId: string; step: number; recipeDir: string; config: RecipeConfig }

// engines: the run's engines (default: the worker's). join: push to all of them whatever version they
// report (an engine joining a run may hold another run's weights under the same version number).
export interface RefitInput { runId: string; version: number; engines?: string[]; join?: boolean }
// missed: engines that did not answer (killed, or hung) and got no weights; they rejoin at a later refit.
export interface RefitResult { version: number; seconds: number; bytes: number; missed?: string[] }

// A run claims the actor and the engines at its current step (activities/actor.ts, claimActor).
// init: the recipe's `init` dir; lineage: a schedule id whose previous firing's latest checkpoint the run
// starts from; engines: the run's, once it has some (default: the worker's).
export interface ClaimInput { runId: string; step: number; init?: string; lineage?: string; engines?: string[] }
// heldBy null: claimed, and `engines` are the run's engines; else the run that holds them.
export interface ClaimResult { heldBy: string | null; engines?: string[] }

export interface ResumePoint { step: number; nextGroupIndex: number; checkpoint: { step: number; path: string } | null }

// gc: after the checkpoint, delete what it made unnecessary (activities/run-folder.ts).
export interface CheckpointInput { runId: string; step: number; gc?: GcPolicy }
export interface CheckpointResult { path: string; step: number; removed?: GcResult }

// Where the activities find the services; one set per worker process.
export interface ServiceEndpoints {
  engines: string[]; // engine base URLs
  pools?: Record<string, string[]>; // the recipe pools' engine URLs, by pool name (env MOLT_POOLS, JSON)
  actor: string; // actor base URL
  token: string; // bearer token of the GPU services
  storeRoot: string; // trajectory store and checkpoints live under here: <storeRoot>/<runId>/...
}
