// Activities that drive the actor: one optimizer step, a weight refit of the engines, a checkpoint.
// Each is safe to retry: the actor answers a repeated (run, step) with its recorded metrics, a refit
// pushes only to engines not yet at the version, a checkpoint rewrites the same directory.
//
// Exactly-once across an actor crash: before the actor sees step n, trainStep writes the step's
// manifest <storeRoot>/<runId>/steps/step-<n>.json {refs, algo} (a claim check, like the
// trajectories). A restarted actor holds its base weights and an empty step log; any activity that
// finds the actor behind the run loads the run's latest checkpoint and replays the later steps from
// their manifests, in order (same trajectories, same algo, same starting state: the same update).
//
// Many runs, one stack: the actor and the engines serve one run at a time. A run claims them
// (claimActor) before it generates anything; the claim is a lease file in the store, which a
// run holds until its workflow is no longer running. The others wait (the run's progress says for
// whom). Taking over loads the run's state into the actor (its latest checkpoint and the steps after
// it, or the initial weights) and pushes those weights to every engine: the engines must sample
// from this run's policy, at this run's version. Claims are checked one at a time: the actor
// queue's worker runs one activity at a time (infra/worker.ts).
import * as fs from 'node:fs';
import * as path from 'node:path';
import { ApplicationFailure, Context } from '@temporalio/activity';
import { sftExamples } from '../agents/sft-data';
import type { AlgoConfig } from '../agents/recipe';
import {
  callService, ServiceError, type ActorHealth, type CheckpointResponse, type EngineHealth, type PushWeightsResponse, type SftExample,
  type SftStepRequest, type TrainStepRequest, type TrainStepResponse,
} from './gpu-client';
import { collectGarbage, latestCheckpoint } from './run-folder';
import { groupRefs, writeFileAtomic } from './store';

// /health, /pause and /resume answer at once unless the engine hangs (pause waits for one decode step).
const CONTROL_TIMEOUT_MS = 30_000;
import type {
  CheckpointInput, CheckpointResult, ClaimInput, ClaimResult, RefitInput, RefitResult, ResumePoint, ServiceEndpoints,
  SftStepInput, TrainStepInput, TrainStepResult,
} from './types';
import { runWorkflowId } from '../workflows/train-run';

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

// An SFT step (workflows/sft-run.ts) keeps its tokenized demonstrations in `sft` (no trajectories): a
// restarted actor replays it like any other step.
interface StepManifest { refs: string[]; algo: AlgoConfig; sft?: SftExample[] }

export function stepManifestPath(storeRoot: string, runId: string, step: number): string {
  return path.join(storeRoot, runId, 'steps', `step-${step}.json`);
}

// Written once per step; a retry writes the same bytes. Different contents mean the loop asked for
// the same step with another batch: refuse rather than train two different updates under one number.
async function writeStepManifest(storeRoot: string, input: TrainStepInput, refs: string[]): Promise<void> {
  const file = stepManifestPath(storeRoot, input.runId, input.step);
  const text = JSON.stringify({ refs, algo: input.algo } satisfies StepManifest);
  const existing = fs.existsSync(file) ? fs.readFileSync(file, 'utf8') : null;
  if (existing === null) await writeFileAtomic(file, text);
  else if (existing !== text) throw new Error(`trainStep: step ${input.step} of run ${input.runId} was already asked with other trajectories (${file})`);
}

const actorHealth = (e: ServiceEndpoints) => callService<ActorHealth>(e.actor, '/health', e.token, { response: 'ActorHealth' });

