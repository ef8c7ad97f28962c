// The recipe keys a running run accepts (`molt-client set`, the workflow's `set` update), each with
// its zod schema. The recipe schema (agents/recipe.ts) is built from these very schemas, so a live
// change is checked exactly as recipe.json is. No Node module here: the workflow imports this file.
import { z } from 'zod';

const positiveInt = z.number().int('must be a positive integer').positive('must be a positive integer');
export const LIVE_SETTINGS = {
  'algo.lr': z.number().positive('must be a positive number'),
  'algo.entropy_coef': z.number(),
  'algo.kl_coef': z.number().min(0, 'must be a number >= 0'),
  'batch.groups': positiveInt.describe('prompt groups per training step'),
  // Each workflow holds at most 256 groups in flight as pending activities (workflows/rollout-pool.ts shards the
  // rest): the bound is what the pool is measured at (bench/ item 4), not Temporal's 2,000 per workflow.
  'pool.inflight': positiveInt.max(10_000, 'at most 10000: the pool is measured up to 10,000 groups in flight')
    .describe('prompt groups generating at once'),
} as const;
export type LiveSetting = keyof typeof LIVE_SETTINGS;
