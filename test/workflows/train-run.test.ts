// The loop's logic on a real Temporal dev server, with activities that act like the real ones
// but instantly: groups finish when the test releases them (or after a short sleep), trainStep
// records its calls and can be held.
import { Context } from '@temporalio/activity';
import { ApplicationFailure, CancelledFailure } from '@temporalio/common';
import type { WorkflowHandle } from '@temporalio/client';
import type { TestWorkflowEnvironment } from '@temporalio/testing';
import type { RecordMetricsInput } from '../../activities/metrics';
import type { RunConfigInput } from '../../activities/run-folder';
import type { CheckpointInput, GroupResult, RolloutGroupInput, TrainStepInput } from '../../activities/types';
import { RecipeConfig } from '../../agents/recipe';
import { groupActivityId, progressQuery, runWorkflowId, TASK_QUEUES, trainRun, type TrainRunInput } from '../../workflows/train-run';
import { startTemporal, waitFor, withWorkers } from '../helpers/temporal';

let env: TestWorkflowEnvironment;
beforeAll(async () => { env = await startTemporal(); });
afterAll(async () => { await env?.teardown(); });

function makeConfig(o: {
  inflight: number; groups: number; steps: number; every?: number; algo?: object; staleness_mode?: string; store?: object;
}): RecipeConfig {
  return RecipeConfig.parse({
    name: 'test', agent: 'agent.ts', model: 'tiny', group_size: 2,
    pool: { inflight: o.inflight }, batch: { groups: o.groups }, train: { steps: o.steps },
    checkpoint: { every: o.every ?? 100 }, sampling: { max_tokens: 4 }, algo: o.algo ?? {},
    staleness_mode: o.staleness_mode ?? 'mask', store: o.store,
  });
}

// Fake services: `version` is the engines' weight version (set by refit), recorded per group.
function fakeServices(opts: {
  hold?: (g: number) => boolean; empty?: (g: number) => boolean; overBudget?: (g: number) => boolean; failFirstAttempt?: (g: number) => boolean;
  rolloutMs?: number; onTrainStep?: (input: TrainStepInput, attempt: number) => Promise<void>;
} = {}) {
  const s = {
    version: 0,
    running: new Set<number>(),
    released: new Set<number>(),
    cancelled: new Set<number>(),
    log: [] as { event: 'start' | 'done'; group: number; workflowRunId: string }[], // rollout attempts, in order
    attempts: new Map<number, number>(), // group -> rolloutGroup attempts
    results: new Map<number, GroupResult>(),
    trainCalls: [] as { input: TrainStepInput; attempt: number; workflowRunId: string }[],
    refits: [] as number[],
    checkpoints: [] as number[],
    checkpointInputs: [] as CheckpointInput[],
    metrics: [] as RecordMetricsInput[],
    configs: new Map<string, RecipeConfig>(), // run -> the config writeRunConfig wrote, which its groups read
  };
  const activities = {
    async rolloutGroup(input: RolloutGroupInput): Promise<GroupResult> {
      const ctx = Context.current();
      const g = input.groupIndex;
      const config = s.configs.get(input.runId);
      if (!config) throw ApplicationFailure.nonRetryable(`group ${g} started before run ${input.runId} wrote its config`);
      const minVersion = s.version;
      const workflowRunId = ctx.info.workflowExecution?.runId ?? '';
      s.attempts.set(g, ctx.info.attempt);
      s.log.push({ event: 'start', group: g, workflowRunId });
      s.running.add(g);
      try {
        if (opts.hold?.(g) ?? false) {
          while (!s.released.has(g)) { ctx.heartbeat(); await ctx.sleep(20); }
        } else {
          await ctx.sleep(opts.rolloutMs ?? 20);
        }
      } catch (err) {
        if (err instanceof CancelledFailure) s.cancelled.add(g);
        throw err;
      } finally {
        s.running.delete(g);
      }
      s.log.push({ event: 'done', group: g, workflowRunId });
      if (ctx.info.attempt === 1 && opts.failFirstAttempt?.(g)) throw new Error(`group ${g}: rollout worker lost`);
      if (opts.overBudget?.(g)) throw ApplicationFailure.nonRetryable(`group ${g}: 2 of 2 episodes failed, over the failure budget`, 'FailureBudgetExceeded');
      const episodes = opts.empty?.(g) ? [] : [...Array(config.group_size).keys()]; // empty: every episode failed
      const result: GroupResult = {
        groupIndex: g, episodes, segments: episodes.map(() => 1), rewards: episodes.map((e) => (g + e) % 2),
        failed: config.group_size - episodes.length, tokens: 8 * episodes.length, minVersion, maxVersion: s.version, seconds: 0.01,
      };
      s.results.set(g, result);
      return result;
    },
    async trainStep(input: TrainStepInput) {
      const info = Context.current().info;
      s.trainCalls.push({ input, attempt: info.attempt, workflowRunId: info.workflowExecution?.runId ?? '' });
      await opts.onTrainStep?.(input, info.attempt);
      return { step: input.step, version: input.step, replayed: false, metrics: { loss: 0.5 } };
    },
    async refit(input: { runId: string; version: number }) {
      s.version = input.version;
      s.refits.push(input.version);
      return { version: input.version, seconds: 0, bytes: 0 };
    },
    async claimActor() { return { heldBy: null }; },
    async checkpoint(input: CheckpointInput) {
      s.checkpoints.push(input.step);
      s.checkpointInputs.push(input);
      return { path: `/ckpt/${input.runId}/step-${input.step}`, step: input.step };
    },
    async recordMetrics(input: RecordMetricsInput) {
      s.metrics.push(input);
      return { written: true };
    },
    async writeRunConfig(input: RunConfigInput) { s.configs.set(input.runId, input.config); },
  };
  return { s, activities };
}