function postTrainStep(e: ServiceEndpoints, runId: string, step: number, manifest: StepManifest): Promise<TrainStepResponse> {
  if (manifest.sft) {
    const sft: SftStepRequest = { run_id: runId, step, examples: manifest.sft, algo: manifest.algo };
    return callService<TrainStepResponse>(e.actor, '/sft_step', e.token,
      { body: sft, request: 'SftStepRequest', response: 'TrainStepResponse',
        signal: Context.current().cancellationSignal });
  }
  const body: TrainStepRequest = { run_id: runId, step, store_root: e.storeRoot, trajectories: manifest.refs, algo: manifest.algo };
  return callService<TrainStepResponse>(e.actor, '/train_step', e.token,
    { body, request: 'TrainStepRequest', response: 'TrainStepResponse', signal: Context.current().cancellationSignal });
}

// Brings the actor to step `upTo` of the run if it is behind (restarted: base weights, run_id null;
// holding an older state; or holding another run): load the run's latest checkpoint (the initial
// weights for a run without one), then replay each later step from its manifest. Returns the steps
// replayed (0 when the actor was already there).
export async function catchUpActor(e: ServiceEndpoints, runId: string, upTo: number): Promise<number> {
  let health = await actorHealth(e);
  if (health.run_id === runId && health.last_step >= upTo) return 0;
  const init = initDir(e.storeRoot, runId);
  const latest = latestCheckpoint(e.storeRoot, runId);
  if (latest !== null) {
    if (health.run_id !== runId || health.last_step < latest.step) {
      await callService<CheckpointResponse>(e.actor, '/checkpoint/load', e.token,
        { body: { path: latest.path }, request: 'CheckpointRequest', response: 'CheckpointResponse' });
      Context.current().log.info('actor behind the run: loaded its latest checkpoint', { runId, checkpoint: latest.path, step: latest.step });
      health = await actorHealth(e);
    }
  } else if (health.run_id !== runId && init !== null) {
    // No checkpoint yet: the run starts (or replays) from its init dir, in the policy and the KL reference.
    await callService<CheckpointResponse>(e.actor, '/init', e.token,
      { body: { run_id: runId, path: init }, request: 'InitRequest', response: 'CheckpointResponse' });
    Context.current().log.info('actor started the run from its init dir', { runId, init });
    health = await actorHealth(e);
  } else if (health.run_id !== runId && (health.run_id !== null || health.last_step > 0)) {
    // Another run's weights: this run starts (or replays) from the initial weights.
    health = await callService<ActorHealth>(e.actor, '/reset', e.token, { body: {}, response: 'ActorHealth' });
    Context.current().log.info('actor held another run: back to the initial weights', { runId });
  }
  const from = health.run_id === runId ? health.last_step + 1 : 1;
  for (let step = from; step <= upTo; step++) {
    const file = stepManifestPath(e.storeRoot, runId, step);
    if (!fs.existsSync(file)) throw new Error(`actor holds step ${from - 1} of run ${runId}: cannot replay step ${step}, it has no manifest (${file})`);
    const replayed = await postTrainStep(e, runId, step, JSON.parse(fs.readFileSync(file, 'utf8')) as StepManifest);
    Context.current().log.info('replayed a step on the actor', { runId, step, pgLoss: replayed.metrics.pg_loss });
  }
  return upTo - from + 1;
}

// <storeRoot>/<runId>/init holds the path of the directory the run starts from (recipe key `init`),
// so that every later activity, and a restarted actor before the first checkpoint, finds it.
function initDir(storeRoot: string, runId: string): string | null {
  const file = path.join(storeRoot, runId, 'init');
  return fs.existsSync(file) ? fs.readFileSync(file, 'utf8') : null;
}

export async function trainStep(endpoints: ServiceEndpoints, input: TrainStepInput): Promise<TrainStepResult> {
  const refs = input.groups.flatMap((g) => groupRefs(input.runId, g));
  await writeStepManifest(endpoints.storeRoot, input, refs);
  return applyStep(endpoints, input.runId, input.step, { refs, algo: input.algo });
}

