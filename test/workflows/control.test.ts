// Operating a run on a real Temporal dev server (search attributes registered, as the stack does):
// live updates with validators, pause/resume, checkpoint now, what the UI shows, per-step metrics.
// Activities act instantly; groups finish when the test releases them, trainStep can be held.
import { Context } from '@temporalio/activity';
import { WorkflowUpdateFailedError } from '@temporalio/client';
import type { TestWorkflowEnvironment } from '@temporalio/testing';
import type { RecordMetricsInput } from '../../activities/metrics';
import type { GroupResult, RolloutGroupInput, TrainStepInput } from '../../activities/types';
import { RecipeConfig } from '../../agents/recipe';
import { runStartOptions } from '../../client/start-options';
import { checkpointUpdate, pauseUpdate, resumeUpdate, setUpdate } from '../../workflows/control';
import { groupActivityId, progressQuery, runWorkflowId, trainRun } from '../../workflows/train-run';
import { MoltRecipe, MoltReward, MoltStep, MoltVersion } from '../../workflows/visibility';
import { startTemporal, waitFor, withWorkers } from '../helpers/temporal';

let env: TestWorkflowEnvironment;
beforeAll(async () => { env = await startTemporal(); });
afterAll(async () => { await env?.teardown(); });

const config = (steps: number, groups = 1) => RecipeConfig.parse({
  name: 'ctl', agent: 'agent.ts', model: 'tiny', group_size: 2, pool: { inflight: 3 }, batch: { groups },
  train: { steps }, checkpoint: { every: 100 }, sampling: { max_tokens: 4 }, algo: { lr: 1e-3 },
});

function services() {
  const s = { released: new Set<number>(), running: new Set<number>(), trainCalls: [] as TrainStepInput[], checkpoints: [] as number[], metrics: [] as RecordMetricsInput[], openSteps: 0 };
  const activities = {
    async rolloutGroup(input: RolloutGroupInput): Promise<GroupResult> {
      const ctx = Context.current();
      s.running.add(input.groupIndex);
      while (!s.released.has(input.groupIndex)) { ctx.heartbeat(); await ctx.sleep(20); }
      s.running.delete(input.groupIndex);
      return { groupIndex: input.groupIndex, episodes: [0, 1], segments: [1, 1], rewards: [1, 0], failed: 0, tokens: 8, minVersion: 0, maxVersion: 0, seconds: 0.01 };
    },
    async trainStep(input: TrainStepInput) {
      s.trainCalls.push(input);
      while (s.openSteps < input.step) await Context.current().sleep(20);
      return { step: input.step, version: input.step, replayed: false, metrics: { loss: 0.5, lr: input.algo.lr } };
    },
    async refit(input: { version: number }) { return { version: input.version, seconds: 0.001, bytes: 0 }; },
    async claimActor() { return { heldBy: null }; },
    async checkpoint(input: { runId: string; step: number }) {
      s.checkpoints.push(input.step);
      return { path: `/ckpt/${input.runId}/step-${input.step}`, step: input.step };
    },
    async recordMetrics(input: RecordMetricsInput) { s.metrics.push(input); return { written: true }; },
    async writeRunConfig() {},
  };
  return { s, activities };
}

const startRun = (runId: string, cfg: RecipeConfig, extra: { continueAsNewAfterSteps?: number; stopGraceSeconds?: number } = {}) => {
  const options = runStartOptions('/tmp/recipe', cfg, runId, true);
  return env.client.workflow.start(trainRun, { ...options, workflowId: runWorkflowId(runId), args: [{ ...options.args[0], ...extra }] });
};
const releaseOne = async (s: ReturnType<typeof services>['s']) => {
  const waiting = () => [...s.running].filter((g) => !s.released.has(g));
  await waitFor('a group running', () => waiting().length > 0);
  s.released.add(Math.min(...waiting()));
};

test('a run waits visibly while another holds the actor; cancel ends a run stuck in the actor after its grace', async () => {
  const { s, activities } = services();
  let holder: string | null = 'first';
  const claims: number[] = [];
  const stuck = {
    ...activities,
    async claimActor(input: { step: number }) { claims.push(input.step); return { heldBy: holder }; },
    async trainStep(input: TrainStepInput) { // an actor that never answers; the activity heartbeats, as the real one does
      s.trainCalls.push(input);
      for (const ctx = Context.current(); ;) { ctx.heartbeat(); await ctx.sleep(100); }
    },
  };
  await withWorkers(env, stuck, async () => {
    const handle = await startRun('waits', config(3), { stopGraceSeconds: 2 });
    await waitFor('the wait shown', async () => (await handle.query(progressQuery)).waitingFor === 'first');
    expect(s.running.size).toBe(0); // nothing generates while another run holds the engines
    holder = null;
    await waitFor('the actor claimed', async () => (await handle.query(progressQuery)).waitingFor === null, 60_000);
    expect(claims).toEqual([0, 0]);
    await releaseOne(s);
    await waitFor('step 1 stuck at the actor', () => s.trainCalls.length === 1);
    await handle.cancel();
    expect(await handle.result()).toMatchObject({ steps: 0, stopped: true });
  });
}, 120_000);

