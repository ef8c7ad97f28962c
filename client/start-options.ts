// How molt-client starts a run, shared by `start` and `schedule create`: the workflow's options,
// including what the Temporal UI shows (summary, details, memo, search attributes).
import * as path from 'node:path';
import type { Connection } from '@temporalio/client';
import type { RecipeConfig } from '../agents/recipe';
import { TASK_QUEUES, type TrainRunInput } from '../workflows/train-run';
import {
  MoltRecipe, MoltReward, MoltStep, MoltVersion, runDetails, runSummary, SEARCH_ATTRIBUTE_TYPES,
} from '../workflows/visibility';

// True when the server has all of Molt's search attributes. Without them the run still works;
// it only is not searchable by them (the workflow upserts only when MoltRecipe was set at start).
export async function hasSearchAttributes(connection: Connection, namespace = 'default'): Promise<boolean> {
  const { customAttributes } = await connection.operatorService.listSearchAttributes({ namespace });
  return Object.keys(SEARCH_ATTRIBUTE_TYPES).every((name) => customAttributes?.[name] !== undefined);
}

export function runStartOptions(recipeDir: string, config: RecipeConfig, runId: string | undefined, searchable: boolean) {
  const dir = path.resolve(recipeDir);
  const args: [TrainRunInput] = [{ runId, recipeDir: dir, config }];
  return {
    taskQueue: TASK_QUEUES.control,
    args,
    memo: { recipe: config.name, recipeDir: dir, model: config.model, steps: config.train.steps },
    staticSummary: runSummary(config),
    staticDetails: runDetails(dir, config),
    typedSearchAttributes: searchable
      ? [
        { key: MoltRecipe, value: config.name }, { key: MoltStep, value: 0 }, { key: MoltVersion, value: 0 },
        { key: MoltReward, value: 0 },
      ]
      : [],
  };
}
