// The one loop. Keep `pool.inflight` prompt groups generating; whenever `batch.groups` results are
// ready, train one step on them, push the new weights to the engines, checkpoint now and then, and
// go on until `train.steps` steps are done. Groups keep generating while a step trains.
//
// Durable state is this workflow's own: the pool (groups in flight, results ready, next group
// index), the step, and the metrics. A prompt group is one `rolloutGroup` activity of this run
// (not a child workflow: a child costs ~4x the history events and workflow tasks of an activity,
// which made orchestration the bottleneck of a small step; bench/ item 1); past 256 groups in flight
// the pool hands the rest to rollout shards (rollout-pool.ts). An activity cannot
// outlive its run, so before continue-as-new the run drains: it stops starting groups, trains the
// batches that still form, and continues as new once no group is in flight, carrying the results
// not yet trained. That happens once per ~10,000 history events (~100 steps of the embedded recipe).
import {
  ActivityFailure, type ActivityOptions, allHandlersFinished, ApplicationFailure, CancellationScope, condition, continueAsNew, defineQuery,
  isCancellation, log, proxyActivities, setCurrentDetails, setHandler, sleep, upsertSearchAttributes, workflowInfo,
} from '@temporalio/workflow';
import type { Activities } from '../activities';
import { SAMPLES_PER_STEP, stepGroups, type GroupResult } from '../activities/types';
import type { RecipeConfig } from '../agents/recipe';
import {
  addEngineUpdate, applySettings, checkEngineUrl, checkpointUpdate, currentSettings, drainEngineUpdate, enginesQuery, pauseUpdate,
  resumeUpdate, setUpdate, validateSettings, type ControlState, type EngineChange, type LiveSetting,
} from './control';
import {
  DRAIN_EVENTS_PER_GROUP, DRAIN_EVENTS_PER_SHARD, GROUPS_PER_WORKFLOW, HISTORY_BYTES, HISTORY_EVENTS, rolloutPool, TASK_QUEUES,
} from './rollout-pool';
import { evalMetrics, stepMetrics } from './step-metrics';
import { stepTooLarge } from '../agents/live-settings';
import { MoltRecipe, MoltReward, MoltStep, MoltVersion, runDetails, runSummary, stepDetails } from './visibility';

export { groupActivityId, TASK_QUEUES } from './rollout-pool';
export const runWorkflowId = (runId: string) => `molt-${runId}`;

export const progressQuery = defineQuery<Progress>('progress');

export interface Progress {
  step: number;
  totalSteps: number;
  version: number;
  inflight: number;
  ready: number;
  rewardMean: number | null; // mean reward of the last trained batch
  rewardHistory: number[]; // mean reward of each trained batch, the latest REWARD_HISTORY steps
  tokensPerSecond: number; // generated tokens received / elapsed time
  elapsedSeconds: number;
  lastMetrics: Record<string, number>;
  dropped: Dropped;
  state: 'running' | 'stopping' | 'done';
  paused: boolean; // no new step starts while paused (groups keep generating up to a batch)
  waitingFor: string | null; // the run that holds the actor and engines, while this one waits for them
  settings: Record<LiveSetting, number>; // the live settings the next step uses
  checkpoint: { step: number; path: string } | null; // the latest
  liveFrom: number; // groups with this index or above may still be trained (store GC keeps them)
  pools: RecipeConfig['pools']; // the recipe's other engine pools (judge, teacher)
}
export interface Dropped { stale: number; empty: number }

// Everything continue-as-new carries over.
export interface Carried {
  step: number; // steps done; the policy version is the last step (0 = initial weights)
  nextGroupIndex: number;
  ready: GroupResult[]; // results not yet trained, in arrival order
  dropped: Dropped;
  tokens: number;
  startedAt: number; // epoch ms of the first run
  rewardMean: number | null;
  rewardHistory: number[];
  lastMetrics: Record<string, number>;
  checkpoint: { step: number; path: string } | null;
  paused: boolean;
  lastStepAt: number; // epoch ms when the last step ended (for the step's time split)
  tokensAtLastStep: number; // `tokens` then
  execution?: number; // 1 for the first execution of the run, +1 at each continue-as-new
  engines?: string[]; // the engines serving the run (engines add|drain); unset: the workers' own, until the claim
}
const REWARD_HISTORY = 1000; // the curve `molt-client` draws; bounded so the carried state stays small