const stepBatches = (s: ReturnType<typeof fakeServices>['s']) => s.trainCalls.filter((c) => c.attempt === 1).map((c) => c.input.groups.map((g) => g.groupIndex));
const heldUntilStep = async (open: () => number, step: number) => {
  while (open() < step) await Context.current().sleep(20);
};

function start(runId: string, config: RecipeConfig, extra: Partial<TrainRunInput> = {}) {
  return env.client.workflow.start(trainRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control,
    args: [{ runId, recipeDir: '/tmp/recipe', config, ...extra }],
  });
}

// Groups whose rolloutGroup activity the current run of `runId` still waits on.
async function pendingGroups(runId: string): Promise<string[]> {
  const d = await env.client.workflow.getHandle(runWorkflowId(runId)).describe();
  return (d.raw.pendingActivities ?? []).map((a) => a.activityId ?? '');
}

// Releases held groups one at a time; the next is released only once the run has recorded the
// previous one's result, so the run receives them in exactly this order.
async function release(s: ReturnType<typeof fakeServices>['s'], runId: string, groups: number[]) {
  for (const g of groups) {
    s.released.add(g);
    await waitFor(`group ${g} recorded`, async () => !(await pendingGroups(runId)).includes(groupActivityId(g)));
  }
}

const lowestRunning = (s: ReturnType<typeof fakeServices>['s'], n: number) => [...s.running].sort((a, b) => a - b).slice(0, n);
const startedBy = (s: ReturnType<typeof fakeServices>['s'], workflowRunId: string) =>
  [...new Set(s.log.filter((e) => e.event === 'start' && e.workflowRunId === workflowRunId).map((e) => e.group))].sort((a, b) => a - b);

