// The recipe keys a running run accepts (`molt-client set`, the workflow's `set` update), each with
// its zod schema. The recipe schema (agents/recipe.ts) is built from these very schemas, so a live
// change is checked exactly as recipe.json is. No Node module here: the workflow imports this file.
import { z } from 'zod';

const positiveInt = z.number().int('must be a positive integer').positive('must be a positive integer');
export const LIVE_SETTINGS = {
  'algo.lr': z.number().positive('must be a positive number'),
  'algo.entropy_coef': z.number(),
  'algo.kl_coef': z.number().min(0, 'must be a number >= 0'),
  // A step's results travel through Temporal in payloads of at most 2 MB: its trainStep input and the results a
  // run carries across continue-as-new (fewer than a batch; ~150 bytes a group, ~25 a trajectory: its reward,
  // episode and segment count). Past that the workflow task fails and the run freezes, so these bounds refuse
  // it up front (see stepTooLarge too).
  'batch.groups': positiveInt.max(2048, 'at most 2048: a step\'s results travel in one Temporal payload (2 MB)')
    .describe('prompt groups per training step'),
  // Each workflow holds at most 256 groups in flight as pending activities (workflows/rollout-pool.ts shards the
  // rest): the bound is what the pool is measured at (bench/ item 4), not Temporal's 2,000 per workflow.
  'pool.inflight': positiveInt.max(10_000, 'at most 10000: the pool is measured up to 10,000 groups in flight')
    .describe('prompt groups generating at once'),
} as const;
export type LiveSetting = keyof typeof LIVE_SETTINGS;

// Trajectories per step (batch.groups x group_size), bounded for the same reason as batch.groups; checked
// where the recipe loads and where a `set` changes batch.groups. Null when the step fits.
// (At 16,384 when a result named each trajectory by its ~70-byte store key.)
export const MAX_STEP_TRAJECTORIES = 32_768;
export function stepTooLarge(c: { batch: { groups: number }; group_size: number }): string | null {
  const n = c.batch.groups * c.group_size;
  return n <= MAX_STEP_TRAJECTORIES ? null
    : `batch.groups x group_size = ${c.batch.groups} x ${c.group_size} = ${n} trajectories a step: at most ${MAX_STEP_TRAJECTORIES}, `
      + 'as a step\'s results travel in one Temporal payload (2 MB)';
}