export interface TrainRunInput {
  runId?: string; // absent in a scheduled run: then the workflow id `molt-<runId>` names it (each firing its own)
  recipeDir: string;
  config: RecipeConfig;
  carried?: Carried;
  continueAsNewAfterSteps?: number; // test hook: continue as new after this many steps in one run
  groupsPerWorkflow?: number; // test hook: groups in flight per workflow before the pool shards (default GROUPS_PER_WORKFLOW)
  shardHistoryEvents?: number; // test hook: a rollout shard continues as new at this many events
  resumed?: boolean; // set by `molt-client resume` for a run an earlier stack left (see resumePoint)
  stopGraceSeconds?: number; // how long a cancelled run's actor work may take (default STOP_GRACE_SECONDS)
  // `schedule create --continue-from-schedule`: each firing starts from the latest checkpoint of the
  // schedule's previous firing that has one (the first firing from the recipe's init or model).
  lineage?: string;
}
// A cancel lets the step in progress finish and saves a checkpoint, but an actor call that hangs
// must not keep the run stopping forever: after this long the actor work still running is
// cancelled and the run ends without it (its trained steps stay replayable from their manifests).
const STOP_GRACE_SECONDS = 120;
const FINAL_REJOIN_TRIES = 12; // 10 s apart: how long the last refit waits for an engine that is restarting

export interface TrainRunSummary {
  runId: string;
  steps: number;
  version: number;
  stopped: boolean; // true when cancelled before train.steps
  checkpoint: string | null;
  rewardMean: number | null;
  rewardHistory: number[];
  lastMetrics: Record<string, number>;
  dropped: Dropped;
}

// trainStep is idempotent on (runId, step) at the actor, so it may retry forever. The actor
// activities heartbeat while they wait, so a dead worker shows within the heartbeat timeout. sftRun's
// actor activities use the same options.
export const ACTOR_ACTIVITY_OPTIONS: ActivityOptions = {
  taskQueue: TASK_QUEUES.actor,
  startToCloseTimeout: '30 minutes',
  heartbeatTimeout: '30 seconds',
  retry: { initialInterval: '1 second', backoffCoefficient: 2, maximumInterval: '1 minute' },
};
const { trainStep, refit, checkpoint, claimActor, resumePoint } = proxyActivities<Activities>(ACTOR_ACTIVITY_OPTIONS);
// An engine joining the run (engines add) gets the current weights with this refit; one that cannot
// be reached fails the join after a few tries instead of holding the actor.
const { refit: joinRefit } = proxyActivities<Activities>({
  taskQueue: TASK_QUEUES.actor,
  startToCloseTimeout: '5 minutes',
  heartbeatTimeout: '30 seconds',
  retry: { initialInterval: '1 second', backoffCoefficient: 2, maximumAttempts: 3 },
});
// One line per step in <storeRoot>/<runId>/metrics.jsonl (idempotent per step), and the run's
// config.json. On the control queue, beside the loop: on the actor's queue (one activity at a time)
// they could hold up the next trainStep. A write takes milliseconds: a short timeout, so that one
// lost with its worker is retried within seconds (the end of the run and continue-as-new wait for it).
// sftRun records its metrics with the same options.
export const CONTROL_WRITE_OPTIONS: ActivityOptions = {
  taskQueue: TASK_QUEUES.control,
  startToCloseTimeout: '10 seconds',
  retry: { initialInterval: '1 second', backoffCoefficient: 2, maximumInterval: '1 minute' },
};
const { recordMetrics, writeRunConfig } = proxyActivities<Activities>(CONTROL_WRITE_OPTIONS);

// Held-out evaluation (activities/evaluate.ts) on the rollout workers. It writes nothing, so a retry
// just runs it again; one that keeps failing is logged and skipped, never stops training.
const { evaluate } = proxyActivities<Activities>({
  taskQueue: TASK_QUEUES.rollout,
  startToCloseTimeout: '2 hours',
  heartbeatTimeout: '5 minutes', // a heartbeat per finished episode
  retry: { initialInterval: '1 second', backoffCoefficient: 2, maximumInterval: '1 minute', maximumAttempts: 3 },
});