test('the pool stays full while a step trains; each step trains batch.groups distinct groups in arrival order', async () => {
  const runId = 'pool';
  let openSteps = 0;
  const { s, activities } = fakeServices({ hold: () => true, onTrainStep: (input) => heldUntilStep(() => openSteps, input.step) });
  await withWorkers(env, activities, async () => {
    const handle = await start(runId, makeConfig({ inflight: 4, groups: 2, steps: 3, every: 2 }));
    const released: number[][] = [];
    for (let step = 1; step <= 3; step++) {
      await waitFor('pool full', () => s.running.size === 4);
      const [a, b] = lowestRunning(s, 2);
      await release(s, runId, [b, a]); // arrival order differs from index order
      released.push([b, a]);
      await waitFor(`step ${step} starts`, () => s.trainCalls.length === step);
      await waitFor(`pool refilled while step ${step} trains`, () => s.running.size === 4);
      expect(s.trainCalls.length).toBe(step); // the step is still held
      openSteps = step;
    }
    const summary = await handle.result();
    expect(summary).toMatchObject({ steps: 3, version: 3, stopped: false, checkpoint: `/ckpt/${runId}/step-3` });
    expect(stepBatches(s)).toEqual(released);
    expect(new Set(released.flat()).size).toBe(6);
    expect(s.refits).toEqual([1, 2, 3]);
    expect(s.checkpoints).toEqual([2, 3]); // every 2 steps, and at the end
    // Groups still in flight at the end are cancelled.
    const leftover = [...Array(10).keys()].filter((g) => !released.flat().includes(g));
    expect(leftover).toHaveLength(4);
    await waitFor('leftover groups cancelled', () => leftover.every((g) => s.cancelled.has(g)));
  });
});

test('sync loop: one batch of groups at a time, started only after the previous step is refit, so every token is on-policy', async () => {
  const runId = 'sync';
  const { s, activities } = fakeServices({ rolloutMs: 30, empty: (g) => g === 1 }); // group 1 is dropped as empty
  await withWorkers(env, activities, async () => {
    const config = { ...makeConfig({ inflight: 8, groups: 2, steps: 3 }), loop: 'sync' as const };
    const summary = await (await start(runId, config)).result();
    expect(summary).toMatchObject({ steps: 3, stopped: false });
    // Never more than a batch in flight (pool.inflight is ignored), and none while a step trains.
    const starts = s.log.filter((e) => e.event === 'start').map((e) => e.group);
    expect(new Set(starts).size).toBe(starts.length);
    expect(Math.max(...starts)).toBeLessThanOrEqual(6); // 3 steps x 2 groups + the one dropped as empty
    // Every trained group ran entirely at the version its step trains from.
    stepBatches(s).forEach((groups, i) => groups.forEach((g) => {
      expect(s.results.get(g)).toMatchObject({ minVersion: i, maxVersion: i });
    }));
    expect(stepBatches(s).map((b) => [...b].sort())).toEqual([[0, 2], [3, 4], [5, 6]]); // empty group 1 topped up by 2
  });
});

test('continue-as-new drains the pool: no group starts once the history is full; the run continues as new when none is in flight, carrying the results not trained', async () => {
  const runId = 'can';
  const { s, activities } = fakeServices({ hold: () => true });
  await withWorkers(env, activities, async () => {
    const handle = await start(runId, makeConfig({ inflight: 3, groups: 2, steps: 3 }), { continueAsNewAfterSteps: 1 });
    const firstRun = handle.firstExecutionRunId;
    await waitFor('pool full', () => s.running.size === 3);
    await release(s, runId, [0, 1]);
    await waitFor('step 1 trained', () => s.refits.length === 1);
    // The step's batch freed two slots before the history was full: 3 and 4 started then. From
    // step 1's end the run drains: 2, 3 and 4 finish, nothing new starts.
    await waitFor('refilled', () => s.running.size === 3);
    await release(s, runId, [2, 3]);
    await waitFor('step 2 trained while draining', () => s.refits.length === 2);
    expect(startedBy(s, firstRun)).toEqual([0, 1, 2, 3, 4]);
    await release(s, runId, [4]); // the last group in flight: now the run continues as new
    await waitFor('the next run fills the pool', () => s.running.size === 3);
    const secondRun = (await handle.describe()).runId;
    expect(secondRun).not.toBe(firstRun);
    expect(startedBy(s, secondRun)).toEqual([5, 6, 7]);
    await release(s, runId, [5]); // 4 (carried over) and 5 make step 3
    const summary = await handle.result();
    expect(summary).toMatchObject({ steps: 3, stopped: false });
    expect(stepBatches(s)).toEqual([[0, 1], [2, 3], [4, 5]]); // no loss, no duplicate
    expect(s.trainCalls.map((c) => c.workflowRunId)).toEqual([firstRun, firstRun, secondRun]);
    // The first run's groups all finished before the second run started any.
    const lastDoneOfFirst = Math.max(...s.log.map((e, i) => (e.event === 'done' && e.workflowRunId === firstRun ? i : -1)));
    const firstStartOfSecond = s.log.findIndex((e) => e.event === 'start' && e.workflowRunId === secondRun);
    expect(lastDoneOfFirst).toBeLessThan(firstStartOfSecond);
    await waitFor('leftover groups cancelled', () => [6, 7].every((g) => s.cancelled.has(g)));
  });
});

