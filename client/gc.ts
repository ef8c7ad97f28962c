// `molt-client gc <runId>`: the store collection a run does at each checkpoint (activities/run-folder.ts),
// on demand: for a run that ended (its leftover groups, or a run from before collection existed) or
// one that is running. Of a running run the loop is asked which groups may still be trained and which
// step its latest checkpoint holds; of one that ended, every group is done and the checkpoint is
// `checkpoints/latest`. The policy is the run's own (`store` in its config.json) unless overridden.
import * as fs from 'node:fs';
import * as path from 'node:path';
import { collectGarbage, latestCheckpoint, runConfigPath, type GcPolicy, type GcResult } from '../activities/run-folder';
import { RecipeConfig } from '../agents/recipe';
import { UsageError } from './errors';

export interface Live { checkpointStep: number | null; liveFrom: number } // what a running loop answers

export async function gcRun(storeRoot: string, runId: string, live: Live | 'ended',
  overrides: { keepSteps?: number; keepCheckpoints?: number | null } = {}): Promise<{ policy: GcPolicy; removed: GcResult }> {
  const runDir = path.join(storeRoot, runId);
  if (!fs.existsSync(runDir)) throw new UsageError(`gc: no folder for run ${runId} in ${storeRoot}`);
  const configFile = runConfigPath(storeRoot, runId);
  // A run from before config.json existed gets the defaults.
  const saved = fs.existsSync(configFile)
    ? (JSON.parse(fs.readFileSync(configFile, 'utf8')) as { config: RecipeConfig }).config.store : undefined;
  const store = RecipeConfig.shape.store.parse(saved);
  const keepSteps = overrides.keepSteps ?? store.keep_steps;
  const checkpointStep = live === 'ended' ? latestCheckpoint(storeRoot, runId)?.step ?? null : live.checkpointStep;
  const policy: GcPolicy = {
    keepAfterStep: (checkpointStep ?? 0) - keepSteps, // no checkpoint: every step may have to be replayed
    liveFrom: live === 'ended' ? Number.MAX_SAFE_INTEGER : live.liveFrom,
    keepCheckpoints: overrides.keepCheckpoints !== undefined ? overrides.keepCheckpoints : store.keep_checkpoints,
  };
  return { policy, removed: await collectGarbage(storeRoot, runId, policy) };
}
