// The run's pool of prompt groups in flight, each one `rolloutGroup` activity. Temporal bounds the
// activities one workflow may have pending (2,000), and a workflow's every write grows dearer with
// the pending ones it holds (1,024 in flight ran at a fifth of 256's rate: bench/ item 4). So the
// run keeps up to `perWorkflow` groups as its own activities, and hands the rest to rollout shards:
// child workflows of the run, each keeping up to `perWorkflow` groups in flight and reporting their
// results to the run in batches, one signal for all the results that arrived while the last was
// on its way. A run of up to `perWorkflow` groups in flight (every recipe here) has no shard.
//
// A shard continues as new on its own when its history is full: it stops starting groups, lets the
// ones in flight finish, and carries the groups sent to it meanwhile. A group a shard runs is the
// same activity as the run's own (same id, heartbeats, retries), so a lost worker costs a shard
// what it costs the run: the activity is retried and resumes from its heartbeated manifest.
import {
  ActivityFailure, ApplicationFailure, allHandlersFinished, type CancellationScope, condition, continueAsNew, defineSignal,
  getExternalWorkflowHandle, isCancellation, log, proxyActivities, setHandler, startChild, workflowInfo,
} from '@temporalio/workflow';
import type { Activities } from '../activities';
import type { GroupResult } from '../activities/types';

export const TASK_QUEUES = { control: 'molt-control', rollout: 'molt-rollout', actor: 'molt-actor' } as const;
export const groupActivityId = (groupIndex: number) => `group-${groupIndex}`;
export const GROUPS_PER_WORKFLOW = 256;

// When a workflow continues as new. Not at the server's suggestion (4,096 events or 4 MB here): a step of the
// embedded recipe fills ~90 events and ~48 KB of history (16 groups x 3 activity events, ~10 workflow
// tasks, trainStep, refit, recordMetrics), so that came every ~45 steps, each time draining the pool.
// Instead, below Temporal's warning limits (10,240 events, 10 MB; the hard limits are 51,200 and 50 MB),
// with room for the drain: each group in flight adds its activity's events and a workflow task.
export const HISTORY_EVENTS = 10_000;
export const HISTORY_BYTES = 8 << 20;
export const DRAIN_EVENTS_PER_GROUP = 5;
// A shard's results reach the run in batches, a signal (and a workflow task) each: a draining shard's few
// batches. (Were each group's result a signal of its own, 10,000 groups would still be 4 events each, under
// the hard limit.)
export const DRAIN_EVENTS_PER_SHARD = 20;

export interface GroupStart { groupIndex: number; engines?: string[] }
export interface ShardInput {
  runId: string; runWorkflowId: string; groupSize: number; perWorkflow: number;
  queued: GroupStart[]; // sent to it, not started yet
  historyEvents?: number; // test hook: continue as new at this many history events (default HISTORY_EVENTS)
}
export const startGroupsSignal = defineSignal<[GroupStart[]]>('startGroups');
export const groupsDoneSignal = defineSignal<[GroupResult[]]>('groupsDone');
export const closeShardSignal = defineSignal('closeShard');
const RESULTS_PER_SIGNAL = 500; // ~0.5 KB each: well under Temporal's 2 MB per payload

// A lost worker shows as a missed heartbeat; the retry resumes from the heartbeated manifest.
// Agent errors are counted per episode inside the activity, so an activity failure is
// infrastructure: retry it until it works, unless it says it never will (non-retryable).
const FATAL_GROUP_FAILURES = ['FailureBudgetExceeded', 'AgentModuleError']; // these stop the run
const { rolloutGroup } = proxyActivities<Activities>({
  taskQueue: TASK_QUEUES.rollout,
  startToCloseTimeout: '2 hours',
  heartbeatTimeout: '60 seconds',
  retry: { initialInterval: '1 second', backoffCoefficient: 2, maximumInterval: '1 minute' },
});

// One prompt group: G episodes of the recipe's agent. Undefined when cancelled (the run has ended).
// A group that cannot run still frees its slot: it comes back empty. One whose agent failed more
// often than the recipe allows, or whose agent module does not load (every group would fail the
// same way, thousands a minute), comes back `fatal`: it stops the run.
async function runGroup(runId: string, groupSize: number, g: GroupStart): Promise<GroupResult | undefined> {
  try {
    return await rolloutGroup.executeWithOptions(
      { activityId: groupActivityId(g.groupIndex), summary: `group ${g.groupIndex}: ${groupSize} episodes` },
      [{ runId, groupIndex: g.groupIndex, engines: g.engines }]);
  } catch (err) {
    if (isCancellation(err)) return undefined;
    const cause = err instanceof ActivityFailure ? err.cause : err;
    log.error('rollout group failed for good', { groupIndex: g.groupIndex, error: String(cause) });
    const stopsRun = cause instanceof ApplicationFailure && FATAL_GROUP_FAILURES.includes(cause.type ?? '');
    return {
      groupIndex: g.groupIndex, episodes: [], segments: [], rewards: [], failed: groupSize, tokens: 0, minVersion: 0, maxVersion: 0, seconds: 0,
      ...(stopsRun ? { fatal: cause.message } : {}),
    };
  }
}

