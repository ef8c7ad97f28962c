// Activities that drive the actor: one optimizer step, a weight refit of the engines, a checkpoint.
// Each is safe to retry: the actor answers a repeated (run, step) with its recorded metrics, a refit
// to a version the engines already hold does nothing, a checkpoint rewrites the same directory.
import * as path from 'node:path';
import { Context } from '@temporalio/activity';
import {
  callService, type ActorHealth, type CheckpointResponse, type EngineHealth, type PushWeightsResponse, type TrainStepRequest, type TrainStepResponse,
} from './gpu-client';
import { writeFileAtomic } from './store';
import type {
  CheckpointInput, CheckpointResult, RefitInput, RefitResult, ServiceEndpoints, TrainStepInput, TrainStepResult,
} from './types';

// Long calls heartbeat while they wait, so a heartbeat timeout notices a dead worker, not a slow actor.
async function heartbeating<T>(details: unknown, work: Promise<T>): Promise<T> {
  const ctx = Context.current();
  ctx.heartbeat(details);
  const timer = setInterval(() => ctx.heartbeat(details), 5_000);
  try {
    return await work;
  } finally {
    clearInterval(timer);
  }
}

export async function trainStep(endpoints: ServiceEndpoints, input: TrainStepInput): Promise<TrainStepResult> {
  const body: TrainStepRequest = {
    run_id: input.runId, step: input.step, store_root: endpoints.storeRoot, trajectories: input.refs, algo: input.algo,
  };
  const res = await heartbeating({ step: input.step }, callService<TrainStepResponse>(endpoints.actor, '/train_step', endpoints.token,
    { body, request: 'TrainStepRequest', response: 'TrainStepResponse', signal: Context.current().cancellationSignal }));
  return { step: res.step, version: res.version, replayed: res.replayed, metrics: res.metrics };
}

export async function refit(endpoints: ServiceEndpoints, input: RefitInput): Promise<RefitResult> {
  const started = Date.now();
  const { engines, token } = endpoints;
  const health = await Promise.all(engines.map((e) => callService<EngineHealth>(e, '/health', token, { response: 'EngineHealth' })));
  if (health.every((h) => h.version === input.version)) {
    Context.current().log.info('refit: engines already at version', { version: input.version });
    return { version: input.version, seconds: 0, bytes: 0 }; // a retry after a completed push
  }
  let pushed: PushWeightsResponse | undefined;
  try {
    // Pause with mode keep: in-flight requests are held, not dropped, and continue on the new weights.
    // Inside the try: if one engine fails to pause, the others are still resumed.
    await Promise.all(engines.map((e) => callService(e, '/pause', token, { body: { mode: 'keep' }, request: 'PauseRequest' })));
    pushed = await heartbeating({ version: input.version }, callService<PushWeightsResponse>(endpoints.actor, '/push_weights', token, {
      body: { engines: engines.map((url) => ({ url })), version: input.version },
      request: 'PushWeightsRequest', response: 'PushWeightsResponse',
    }));
  } finally {
    const resumed = await Promise.allSettled(engines.map((e) => callService(e, '/resume', token, { body: {} })));
    const failed = resumed.flatMap((r) => (r.status === 'rejected' ? [(r.reason as Error).message] : []));
    if (pushed && failed.length) throw new Error(`refit: weights pushed, but resuming failed: ${failed.join('; ')}`);
  }
  return { version: pushed.version, seconds: (Date.now() - started) / 1000, bytes: pushed.bytes };
}

export function checkpointDir(storeRoot: string, runId: string, step: number): string {
  return path.join(storeRoot, runId, 'checkpoints', `step-${step}`);
}

// <storeRoot>/<runId>/checkpoints/latest holds the path of the newest complete checkpoint; it is
// written only after the actor has saved, so it never points at a partial directory.
export async function checkpoint(endpoints: ServiceEndpoints, input: CheckpointInput): Promise<CheckpointResult> {
  const dir = checkpointDir(endpoints.storeRoot, input.runId, input.step);
  // step-<n> must hold the weights after step n: refuse before writing anything if the actor is elsewhere.
  const health = await callService<ActorHealth>(endpoints.actor, '/health', endpoints.token, { response: 'ActorHealth' });
  if (health.last_step !== input.step || health.run_id !== input.runId) {
    throw new Error(`checkpoint: asked for step ${input.step} of run ${input.runId}, but the actor holds step ${health.last_step} of run ${health.run_id}`);
  }
  const res = await heartbeating({ step: input.step }, callService<CheckpointResponse>(endpoints.actor, '/checkpoint/save', endpoints.token,
    { body: { path: dir }, request: 'CheckpointRequest', response: 'CheckpointResponse' }));
  await writeFileAtomic(path.join(endpoints.storeRoot, input.runId, 'checkpoints', 'latest'), dir);
  return { path: dir, step: res.step };
}