test.each([
  ['drop', { stale: 2, empty: 0 }],
  ['mask', { stale: 0, empty: 0 }],
])('staleness mode %s', async (mode, dropped) => {
  const runId = `stale-${mode}`;
  const { s, activities } = fakeServices({ hold: () => true });
  await withWorkers(env, activities, async () => {
    const handle = await start(runId, makeConfig({ inflight: 3, groups: 2, steps: 2, algo: { max_staleness: 0 }, staleness_mode: mode }));
    await waitFor('pool full', () => s.running.size === 3);
    await release(s, runId, [0, 1]);
    await waitFor('step 1 refit', () => s.refits.length === 1);
    // Groups 2 and 3 were sampled at version 0, now 1 behind: stale for max_staleness 0.
    await release(s, runId, [2, 3]);
    if (mode === 'drop') { // 2 and 3 are dropped; the groups started after refit 1 are fresh
      await waitFor('fresh groups running', () => s.running.has(6));
      await release(s, runId, [5, 6]);
    }
    const summary = await handle.result();
    expect(summary.dropped).toEqual(dropped);
    expect(stepBatches(s)[1]).toEqual(mode === 'drop' ? [5, 6] : [2, 3]);
  });
});

test('each checkpoint tells the store what it may delete: the steps inside it but the kept ones, never a group a later step trains', async () => {
  const runId = 'gc';
  // Groups take 0-59 ms, so they arrive out of index order; every third has no episode (dropped).
  const { s, activities } = fakeServices({ rolloutMs: 0, empty: (g) => g % 3 === 2 });
  const slow = activities.rolloutGroup;
  activities.rolloutGroup = async (input) => { await Context.current().sleep((input.groupIndex * 37) % 60); return slow(input); };
  await withWorkers(env, activities, async () => {
    const handle = await start(runId, makeConfig({ inflight: 5, groups: 2, steps: 8, every: 2, store: { keep_steps: 1, keep_checkpoints: 3 } }));
    await handle.result();
  });
  const batches = stepBatches(s); // groups of step i + 1
  expect(s.checkpointInputs.map((c) => c.step)).toEqual([2, 4, 6, 8]);
  for (const c of s.checkpointInputs) {
    expect(c.gc).toMatchObject({ keepAfterStep: c.step - 1, keepCheckpoints: 3 });
    const later = batches.slice(c.step).flat(); // trained after this checkpoint: must survive it
    expect(Math.min(...later)).toBeGreaterThanOrEqual(c.gc!.liveFrom);
    expect(c.gc!.liveFrom).toBeGreaterThan(Math.min(...batches.slice(0, c.step).flat())); // and it lets go of trained ones
  }
});

test('a group with no finished episode is dropped, not trained', async () => {
  const runId = 'empty';
  const { s, activities } = fakeServices({ hold: () => true, empty: (g) => g === 0 });
  await withWorkers(env, activities, async () => {
    const handle = await start(runId, makeConfig({ inflight: 2, groups: 1, steps: 1 }));
    await waitFor('pool full', () => s.running.size === 2);
    await release(s, runId, [0]);
    await waitFor('group 0 dropped', async () => (await handle.query(progressQuery)).dropped.empty === 1);
    await release(s, runId, [1]);
    const summary = await handle.result();
    expect(summary.dropped).toEqual({ stale: 0, empty: 1 });
    expect(stepBatches(s)).toEqual([[1]]);
  });
});

