// How often the loop continues as new: at its own limit below Temporal's warning limits, not at the
// server's early suggestion. Here the server suggests it after 100 events; a run of 30 small steps
// (~600 events) stays one execution.
import { Context } from '@temporalio/activity';
import type { TestWorkflowEnvironment } from '@temporalio/testing';
import type { GroupResult, RolloutGroupInput, TrainStepInput } from '../../activities/types';
import { RecipeConfig } from '../../agents/recipe';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../../workflows/train-run';
import { startTemporal, withWorkers } from '../helpers/temporal';

let env: TestWorkflowEnvironment;
beforeAll(async () => { env = await startTemporal({ dynamicConfig: { 'limit.historyCount.suggestContinueAsNew': 100 } }); });
afterAll(async () => { await env?.teardown(); });

const activities = {
  async rolloutGroup(input: RolloutGroupInput): Promise<GroupResult> {
    await Context.current().sleep(5);
    return { groupIndex: input.groupIndex, episodes: [0], segments: [1], rewards: [1], failed: 0, tokens: 4, minVersion: 0, maxVersion: 0, seconds: 0 };
  },
  async trainStep(input: TrainStepInput) { return { step: input.step, version: input.step, replayed: false, metrics: {} }; },
  async refit(input: { version: number }) { return { version: input.version, seconds: 0, bytes: 0 }; },
  async claimActor() { return { heldBy: null }; },
  async checkpoint(input: { step: number }) { return { path: `/ckpt/step-${input.step}`, step: input.step }; },
  async recordMetrics() { return { written: true }; },
  async writeRunConfig() {},
};

test('the run continues as new near Temporal\'s warning limits, not at the server\'s early suggestion', async () => {
  const config = RecipeConfig.parse({
    name: 'history', agent: 'agent.ts', model: 'tiny', group_size: 1, pool: { inflight: 2 }, batch: { groups: 1 },
    train: { steps: 30 }, checkpoint: { every: 100 }, sampling: { max_tokens: 4 }, algo: {},
  });
  await withWorkers(env, activities, async () => {
    const handle = await env.client.workflow.start(trainRun, {
      workflowId: runWorkflowId('history'), taskQueue: TASK_QUEUES.control, args: [{ runId: 'history', recipeDir: '/tmp/recipe', config }],
    });
    expect((await handle.result()).steps).toBe(30);
    const { historyLength, runId } = await env.client.workflow.getHandle(handle.workflowId).describe(); // the latest execution
    expect(historyLength).toBeGreaterThan(300); // the server suggested continue-as-new long before
    expect(runId).toBe(handle.firstExecutionRunId); // one execution
  });
}, 300_000);