test('set changes lr and batch size from the next step, across continue-as-new; bad values are rejected', async () => {
  const { s, activities } = services();
  await withWorkers(env, activities, async () => {
    const handle = await startRun('set', config(3), { continueAsNewAfterSteps: 1 });
    await releaseOne(s);
    await waitFor('step 1 training', () => s.trainCalls.length === 1);
    // While step 1 trains: rejected values never reach the run; a good one applies from step 2.
    for (const [bad, message] of [
      [{ 'algo.lr': -1 }, 'algo.lr: -1 must be a positive number'],
      [{ 'batch.groups': 1.5 }, 'batch.groups: 1.5 must be a positive integer'],
      [{ 'algo.clip_low': 0.1 }, 'algo.clip_low cannot be changed on a running run'],
      [{}, 'nothing to set'],
    ] as const) {
      const rejected = await handle.executeUpdate(setUpdate, { args: [bad as never] }).catch((e) => e);
      expect(rejected).toBeInstanceOf(WorkflowUpdateFailedError);
      expect(rejected.cause.message).toContain(message);
    }
    const state = await handle.executeUpdate(setUpdate, { args: [{ 'algo.lr': 1e-4, 'batch.groups': 2 }] });
    expect(state.settings).toMatchObject({ 'algo.lr': 1e-4, 'batch.groups': 2 });
    s.openSteps = 3;
    // Step 1 ends before any group does: a group finishing during step 1 would let the filler start
    // one more (the run drains only after step 1), and step 3 would come in the first execution.
    await waitFor('step 1 done', async () => (await handle.query(progressQuery)).step === 1);
    for (let i = 0; i < 4; i++) await releaseOne(s);
    const summary = await handle.result();
    expect(summary.steps).toBe(3);
    expect(s.trainCalls.map((c) => [c.step, c.algo.lr, c.groups.flatMap((g) => g.episodes).length])).toEqual([[1, 1e-3, 2], [2, 1e-4, 4], [3, 1e-4, 4]]);
    expect(s.metrics.map((m) => m.metrics['control/lr'])).toEqual([1e-3, 1e-4, 1e-4]);
    // Step 2 drained the first execution (its groups 1 and 2 were in flight); step 3 came in the second.
    // Each execution of the chain says which run it is, which link, and which step (UI current details).
    const details = async (runId: string) => (await env.client.workflow.getHandle(handle.workflowId, runId)
      .query<{ currentDetails: string }>('__temporal_workflow_metadata')).currentDetails;
    const last = await details((await env.client.workflow.getHandle(handle.workflowId).describe()).runId); // the latest
    expect(last).toContain('run **set**: ctl: 3 steps of 2 groups x 2 episodes, model tiny'); // as set
    expect(last).toContain('step **3/3** (done), reward mean 0.5000; execution 2 of the run, continued as new at step 2');
    expect(last).toContain('**recipe** `/tmp/recipe`');
    const first = await details(handle.firstExecutionRunId);
    expect(first).toContain('run **set**: ctl: 3 steps of 2 groups x 2 episodes, model tiny');
    expect(first).toContain('step **2/3** (running), reward mean 0.5000; first execution of the run');
  });
});