test('a failed trainStep is retried with the same (runId, step); a failed group attempt is retried and trained once', async () => {
  const runId = 'retry';
  const { s, activities } = fakeServices({
    hold: () => true,
    failFirstAttempt: (g) => g === 1, // its first attempt fails after the rollout; the retry runs it again
    onTrainStep: async (input, attempt) => { if (input.step === 2 && attempt === 1) throw new Error('actor went away'); },
  });
  await withWorkers(env, activities, async () => {
    const handle: WorkflowHandle<typeof trainRun> = await start(runId, makeConfig({ inflight: 3, groups: 2, steps: 3 }));
    for (let step = 1; step <= 3; step++) {
      await waitFor('pool full', () => s.running.size === 3);
      await release(s, runId, lowestRunning(s, 2)); // waits out group 1's retry
      await waitFor(`step ${step}`, () => s.refits.length === step);
    }
    const summary = await handle.result();
    expect(summary.steps).toBe(3);
    expect(s.trainCalls.map((c) => [c.input.runId, c.input.step, c.attempt])).toEqual([
      [runId, 1, 1], [runId, 2, 1], [runId, 2, 2], [runId, 3, 1],
    ]);
    expect(s.trainCalls[2].input.groups).toEqual(s.trainCalls[1].input.groups);
    expect(s.refits).toEqual([1, 2, 3]);
    const trained = stepBatches(s).flat();
    expect(new Set(trained).size).toBe(trained.length);
    expect(s.attempts.get(1)).toBe(2);
    expect(stepBatches(s)[0]).toEqual([0, 1]);
  });
});

test.each([
  ['', undefined],
  [', the shards\' groups too', 1], // one group per workflow: 4, 5 and 6 each in its own (the run's, and two shards)
])('cancel stops gracefully: the current step finishes, a checkpoint is taken, in-flight groups are cancelled%s', async (_, groupsPerWorkflow) => {
  const runId = `cancel${groupsPerWorkflow ?? ''}`;
  let stopRequested = false;
  const { s, activities } = fakeServices({
    hold: (g) => g >= 4, // groups 0-3 make the first two batches; 4, 5, 6 are in flight when the stop comes
    onTrainStep: async (input) => { if (input.step === 2) while (!stopRequested) await Context.current().sleep(20); },
  });
  await withWorkers(env, activities, async () => {
    const handle = await start(runId, makeConfig({ inflight: 3, groups: 2, steps: 50, every: 10 }), { groupsPerWorkflow });
    await waitFor('step 2 training', () => s.trainCalls.length === 2);
    await waitFor('pool full', () => s.running.size === 3);
    await handle.cancel();
    await waitFor('stopping', async () => (await handle.query(progressQuery)).state === 'stopping');
    stopRequested = true;
    const summary = await handle.result();
    expect(summary).toMatchObject({ steps: 2, stopped: true, checkpoint: `/ckpt/${runId}/step-2` });
    expect(s.trainCalls.map((c) => c.input.step)).toEqual([1, 2]);
    expect(s.checkpoints).toEqual([2]);
    expect((await handle.describe()).status.name).toBe('COMPLETED');
    expect((await handle.query(progressQuery)).state).toBe('done');
    expect(stepBatches(s).flat().sort()).toEqual([0, 1, 2, 3]);
    await waitFor('in-flight groups cancelled', () => [4, 5, 6].every((g) => s.cancelled.has(g)));
    expect(s.log.some((e) => e.group === 7)).toBe(false); // no group started after the stop
  });
});

test.each([
  ['', undefined],
  [' (the group in a shard)', 1],
])('a group over the failure budget stops the run: the steps done are checkpointed, then the run fails naming the group%s', async (_, groupsPerWorkflow) => {
  const { s, activities } = fakeServices({ overBudget: (g) => g === 5 });
  const config = makeConfig({ inflight: 2, groups: 2, steps: 100 });
  const runId = `budget${groupsPerWorkflow ?? ''}`;
  await withWorkers(env, activities, async () => {
    const handle = await env.client.workflow.start(trainRun, {
      workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: '/r', config, groupsPerWorkflow }],
    });
    const err = await handle.result().then(() => null, (e) => e);
    expect(String(err?.cause?.message)).toMatch(new RegExp(`run ${runId} failed after \\d+ steps .*group 5: 2 of 2 episodes failed, over the failure budget`));
    expect(s.trainCalls.length).toBeGreaterThan(0);
    expect(s.checkpoints.at(-1)).toBe(s.trainCalls.at(-1)!.input.step); // nothing trained is lost
  });
});