// The end of trainStep and sftStep, once the step's manifest is written: the actor catches up to the
// step before, then applies this one (once: the actor's step log).
async function applyStep(endpoints: ServiceEndpoints, runId: string, step: number, manifest: StepManifest): Promise<TrainStepResult> {
  const res = await heartbeating({ step }, (async () => {
    await catchUpActor(endpoints, runId, step - 1);
    return postTrainStep(endpoints, runId, step, manifest);
  })());
  return { step: res.step, version: res.version, replayed: res.replayed, metrics: res.metrics };
}

// One SFT step: demonstrations [(step-1)*batch, step*batch) of the recipe, tokenized here, on the
// actor's queue. The manifest is written first (a retry reads it back rather than tokenize again), then
// the actor catches up and applies the step, exactly once like trainStep.
export async function sftStep(endpoints: ServiceEndpoints, input: SftStepInput): Promise<TrainStepResult> {
  const { runId, step, config } = input;
  const file = stepManifestPath(endpoints.storeRoot, runId, step);
  let manifest: StepManifest;
  if (fs.existsSync(file)) manifest = JSON.parse(fs.readFileSync(file, 'utf8')) as StepManifest;
  else {
    const batch = config.sft!.batch;
    const examples = await sftExamples(input.recipeDir, config, (step - 1) * batch, batch)
      .catch((e: Error) => { throw ApplicationFailure.nonRetryable(`sft: ${e.message}`, 'SftDataError'); });
    manifest = { refs: [], algo: { ...config.algo, lr: config.sft!.lr }, sft: examples };
    await writeFileAtomic(file, JSON.stringify(manifest));
  }
  return applyStep(endpoints, runId, step, manifest);
}

// Resumes the given engines (all of them, even when one fails) and throws if any resume failed.
// Repeating /resume is harmless, so every path of refit may call it on any engine that is paused.
async function resumeEngines(engines: string[], token: string): Promise<void> {
  const resumed = await Promise.allSettled(engines.map((e) =>
    callService(e, '/resume', token, { body: {}, timeoutMs: CONTROL_TIMEOUT_MS })));
  const failed = resumed.flatMap((r) => (r.status === 'rejected' ? [(r.reason as Error).message] : []));
  if (failed.length) throw new Error(`refit: resuming failed: ${failed.join('; ')}`);
}

// The engines that answer /health, with their health. One that does not (killed, its host gone, hung)
// is `missed`: a dead engine must not stall the run; the router keeps it out of rotation and a later
// refit brings it back. With none answering there is nothing to refit: an error, retried.
async function reachable(engines: string[], token: string): Promise<{ live: [string, EngineHealth][]; missed: string[] }> {
  const health = await Promise.allSettled(engines.map((e) =>
    callService<EngineHealth>(e, '/health', token, { response: 'EngineHealth', timeoutMs: CONTROL_TIMEOUT_MS })));
  const live: [string, EngineHealth][] = [];
  const missed: string[] = [];
  for (const [i, h] of health.entries()) {
    if (h.status === 'fulfilled') live.push([engines[i], h.value]);
    else if (h.reason instanceof ServiceError && (h.reason.status ?? 500) >= 500) missed.push(engines[i]);
    else throw h.reason; // e.g. a wrong token: the same on every retry
  }
  if (live.length === 0) throw new Error(`no engine answers /health: ${engines.join(', ')}`);
  if (missed.length) Context.current().log.warn('engines do not answer; refit goes on without them', { missed });
  return { live, missed };
}

