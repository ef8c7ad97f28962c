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
  // Each group in flight is a pending activity of the run: Temporal allows 2,000 per workflow
  // (limit.numPendingActivities.error), and above ~1,000 its CPU per group grows (bench/ item 4).
  // A `set` past it was once accepted, and the server terminated the run (GrpcMessageTooLarge).
  'pool.inflight': positiveInt.max(2000,
    'at most 2000: each group in flight is a pending activity of the run, and Temporal allows 2000 per workflow')
    .describe('prompt groups generating at once'),
} as const;
export type LiveSetting = keyof typeof LIVE_SETTINGS;