// Workflows of the run's rollout shards (rollout-pool.ts), every execution of each.
async function shardExecutions(runId: string) {
  const runs = [];
  for await (const w of env.client.workflow.list({ query: `WorkflowType = 'rolloutShard'` })) {
    if (w.workflowId.startsWith(`${runWorkflowId(runId)}-shard-`)) runs.push(w);
  }
  return runs;
}

test('past groupsPerWorkflow the pool shards: no workflow holds more groups, shards continue as new on their own, every group is trained once', async () => {
  const runId = 'sharded';
  // Groups take 0-59 ms, so they arrive out of index order and shards report in batches.
  const { s, activities } = fakeServices({ rolloutMs: 0 });
  const slow = activities.rolloutGroup;
  activities.rolloutGroup = async (input) => { await Context.current().sleep((input.groupIndex * 37) % 60); return slow(input); };
  await withWorkers(env, activities, async () => {
    // 7 in flight, 2 per workflow: the run's own 2 and 3 shards; a shard's history is full after a few groups,
    // and the run continues as new (closing its shards) every 3 steps.
    const handle = await start(runId, makeConfig({ inflight: 7, groups: 3, steps: 9 }),
      { groupsPerWorkflow: 2, shardHistoryEvents: 30, continueAsNewAfterSteps: 3 });
    const groupsPending = (d: { raw: { pendingActivities?: { activityType?: { name?: string | null } | null }[] | null } }) =>
      (d.raw.pendingActivities ?? []).filter((a) => a.activityType?.name === 'rolloutGroup').length;
    let mostPending = 0;
    let sampled = 0;
    const sample = (async () => {
      for (;;) {
        const d = await handle.describe().catch(() => null);
        if (d === null || d.status.name !== 'RUNNING' && d.status.name !== 'CONTINUED_AS_NEW') return;
        const running = (await shardExecutions(runId)).filter((w) => w.status.name === 'RUNNING');
        const pending = await Promise.all(running.map((w) => env.client.workflow.getHandle(w.workflowId).describe()
          .then(groupsPending, () => 0)));
        mostPending = Math.max(mostPending, groupsPending(d), ...pending);
        sampled++;
        await new Promise((r) => setTimeout(r, 50));
      }
    })();
    const summary = await handle.result();
    await sample;
    expect(summary).toMatchObject({ steps: 9, stopped: false });
    expect(sampled).toBeGreaterThan(3);
    expect(mostPending).toBeLessThanOrEqual(2);
  });
  const trained = stepBatches(s).flat();
  expect(trained).toHaveLength(27);
  expect(new Set(trained).size).toBe(27); // no group trained twice
  const shards = await shardExecutions(runId);
  const shardRuns = new Set(shards.map((w) => w.runId));
  const ranInShards = s.log.filter((e) => e.event === 'start' && shardRuns.has(e.workflowRunId)).map((e) => e.group);
  expect(ranInShards.filter((g) => trained.includes(g)).length).toBeGreaterThan(9); // most groups ran in shards
  expect(new Set(shards.map((w) => w.workflowId)).size).toBeGreaterThanOrEqual(6); // 3 per execution of the run, 3 executions
  expect(shards.length).toBeGreaterThan(new Set(shards.map((w) => w.workflowId)).size); // some continued as new
  // All closed with the run (the server terminates a child of a closed run a moment after it closes).
  await waitFor('every shard closed', async () => (await shardExecutions(runId)).every((w) => w.status.name !== 'RUNNING'));
  // Every group started once (attempt 1) and finished: none lost across a shard's or the run's continue-as-new.
  expect([...s.attempts.values()].every((a) => a === 1)).toBe(true);
});
