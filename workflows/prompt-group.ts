// One prompt group: G episodes of the recipe's agent, run by one activity on the rollout queue.
// The result goes to the run by workflow id, so it reaches whichever run of the chain is current.
import { ActivityFailure, ApplicationFailure, getExternalWorkflowHandle, isCancellation, log, proxyActivities } from '@temporalio/workflow';
import type { Activities } from '../activities';
import type { GroupResult, RolloutGroupInput } from '../activities/types';
import { groupDone, runWorkflowId, TASK_QUEUES } from './train-run';

// A lost worker shows as a missed heartbeat; the retry resumes from the heartbeated manifest.
// Agent errors are counted per episode inside the activity, so an activity failure is
// infrastructure: retry it until it works, unless it says it never will (non-retryable).
const { rolloutGroup } = proxyActivities<Activities>({
  taskQueue: TASK_QUEUES.rollout,
  startToCloseTimeout: '2 hours',
  heartbeatTimeout: '60 seconds',
  retry: { initialInterval: '1 second', backoffCoefficient: 2, maximumInterval: '1 minute' },
});

export async function promptGroup(input: RolloutGroupInput): Promise<GroupResult> {
  let result: GroupResult;
  try {
    result = await rolloutGroup.executeWithOptions({ summary: `${input.config.group_size} episodes of group ${input.groupIndex}` }, [input]);
  } catch (err) {
    if (isCancellation(err) || !(err instanceof ActivityFailure)) throw err;
    // A group that cannot run still frees its slot: the run drops it as empty. One whose agent
    // failed more often than the recipe allows also tells the run to stop.
    log.error('rollout group failed for good', { groupIndex: input.groupIndex, error: String(err.cause ?? err) });
    const overBudget = err.cause instanceof ApplicationFailure && err.cause.type === 'FailureBudgetExceeded';
    result = {
      groupIndex: input.groupIndex, refs: [], rewards: [], failed: input.config.group_size, tokens: 0, minVersion: 0, maxVersion: 0, seconds: 0,
      ...(overBudget ? { fatal: err.cause.message } : {}),
    };
  }
  try {
    await getExternalWorkflowHandle(runWorkflowId(input.runId)).signal(groupDone, result);
  } catch (err) {
    if (isCancellation(err)) throw err;
    log.warn('run is closed; group result not delivered', { groupIndex: input.groupIndex }); // the run ended before this group
  }
  return result;
}