// The run's side. `start` runs the groups, up to `perWorkflow` of them in the run and the rest in
// shards (started as needed, kept until `close`); each result reaches `receive` once, in arrival
// order. `scope` is cancelled when the run ends: it cancels the groups, the shards' too.
export function rolloutPool(o: {
  runId: string; groupSize: number; perWorkflow: number; scope: CancellationScope;
  shardHistoryEvents?: number; receive: (result: GroupResult) => void; fail: (message: string) => void;
}) {
  const { runId, groupSize, perWorkflow } = o;
  let local = 0; // groups in flight as this run's own activities
  // `sent`: the signals to the shard so far, in order (the first is its start); `finished`: its end.
  const shards: { id: string; inflight: number; sent: Promise<void> | null; finished: Promise<void> }[] = [];
  const shardOf = new Map<number, number>(); // group in flight in a shard -> the shard
  const execution = workflowInfo().runId.slice(0, 8); // a run's earlier executions closed their shards
  const failed = (what: string) => (err: unknown) => { if (!isCancellation(err)) o.fail(`${what}: ${String(err)}`); };
  setHandler(groupsDoneSignal, (results) => {
    for (const r of results) {
      const k = shardOf.get(r.groupIndex);
      if (k === undefined) continue; // not expected: a signal arrives once
      shardOf.delete(r.groupIndex);
      shards[k].inflight--;
      o.receive(r);
    }
  });

  function start(groups: GroupStart[]): void {
    const toShard = new Map<number, GroupStart[]>(); // shard -> its groups of this call: one signal each
    for (const g of groups) {
      if (local < perWorkflow) {
        local++;
        void o.scope.run(() => runGroup(runId, groupSize, g)).then((r) => { local--; if (r) o.receive(r); });
        continue;
      }
      let k = shards.findIndex((s) => s.inflight < perWorkflow);
      if (k < 0) k = shards.push({ id: `${workflowInfo().workflowId}-shard-${execution}-${shards.length}`, inflight: 0, sent: null, finished: Promise.resolve() }) - 1;
      shards[k].inflight++;
      shardOf.set(g.groupIndex, k);
      if (!toShard.has(k)) toShard.set(k, []);
      toShard.get(k)!.push(g);
    }
    for (const [k, queued] of toShard) {
      const shard = shards[k];
      if (shard.sent === null) { // a new shard: its first groups are its input
        const child = o.scope.run(() => startChild(rolloutShard, {
          workflowId: shard.id, taskQueue: TASK_QUEUES.control,
          args: [{ runId, runWorkflowId: workflowInfo().workflowId, groupSize, perWorkflow, queued, historyEvents: o.shardHistoryEvents }],
        }));
        shard.finished = child.then((c) => c.result()).catch(failed(`rollout shard ${shard.id}`));
        shard.sent = child.then(() => undefined);
      } else {
        shard.sent = shard.sent.then(() => o.scope.run(() => getExternalWorkflowHandle(shard.id).signal(startGroupsSignal, queued)));
      }
      shard.sent = shard.sent.catch(failed(`groups to rollout shard ${shard.id}`));
    }
  }

  // Once nothing is in flight (the run drains before continue-as-new): the shards finish.
  async function close(): Promise<void> {
    await Promise.all(shards.map(async (s) => {
      await s.sent;
      await getExternalWorkflowHandle(s.id).signal(closeShardSignal);
      await s.finished;
    }));
  }
  return { start, close };
}

// A shard: keeps the groups the run sends it in flight and sends their results back in batches.
export async function rolloutShard(input: ShardInput): Promise<void> {
  const { runId, groupSize, perWorkflow } = input;
  const queued = [...input.queued];
  const done: GroupResult[] = [];
  let inflight = 0;
  let closing = false;
  setHandler(startGroupsSignal, (groups) => { queued.push(...groups); });
  setHandler(closeShardSignal, () => { closing = true; });
  const run = getExternalWorkflowHandle(input.runWorkflowId);
  let reporting = false;
  let orphaned = false; // the run is gone (terminated): nobody wants the results
  const reporter = (async () => {
    for (;;) {
      await condition(() => done.length > 0 || (closing && inflight === 0));
      if (done.length === 0) return;
      reporting = true;
      try {
        await run.signal(groupsDoneSignal, done.splice(0, RESULTS_PER_SIGNAL));
      } catch (err) { // the only way a signal fails: its target is not running
        log.warn('the run is gone: the rollout shard stops', { run: input.runWorkflowId, error: String(err) });
        orphaned = true;
        return;
      }
      reporting = false;
    }
  })();
  const historyFull = () => {
    const info = workflowInfo();
    return info.historyLength + DRAIN_EVENTS_PER_GROUP * perWorkflow >= (input.historyEvents ?? HISTORY_EVENTS) || info.historySize >= HISTORY_BYTES;
  };
  for (;;) {
    await condition(() => orphaned || (queued.length > 0 && !historyFull()) || (inflight === 0 && (closing || historyFull())));
    if (orphaned) return;
    if (queued.length > 0 && !historyFull()) {
      for (const g of queued.splice(0)) {
        inflight++;
        void runGroup(runId, groupSize, g).then((r) => { inflight--; if (r) done.push(r); });
      }
      continue;
    }
    if (closing) { await reporter; return; }
    // History full, nothing in flight: report what is left, then go on as new with what is queued.
    await condition(() => done.length === 0 && !reporting);
    await condition(allHandlersFinished);
    return continueAsNew<typeof rolloutShard>({ ...input, queued });
  }
}