// Pushes the actor's weights of step `version` to every engine not at that version (a restarted
// engine comes back at version 0 and rejoins here; engines already there keep serving), or to every
// one when they join the run. An engine found paused is resumed first: a refit of an earlier worker
// (which paused engines around the push) may have failed before it resumed it.
export async function refit(endpoints: ServiceEndpoints, input: RefitInput): Promise<RefitResult> {
  const { token } = endpoints;
  for (const [name, urls] of Object.entries(endpoints.pools ?? {})) { // a judge's or teacher's weights are not the policy's
    const pooled = input.engines?.find((e) => urls.includes(e));
    if (pooled) throw ApplicationFailure.nonRetryable(`engine ${pooled} is in the recipe's pool ${name}: pools are never refit`, 'PoolEngine');
  }
  const { live, missed } = await reachable(input.engines ?? endpoints.engines, token);
  const engines = live.filter(([, h]) => input.join || h.version !== input.version).map(([e]) => e);
  await resumeEngines(live.filter(([, h]) => h.paused).map(([e]) => e), token);
  if (engines.length === 0) {
    Context.current().log.info('refit: engines already at version', { version: input.version });
    return { version: input.version, seconds: 0, bytes: 0, ...(missed.length ? { missed } : {}) }; // a retry after a completed push
  }
  return { ...await pushWeights(endpoints, input.runId, input.version, engines), ...(missed.length ? { missed } : {}) };
}

// Pushes the weights of step `version` of the run to `engines`. No /pause or /resume around it: an
// engine holds its requests while it receives (they go on with the new weights), as a pause with mode
// keep would, and those two calls per engine were half of a small model's refit (bench/refit.py).
async function pushWeights(endpoints: ServiceEndpoints, runId: string, version: number, engines: string[]): Promise<RefitResult> {
  const started = Date.now();
  const { token } = endpoints;
  // The weights must be those of step `version`: a restarted actor catches up first.
  await heartbeating({ version }, catchUpActor(endpoints, runId, version));
  const actor = await actorHealth(endpoints);
  // At version 0 a run without init holds the initial weights, which belong to no run.
  const owner = version === 0 && initDir(endpoints.storeRoot, runId) === null ? null : runId;
  if (actor.run_id !== owner || actor.last_step !== version) {
    throw new Error(`refit: asked for version ${version} of run ${runId}, but the actor holds step ${actor.last_step} of run ${actor.run_id}`);
  }
  const pushed = await heartbeating({ version }, callService<PushWeightsResponse>(endpoints.actor, '/push_weights', token, {
    body: { engines: engines.map((url) => ({ url })), version },
    request: 'PushWeightsRequest', response: 'PushWeightsResponse',
  }));
  return { version: pushed.version, seconds: (Date.now() - started) / 1000, bytes: pushed.bytes };
}

// Where a run that an earlier stack left goes on (`molt-client resume`): after the last step whose
// manifest follows its latest checkpoint without a gap (the claim replays those steps on the actor),
// with group indexes after every group it started (a group index names trajectory files, and a
// manifest of a replayed step may name them).
export async function resumePoint(e: ServiceEndpoints, input: { runId: string }): Promise<ResumePoint> {
  const runDir = path.join(e.storeRoot, input.runId);
  const latest = latestCheckpoint(e.storeRoot, input.runId);
  let step = latest?.step ?? 0;
  while (fs.existsSync(stepManifestPath(e.storeRoot, input.runId, step + 1))) step++;
  const groups = ['trajectories', 'partials'].flatMap((d) => (fs.existsSync(path.join(runDir, d)) ? fs.readdirSync(path.join(runDir, d)) : []))
    .flatMap((name) => /^g(\d+)$/.exec(name)?.slice(1).map(Number) ?? []);
  return {
    step, nextGroupIndex: groups.length ? Math.max(...groups) + 1 : 0,
    checkpoint: latest,
  };
}

export const leaseFile = (storeRoot: string) => path.join(storeRoot, 'actor-lease');

