// The activities a worker registers, bound to its service endpoints. One router per worker, so
// least-loaded placement sees every in-flight request of that worker.
import { ApplicationFailure } from '@temporalio/common';
import { EngineRouter } from '../agents/router';
import { checkpoint, claimActor, refit, resumePoint, sftStep, trainStep } from './actor';
import { evaluate, type EvaluateInput } from './evaluate';
import { ServiceError } from './gpu-client';
import { recordMetrics, type RecordMetricsInput } from './metrics';
import { rolloutGroup } from './rollout';
import { readRunConfig, writeRunConfig, type RunConfigInput } from './run-folder';
import type { CheckpointInput, ClaimInput, RefitInput, RolloutGroupInput, ServiceEndpoints, SftStepInput, TrainStepInput } from './types';

// A body the service rejects as malformed (400) or a wrong token (401) fails the same way on every
// retry: report it to the workflow at once instead of retrying forever.
async function failFast<T>(work: Promise<T>): Promise<T> {
  try {
    return await work;
  } catch (e) {
    if (e instanceof ServiceError && (e.status === 400 || e.status === 401)) throw ApplicationFailure.nonRetryable(e.message, 'ServiceError');
    throw e;
  }
}

export function createActivities(endpoints: ServiceEndpoints) {
  const router = new EngineRouter(endpoints.engines, endpoints.token);
  const pools = Object.fromEntries(Object.entries(endpoints.pools ?? {})
    .map(([name, urls]) => [name, new EngineRouter(urls, endpoints.token)]));
  return {
    rolloutGroup: async (input: RolloutGroupInput) => {
      const { recipeDir, config } = await readRunConfig(endpoints.storeRoot, input.runId);
      return failFast(rolloutGroup(endpoints, router, { ...input, recipeDir, config }, pools));
    },
    trainStep: (input: TrainStepInput) => failFast(trainStep(endpoints, input)),
    sftStep: (input: SftStepInput) => failFast(sftStep(endpoints, input)),
    refit: (input: RefitInput) => failFast(refit(endpoints, input)),
    checkpoint: (input: CheckpointInput) => failFast(checkpoint(endpoints, input)),
    claimActor: (input: ClaimInput) => failFast(claimActor(endpoints, input)),
    resumePoint: (input: { runId: string }) => resumePoint(endpoints, input),
    recordMetrics: (input: RecordMetricsInput) => recordMetrics(endpoints, input),
    writeRunConfig: (input: RunConfigInput) => writeRunConfig(endpoints.storeRoot, input),
    evaluate: (input: EvaluateInput) => failFast(evaluate(router, input, pools, endpoints.storeRoot)),
  };
}

export type Activities = ReturnType<typeof createActivities>;
