// The activities a worker registers, bound to its service endpoints. One router per worker, so
// least-loaded placement sees every in-flight request of that worker.
import { EngineRouter } from '../agents/router';
import { checkpoint, refit, trainStep } from './actor';
import { rolloutGroup } from './rollout';
import type { CheckpointInput, RefitInput, RolloutGroupInput, ServiceEndpoints, TrainStepInput } from './types';

export function createActivities(endpoints: ServiceEndpoints) {
  const router = new EngineRouter(endpoints.engines, endpoints.token);
  return {
    rolloutGroup: (input: RolloutGroupInput) => rolloutGroup(endpoints, router, input),
    trainStep: (input: TrainStepInput) => trainStep(endpoints, input),
    refit: (input: RefitInput) => refit(endpoints, input),
    checkpoint: (input: CheckpointInput) => checkpoint(endpoints, input),
  };
}

export type Activities = ReturnType<typeof createActivities>;