// Claims the actor and the engines for run `runId` at step `step` (see the top of this file).
// Returns whom the run must wait for, or null once it holds them with its weights everywhere.
export async function claimActor(endpoints: ServiceEndpoints, input: ClaimInput): Promise<ClaimResult> {
  const file = leaseFile(endpoints.storeRoot);
  const holder = fs.existsSync(file) ? fs.readFileSync(file, 'utf8').trim() : '';
  if (holder && holder !== input.runId && await runIsLive(holder)) return { heldBy: holder };
  if (holder !== input.runId) await writeFileAtomic(file, input.runId);
  const initFile = path.join(endpoints.storeRoot, input.runId, 'init');
  let init = input.init;
  if (input.lineage !== undefined) {
    // Fixed once, at the run's first claim: a later claim must not move it to a firing that ended since.
    init = fs.existsSync(initFile) ? undefined : previousFiringCheckpoint(endpoints.storeRoot, input.lineage, input.runId) ?? input.init;
  }
  if (init !== undefined) await writeFileAtomic(initFile, init);
  // Every engine, whatever version it says: a version number of another run names other weights.
  const engines = input.engines ?? endpoints.engines;
  const { live } = await reachable(engines, endpoints.token);
  await pushWeights(endpoints, input.runId, input.step, live.map(([e]) => e));
  Context.current().log.info('run holds the actor and the engines', { runId: input.runId, step: input.step, after: holder || null });
  return { heldBy: null, engines };
}

// The latest checkpoint of the newest earlier firing of schedule `scheduleId` that has one. A firing's
// run id is `<scheduleId>-<ISO time>`, so the names sort by firing time.
function previousFiringCheckpoint(storeRoot: string, scheduleId: string, runId: string): string | undefined {
  const isFiring = (name: string) => name.startsWith(`${scheduleId}-`) && /^\d{4}-\d\d-\d\dT/.test(name.slice(scheduleId.length + 1));
  for (const name of fs.readdirSync(storeRoot).filter((n) => isFiring(n) && n < runId).sort().reverse()) {
    const latest = path.join(storeRoot, name, 'checkpoints', 'latest');
    if (fs.existsSync(latest)) return fs.readFileSync(latest, 'utf8').trim();
  }
  return undefined;
}

async function runIsLive(runId: string): Promise<boolean> {
  try {
    const { status } = await Context.current().client.workflow.getHandle(runWorkflowId(runId)).describe();
    return status.name === 'RUNNING';
  } catch (err) {
    if ((err as Error).name === 'WorkflowNotFoundError') return false; // e.g. a run of an earlier Temporal database
    throw err;
  }
}

export function checkpointDir(storeRoot: string, runId: string, step: number): string {
  return path.join(storeRoot, runId, 'checkpoints', `step-${step}`);
}

// <storeRoot>/<runId>/checkpoints/latest holds the path of the newest complete checkpoint; it is
// written only after the actor has saved, so it never points at a partial directory.
export async function checkpoint(endpoints: ServiceEndpoints, input: CheckpointInput): Promise<CheckpointResult> {
  const dir = checkpointDir(endpoints.storeRoot, input.runId, input.step);
  // step-<n> must hold the weights after step n: a restarted actor catches up first, and an actor
  // elsewhere is refused before anything is written.
  await heartbeating({ step: input.step }, catchUpActor(endpoints, input.runId, input.step));
  const health = await actorHealth(endpoints);
  if (health.last_step !== input.step || health.run_id !== input.runId) {
    throw new Error(`checkpoint: asked for step ${input.step} of run ${input.runId}, but the actor holds step ${health.last_step} of run ${health.run_id}`);
  }
  const res = await heartbeating({ step: input.step }, callService<CheckpointResponse>(endpoints.actor, '/checkpoint/save', endpoints.token,
    { body: { path: dir }, request: 'CheckpointRequest', response: 'CheckpointResponse' }));
  await writeFileAtomic(path.join(endpoints.storeRoot, input.runId, 'checkpoints', 'latest'), dir);
  // What this checkpoint made unnecessary (activities/run-folder.ts). Here rather than in an activity of
  // its own: it must follow a durable checkpoint, and a retry collects again (nothing left: a no-op).
  const removed = input.gc ? await collectGarbage(endpoints.storeRoot, input.runId, input.gc) : undefined;
  return { path: dir, step: res.step, ...(removed ? { removed } : {}) };
}