test('pause holds training (rollouts fill a batch), checkpoint now saves the current step, resume goes on', async () => {
  const { s, activities } = services();
  s.openSteps = 100;
  await withWorkers(env, activities, async () => {
    const handle = await startRun('pause', config(2), { continueAsNewAfterSteps: 1 });
    await releaseOne(s);
    await waitFor('step 1', () => s.metrics.length === 1);
    expect((await handle.executeUpdate(pauseUpdate)).paused).toBe(true);
    await waitFor('continued as new', async () => (await handle.query(progressQuery)).step === 1);
    await releaseOne(s);
    await waitFor('a batch ready while paused', async () => (await handle.query(progressQuery)).ready === 1);
    const progress = await handle.query(progressQuery);
    expect(progress).toMatchObject({ paused: true, step: 1 });
    const pending = (await handle.describe()).raw.pendingActivities ?? [];
    expect(pending.map((a) => a.activityType?.name)).not.toContain('trainStep');
    expect(s.trainCalls).toHaveLength(1);

    expect(await handle.executeUpdate(checkpointUpdate)).toEqual({ step: 1, path: '/ckpt/pause/step-1' });
    expect(s.checkpoints).toEqual([1]);
    expect((await handle.executeUpdate(resumeUpdate)).paused).toBe(false);
    const summary = await handle.result();
    expect(summary).toMatchObject({ steps: 2, stopped: false, checkpoint: '/ckpt/pause/step-2' });
    expect(s.trainCalls.map((c) => c.step)).toEqual([1, 2]);
  });
});

test('the UI view: search attributes, summaries; one metrics record per step with actor and rollout metrics', async () => {
  const { s, activities } = services();
  s.openSteps = 100;
  await withWorkers(env, activities, async () => {
    const handle = await startRun('ui', config(2), { continueAsNewAfterSteps: 1 });
    const rejected = await handle.executeUpdate(checkpointUpdate).catch((e) => e);
    expect(rejected.cause.message).toBe('no step trained yet: nothing to checkpoint');
    await releaseOne(s);
    await releaseOne(s);
    await handle.result();
    const d = await handle.describe();
    expect(d.typedSearchAttributes.get(MoltRecipe)).toBe('ctl');
    expect(d.typedSearchAttributes.get(MoltStep)).toBe(2);
    expect(d.typedSearchAttributes.get(MoltVersion)).toBe(2);
    expect(d.typedSearchAttributes.get(MoltReward)).toBe(0.5);
    expect(d.memo).toMatchObject({ recipe: 'ctl', steps: 2 });
    const metadata = await handle.query<{ currentDetails: string }>('__temporal_workflow_metadata');
    expect(metadata.currentDetails).toContain('step **2/2** (done), reward mean 0.5000');
    // The details say which run this is: its summary and static details (see the set test for a chain).
    expect(metadata.currentDetails).toContain('run **ui**: ctl: 2 steps of 1 groups x 2 episodes, model tiny');
    expect(metadata.currentDetails).toContain('**recipe** `/tmp/recipe`');
    // The static summary belongs to the first run of the chain (continue-as-new does not carry it).
    const first = await env.client.workflow.getHandle(handle.workflowId, handle.firstExecutionRunId).describe();
    expect(await first.staticSummary()).toBe('ctl: 2 steps of 1 groups x 2 episodes, model tiny');
    const history = await env.client.workflow.getHandle(handle.workflowId, handle.firstExecutionRunId).fetchHistory();
    const scheduled = history.events!.find((e) => e.activityTaskScheduledEventAttributes?.activityId === groupActivityId(0))!;
    expect(JSON.parse(Buffer.from(scheduled.userMetadata!.summary!.data!).toString())).toBe('group 0: 2 episodes');
    // Searchable by step (the list is eventually consistent).
    await waitFor('visible to a search', async () => {
      for await (const w of env.client.workflow.list({ query: `MoltRecipe = 'ctl' AND MoltStep = 2 AND WorkflowId = 'molt-ui'` })) return w.workflowId === 'molt-ui';
      return false;
    });
    expect(s.metrics.map((m) => m.step)).toEqual([1, 2]);
    expect(s.metrics[0].metrics).toMatchObject({ loss: 0.5, 'rollout/reward_mean': 0.5, 'rollout/reward_std': 0.5, 'rollout/pass_rate': 0.5, 'rollout/tokens': 8 });
    for (const key of ['time/actor_idle', 'time/train_step', 'time/refit_transfer', 'time/engine_idle', 'rollout/staleness_max', 'dropped/stale']) {
      expect(typeof s.metrics[1].metrics[key]).toBe('number');
    }
  });
});

test('a server without the search attributes runs the loop all the same', async () => {
  const bare = await startTemporal({ searchAttributes: false });
  try {
    const { s, activities } = services();
    s.openSteps = 100;
    await withWorkers(bare, activities, async () => {
      const options = runStartOptions('/tmp/recipe', config(1), 'bare', false);
      const handle = await bare.client.workflow.start(trainRun, { ...options, workflowId: runWorkflowId('bare') });
      await releaseOne(s);
      expect((await handle.result()).steps).toBe(1);
    });
  } finally {
    await bare.teardown();
  }
});