export async function trainRun(input: TrainRunInput): Promise<TrainRunSummary> {
  const runId = input.runId ?? workflowInfo().workflowId.replace(/^molt-/, '');
  const { recipeDir } = input;
  let config = input.config; // live settings (the `set` update) change it from the next step
  const run: Carried = input.carried ?? {
    step: 0, nextGroupIndex: 0, ready: [], dropped: { stale: 0, empty: 0 },
    tokens: 0, startedAt: Date.now(), rewardMean: null, rewardHistory: [], lastMetrics: {}, checkpoint: null,
    paused: false, lastStepAt: Date.now(), tokensAtLastStep: 0,
  };
  const firstStep = run.step; // where this execution started
  const inflight = new Set<number>(); // groups started by this run whose result has not arrived
  // Elastic engines. A group uses the engines the run had when it started; a draining engine gets no
  // new group, keeps getting the weights while groups that may use it run, and leaves after them.
  const groupEngines = new Map<number, string[]>(); // group in flight -> its engines
  const drainingEngines = new Set<string>();
  const joining = new Set<string>();
  let batchInStep: GroupResult[] = []; // the batch taken for a step, until its trainStep has written the manifest
  let state: Progress['state'] = 'running';
  let waitingFor: string | null = null; // see claim
  const actorTickets = { next: 0, serving: 0 }; // withActor's queue
  // The actor work (steps, checkpoints) runs in this scope: a stop that overruns its grace cancels it.
  // Made inside the non-cancellable part below, so that the run's cancel does not reach it at once.
  let actorScope!: CancellationScope;
  let draining = false; // the history is full: no new groups; continue as new once none is in flight
  let training = false; // a batch has been taken and its step (train, refit) is not done yet
  // Search attributes are upserted only when the client set MoltRecipe at start, i.e. when the
  // server has them registered: upserting an unknown attribute would fail every workflow task.
  const searchable = workflowInfo().typedSearchAttributes.get(MoltRecipe) !== undefined;

  let configWritten: Promise<unknown> = Promise.resolve(); // see saveConfig
  let fatal: string | undefined; // set when a group broke the failure budget: stop, checkpoint, fail the run
  // The groups' activities run in their own scope, cancelled when the run ends (the rest of the
  // run is non-cancellable: see below).
  const groups = new CancellationScope({ cancellable: true });
  const perWorkflow = input.groupsPerWorkflow ?? GROUPS_PER_WORKFLOW; // groups in flight per workflow (rollout-pool.ts)
  const pool = rolloutPool({
    runId, groupSize: config.group_size, perWorkflow, scope: groups,
    shardHistoryEvents: input.shardHistoryEvents,
    receive, fail: (message) => { fatal ??= message; state = 'stopping'; },
  });
  function startGroups(n: number): void {
    const starts = Array.from({ length: n }, () => ({ groupIndex: run.nextGroupIndex++, engines: run.engines }));
    for (const g of starts) {
      inflight.add(g.groupIndex);
      if (g.engines) groupEngines.set(g.groupIndex, g.engines);
    }
    pool.start(starts);
  }
  function receive(result: GroupResult): void {
    inflight.delete(result.groupIndex);
    groupEngines.delete(result.groupIndex);
    if (result.fatal !== undefined) { fatal ??= result.fatal; state = 'stopping'; }
    run.ready.push(result);
    run.tokens += result.tokens;
  }
  setHandler(progressQuery, (): Progress => {
    const elapsedSeconds = (Date.now() - run.startedAt) / 1000;
    return {
      step: run.step, totalSteps: config.train.steps, version: run.step,
      inflight: inflight.size, ready: run.ready.length, rewardMean: run.rewardMean, rewardHistory: run.rewardHistory,
      tokensPerSecond: elapsedSeconds > 0 ? run.tokens / elapsedSeconds : 0, elapsedSeconds,
      lastMetrics: run.lastMetrics, dropped: run.dropped, state, paused: run.paused, waitingFor, settings: currentSettings(config),
      checkpoint: run.checkpoint, liveFrom: liveFrom(), pools: config.pools,
    };
  });

  // Live control. Validators reject bad requests before they reach history.
  const controlState = (): ControlState => { showDetails(); return { paused: run.paused, settings: currentSettings(config) }; };
  const whileRunning = () => { if (state !== 'running') throw new Error(`run is ${state}`); };
  setHandler(pauseUpdate, () => { run.paused = true; return controlState(); }, { validator: whileRunning });
  setHandler(resumeUpdate, () => { run.paused = false; return controlState(); }, { validator: whileRunning });
  setHandler(setUpdate, (settings) => { config = applySettings(config, settings); saveConfig(); return controlState(); }, {
    validator: (settings) => {
      whileRunning();
      validateSettings(settings);
      const tooLarge = stepTooLarge(applySettings(config, settings));
      if (tooLarge) throw new Error(tooLarge);
    },
  });
  setHandler(checkpointUpdate, async () => {
    const done = await withActor(async () => { if (run.checkpoint?.step !== run.step) await saveCheckpoint(); });
    if (!done) throw new Error(`run is ${state}: no checkpoint saved`);
    return run.checkpoint!;
  }, { validator: () => { if (run.step === 0) throw new Error('no step trained yet: nothing to checkpoint'); } });
  setHandler(enginesQuery, () => ({ serving: run.engines ?? [], draining: [...drainingEngines], version: run.step }));
  setHandler(addEngineUpdate, async (url): Promise<EngineChange> => {
    const started = Date.now();
    joining.add(url);
    try {
      await condition(() => run.engines !== undefined || state !== 'running'); // the run's engines are known at its claim
      const joined = await withActor(async () => {
        await joinRefit.executeWithOptions({ summary: `engine ${url} joins at version ${run.step}` },
          [{ runId, version: run.step, engines: [url], join: true }]);
        run.engines = [...run.engines!, url]; // before the actor is free: no step's refit can miss it
      });
      if (!joined || !run.engines) throw ApplicationFailure.create({ message: `run is ${state}: engine ${url} did not join` });
      return { url, version: run.step, seconds: (Date.now() - started) / 1000 };
    } finally { joining.delete(url); }
  }, {
    validator: (url) => {
      whileRunning();
      checkEngineUrl(url);
      if (run.engines?.includes(url) || joining.has(url) || drainingEngines.has(url)) throw new Error(`engine ${url} already serves run ${runId}`);
    },
  });
  setHandler(drainEngineUpdate, async (url): Promise<EngineChange> => {
    const started = Date.now();
    run.engines = run.engines!.filter((e) => e !== url);
    drainingEngines.add(url);
    const using = () => [...groupEngines.values()].filter((engines) => engines.includes(url)).length;
    const groupsLeft = using();
    await condition(() => using() === 0);
    drainingEngines.delete(url);
    return { url, version: run.step, seconds: (Date.now() - started) / 1000, groups: groupsLeft };
  }, {
    validator: (url) => {
      whileRunning();
      if (!run.engines?.includes(url)) throw new Error(`engine ${url} does not serve run ${runId} (its engines: ${run.engines?.join(', ') ?? 'not known before the run claims them'})`);
      if (run.engines.length === 1) throw new Error(`engine ${url} is the run's last engine: add another before draining it`);
    },
  });

  // Cancel means a graceful stop: the loop sees `stopping`, finishes the step it is in,
  // checkpoints and stops the children. Hence all the work below runs non-cancellable, except the
  // actor work, which gets a grace period (STOP_GRACE_SECONDS).
  CancellationScope.current().cancelRequested.catch(() => {
    state = 'stopping';
    void CancellationScope.nonCancellable(() => sleep((input.stopGraceSeconds ?? STOP_GRACE_SECONDS) * 1000)).then(() => actorScope.cancel());
  });

  return CancellationScope.nonCancellable(async () => {
    actorScope = new CancellationScope({ cancellable: true });
    if (input.resumed) { // its last execution's input is older than what the store holds: go on from there
      const at = await resumePoint({ runId });
      Object.assign(run, { step: at.step, nextGroupIndex: Math.max(run.nextGroupIndex, at.nextGroupIndex), ready: [], paused: false, checkpoint: at.checkpoint });
      log.info('resumed a run left by an earlier stack', { ...at });
    }
    // The actor and the engines serve one run at a time: wait for them before generating anything.
    if (!(await claim())) return summary(); // stopped while waiting
    // The filler: start a group whenever a slot is free. It pauses while a full batch is already
    // waiting (training is the bottleneck then, and more groups would only be staler).
    // In the sync loop it starts one batch's groups only when nothing is in flight or training, so
    // every token is sampled by the weights the step trains (tops up groups dropped as empty).
    let filling = true;
    const sync = () => config.loop === 'sync';
    const freeSlots = () => sync()
      ? (inflight.size === 0 && !training ? config.batch.groups - run.ready.length : 0)
      : (run.ready.length < config.batch.groups ? config.pool.inflight - inflight.size : 0);
    saveConfig();
    const filler = (async () => {
      await configWritten; // the groups read the run's config from it
      for (;;) {
        await condition(() => !filling || freeSlots() > 0);
        if (!filling) return;
        startGroups(freeSlots()); // every free slot at once: one workflow task for all of them, not one each
      }
    })();
    const stopFilling = async () => { filling = false; await filler; };

    showDetails();
    let metricsWritten: Promise<unknown> = Promise.resolve();
    let stepsThisRun = 0;
    while (run.step < config.train.steps && state === 'running') {
      const batch = await nextBatch();
      if (batch === null) break; // stopping, or drained: skip the step

      const step = run.step + 1; // step s produces policy version s
      batchInStep = batch;
      const groups = stepGroups(batch);
      const trajectories = batch.reduce((n, g) => g.segments.reduce((m, s) => m + s, n), 0);
      const tokens = batch.reduce((n, g) => n + g.tokens, 0);
      const algo = config.algo; // a `set` during the step applies from the next one
      const times = { batchReady: Date.now(), trained: 0, refitted: 0, transferSeconds: 0 };
      const trained = await withActor(async () => {
        const result = await trainStep.executeWithOptions(
          { summary: `train step ${step}: ${batch.length} groups, ${trajectories} trajectories, ${tokens} tokens` },
          [{ runId, step, groups, algo }]);
        batchInStep = []; // the step's manifest names them now
        times.trained = Date.now();
        const engines = run.engines && [...run.engines, ...drainingEngines];
        let refitted = await refit.executeWithOptions({ summary: `refit engines to version ${step}` }, [{ runId, version: step, engines }]);
        // A refit goes on without an engine that does not answer; a restarted one rejoins at the next
        // refit. After the last step there is none, so wait a bounded while for it to come back.
        for (let tries = 0; step === config.train.steps && refitted.missed?.length && tries < FINAL_REJOIN_TRIES; tries++) {
          await sleep('10 seconds');
          refitted = await refit.executeWithOptions({ summary: `refit engines that missed version ${step}` }, [{ runId, version: step, engines }]);
        }
        times.refitted = Date.now();
        times.transferSeconds = refitted.seconds;
        run.step = step;
        run.lastMetrics = result.metrics;
        if (step % config.checkpoint.every === 0) await saveCheckpoint();
      });
      training = false;
      if (!trained) break; // stopping, and the actor overran the grace
      const rewards = batch.flatMap((g) => g.rewards);
      run.rewardMean = rewards.reduce((a, b) => a + b, 0) / rewards.length;
      run.rewardHistory = [...run.rewardHistory, run.rewardMean].slice(-REWARD_HISTORY);
      log.info('step done', { step, rewardMean: run.rewardMean, groups: batch.map((g) => g.groupIndex) });
      // Written while the next batch gathers: the loop does not wait on it (each round trip costs),
      // but the lines go in step order (a later step's write waits for the earlier one).
      const metrics = stepMetrics({ step, batch, algo, actor: run.lastMetrics, dropped: run.dropped, times, lastStepAt: run.lastStepAt, generated: run.tokens - run.tokensAtLastStep });
      // Every eval.every steps the new policy is evaluated, also while the loop goes on; its eval/...
      // figures join this step's line, so the lines stay one per step, in step order.
      const evaluated = config.eval.every > 0 && step % config.eval.every === 0 ? evaluateStep(step) : Promise.resolve({});
      const samples = batch.flatMap((g) => (g.sample ? [{ group: g.groupIndex, ...g.sample }] : [])).slice(0, SAMPLES_PER_STEP);
      metricsWritten = metricsWritten.then(async () => recordMetrics.executeWithOptions(
        { summary: `metrics of step ${step}` }, [{
          runId, step, metrics: { ...metrics, ...(await evaluated) }, samples,
          wandb: config.wandb ?? undefined, last: step === config.train.steps,
        }]));
      run.lastStepAt = Date.now();
      run.tokensAtLastStep = run.tokens;
      if (searchable) {
        upsertSearchAttributes([{ key: MoltStep, value: step }, { key: MoltVersion, value: step }, { key: MoltReward, value: run.rewardMean }]);
      }
      showDetails();

      stepsThisRun++;
      const history = workflowInfo();
      const drainEvents = DRAIN_EVENTS_PER_GROUP * Math.min(config.pool.inflight, perWorkflow)
        + DRAIN_EVENTS_PER_SHARD * Math.ceil(Math.max(0, config.pool.inflight - perWorkflow) / perWorkflow);
      const historyFull = history.historyLength + drainEvents >= HISTORY_EVENTS
        || history.historySize >= HISTORY_BYTES || stepsThisRun >= (input.continueAsNewAfterSteps ?? Infinity);
      if (historyFull && !draining) { draining = true; await stopFilling(); }
    }
    if (draining && state === 'running' && run.step < config.train.steps) { // drained: nothing in flight
      await pool.close();
      await metricsWritten;
      await configWritten;
      await condition(allHandlersFinished);
      if (state === 'running') {
        // Without their samples (only a step's metrics line shows them): what is carried must fit one payload.
        const carried = { ...run, ready: run.ready.map(({ sample: _, ...r }) => r), execution: (run.execution ?? 1) + 1 };
        return continueAsNew<typeof trainRun>({ ...input, runId, config, carried, resumed: false });
      }
    }

    // Done or stopping: no new groups, a final checkpoint, and the leftover groups cancelled.
    await stopFilling();
    await metricsWritten;
    await configWritten;
    await withActor(async () => { if (run.step > 0 && run.checkpoint?.step !== run.step) await saveCheckpoint(); });
    groups.cancel();
    if (fatal !== undefined) {
      state = 'done';
      showDetails();
      const saved = run.checkpoint ? ` (last checkpoint: step ${run.checkpoint.step}, ${run.checkpoint.path})` : '';
      throw ApplicationFailure.nonRetryable(`run ${runId} failed after ${run.step} steps${saved}: ${fatal}`, 'FailureBudgetExceeded');
    }
    return summary();
  });

  function summary(): TrainRunSummary {
    state = 'done';
    showDetails();
    return {
      runId, steps: run.step, version: run.step, stopped: run.step < config.train.steps, checkpoint: run.checkpoint?.path ?? null,
      rewardMean: run.rewardMean, rewardHistory: run.rewardHistory, lastMetrics: run.lastMetrics, dropped: run.dropped,
    };
  }

  // Claims the actor and the engines (activities/actor.ts, claimActor), waiting while another run
  // holds them, with a poll every 10 s growing to a minute. False when the run stops meanwhile.
  async function claim(): Promise<boolean> {
    for (let pollSeconds = 10; state === 'running'; pollSeconds = Math.min(60, pollSeconds * 2)) {
      // A run with `init` starts from those weights (actor, KL reference, engines); a directory that
      // does not fit the model fails the claim for good, and the run with it, naming the directory.
      const { heldBy, engines } = await claimActor.executeWithOptions({ summary: `claim the actor at step ${run.step}` },
        [{ runId, step: run.step, init: config.init, lineage: input.lineage, engines: run.engines }]).catch((err) => {
        const cause = err instanceof ActivityFailure ? err.cause : err;
        if ((config.init ?? input.lineage) === undefined || !(cause instanceof ApplicationFailure && cause.nonRetryable)) throw err;
        throw ApplicationFailure.nonRetryable(`run ${runId}: cannot start from init ${config.init ?? `(schedule ${input.lineage})`}: ${cause.message}`, 'InitFailed');
      });
      if (heldBy === null) { run.engines = engines ?? run.engines; break; }
      if (waitingFor !== heldBy) log.info('waiting for the actor', { heldBy });
      waitingFor = heldBy;
      showDetails();
      await condition(() => state !== 'running', pollSeconds * 1000);
      if (workflowInfo().continueAsNewSuggested && state === 'running') {
        await continueAsNew<typeof trainRun>({ ...input, runId, config, carried: run, resumed: false });
      }
    }
    waitingFor = null;
    showDetails();
    return state === 'running';
  }

  // The first `batch.groups` usable results, in arrival order; null when stopping, or when draining
  // and no group is left in flight. A group is dropped when it has no finished episode, or
  // (staleness_mode 'drop') when its oldest token is more than max_staleness versions behind the
  // current policy. In 'mask' mode the actor masks the stale tokens instead.
  // While paused, nothing is taken (the filler stops once a batch is waiting).
  async function nextBatch(): Promise<GroupResult[] | null> {
    const maxStaleness = config.algo.max_staleness;
    const dropStale = config.staleness_mode === 'drop' && maxStaleness !== null;
    const drained = () => draining && inflight.size === 0;
    for (;;) {
      await condition(() => (run.ready.length >= config.batch.groups && !run.paused) || state !== 'running' || drained());
      if (state !== 'running') return null;
      run.ready = run.ready.filter((g) => {
        if (g.rewards.length === 0) { run.dropped.empty++; return false; }
        if (dropStale && run.step - g.minVersion > maxStaleness) { run.dropped.stale++; return false; }
        return true;
      });
      if (run.ready.length >= config.batch.groups && !run.paused) {
        training = true;
        return run.ready.splice(0, config.batch.groups);
      }
      if (drained()) return null;
    }
  }

  async function evaluateStep(step: number): Promise<Record<string, number>> {
    const { prompts, samples } = config.eval;
    try {
      const result = await evaluate.executeWithOptions(
        { summary: `evaluate step ${step}: ${prompts} held-out prompts, greedy + ${samples} samples` }, [{ runId, step, recipeDir, config }]);
      return evalMetrics(result);
    } catch (err) {
      log.warn('evaluation failed; training goes on', { step, error: (err as Error).message });
      return {};
    }
  }

  // Call with the actor held (withActor), so the checkpoint holds the step it names. The activity then
  // deletes what the checkpoint made unnecessary in the store (activities/run-folder.ts).
  async function saveCheckpoint(): Promise<void> {
    const gc = {
      keepAfterStep: run.step - config.store.keep_steps, liveFrom: liveFrom(), keepCheckpoints: config.store.keep_checkpoints,
    };
    const saved = await checkpoint.executeWithOptions({ summary: `checkpoint step ${run.step}` }, [{ runId, step: run.step, gc }]);
    run.checkpoint = { step: saved.step, path: saved.path };
  }

  // The lowest group index a later step may still train: groups in flight, waiting, or in the step.
  function liveFrom(): number {
    const waiting = [...run.ready, ...batchInStep].map((g) => g.groupIndex);
    return Math.min(run.nextGroupIndex, ...inflight, ...waiting);
  }

  // <store>/<runId>/config.json: the config as it is now (at each execution's start and after a `set`).
  function saveConfig(): void {
    const written = configWritten;
    configWritten = written.then(() => writeRunConfig({ runId, recipeDir, config }));
  }

  // One actor call sequence at a time: a step (train, refit, checkpoint) or a requested checkpoint.
  // False when the work was cancelled because a stop overran its grace.
  // First come, first served: the loop takes the actor again within the activation that frees it, so a
  // waiter that only watched for it to be free (an engine joining, a checkpoint) could wait forever.
  async function withActor(work: () => Promise<void>): Promise<boolean> {
    const ticket = actorTickets.next++;
    await condition(() => actorTickets.serving === ticket);
    try {
      await actorScope.run(work);
      return true;
    } catch (err) {
      if (actorScope.consideredCancelled && isCancellation(err)) return false;
      throw err;
    } finally { actorTickets.serving++; }
  }

  function showDetails(): void {
    setCurrentDetails(stepDetails({
      runId, summary: runSummary(config), details: runDetails(recipeDir, config), execution: run.execution ?? 1, firstStep,
      step: run.step, totalSteps: config.train.steps, rewardMean: run.rewardMean, paused: run.paused, state,
      lr: config.algo.lr, batchGroups: config.batch.groups, inflight: inflight.size, ready: run.ready.length, checkpoint: run.checkpoint?.path ?? null,
      waitingFor,
    }));
  }
}
