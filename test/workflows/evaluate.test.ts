// Periodic evaluation in the loop, on a real Temporal dev server with instant fake activities:
// evaluate runs every eval.every steps without holding training up, and its figures land in that
// step's metrics line under eval/... keys.
import { Context } from '@temporalio/activity';
import type { TestWorkflowEnvironment } from '@temporalio/testing';
import type { EvaluateInput, EvaluateResult } from '../../activities/evaluate';
import type { RecordMetricsInput } from '../../activities/metrics';
import type { GroupResult, RolloutGroupInput, TrainStepInput } from '../../activities/types';
import { RecipeConfig } from '../../agents/recipe';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../../workflows/train-run';
import { startTemporal, withWorkers } from '../helpers/temporal';

let env: TestWorkflowEnvironment;
beforeAll(async () => { env = await startTemporal(); });
afterAll(async () => { await env?.teardown(); });

test('evaluate runs every eval.every steps, concurrently with training, and its figures join that step\'s metrics', async () => {
  const trained: number[] = [];
  const evaluated: EvaluateInput[] = [];
  const metrics: RecordMetricsInput[] = [];
  let trainedWhenStep2Evaluated = 0; // steps trained when the step-2 evaluation returned
  const activities = {
    async rolloutGroup(input: RolloutGroupInput): Promise<GroupResult> {
      await Context.current().sleep(10);
      return { groupIndex: input.groupIndex, episodes: [0], segments: [1], rewards: [0.5], failed: 0, tokens: 4, minVersion: 0, maxVersion: 0, seconds: 0.01 };
    },
    async trainStep(input: TrainStepInput) { trained.push(input.step); return { step: input.step, version: input.step, replayed: false, metrics: { loss: 0.5 } }; },
    async refit(input: { version: number }) { return { version: input.version, seconds: 0, bytes: 0 }; },
    async claimActor() { return { heldBy: null }; },
    async checkpoint(input: { runId: string; step: number }) { return { path: `/ckpt/step-${input.step}`, step: input.step }; },
    async recordMetrics(input: RecordMetricsInput) { metrics.push(input); return { written: true }; },
    async writeRunConfig() {},
    async evaluate(input: EvaluateInput): Promise<EvaluateResult> {
      evaluated.push(input);
      if (input.step === 2) { // held until training has reached step 4: a loop that waited for it would never finish
        while (trained.length < 4) await Context.current().sleep(10);
        trainedWhenStep2Evaluated = trained.length;
      }
      return {
        step: input.step, prompts: input.config.eval.prompts, samples: input.config.eval.samples, greedy_reward: input.step / 10,
        sample_reward_mean: 0.25, 'pass@1': 0.125, 'pass@n': 0.5, failed: 0, version_min: input.step, version_max: input.step,
      };
    },
  };
  const config = RecipeConfig.parse({
    name: 'eval', agent: 'agent.ts', model: 'tiny', group_size: 1, pool: { inflight: 2 }, batch: { groups: 1 }, train: { steps: 5 },
    checkpoint: { every: 100 }, sampling: { max_tokens: 4 }, algo: {}, eval: { every: 2, prompts: 3, samples: 4 },
  });
  await withWorkers(env, activities, async () => {
    const runId = 'eval-every';
    await env.client.workflow.execute(trainRun, { workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: '/tmp/recipe', config }] });
  });
  expect(evaluated.map((e) => e.step)).toEqual([2, 4]);
  expect(evaluated[0]).toMatchObject({ runId: 'eval-every', recipeDir: '/tmp/recipe', config: { eval: { every: 2, prompts: 3, samples: 4, greedy: true } } });
  expect(trainedWhenStep2Evaluated).toBeGreaterThanOrEqual(4); // the loop did not wait for the evaluation
  expect(metrics.map((m) => m.step)).toEqual([1, 2, 3, 4, 5]); // one line per step, in order
  for (const m of metrics) {
    const evalKeys = Object.keys(m.metrics).filter((k) => k.startsWith('eval/'));
    if (m.step % 2) { expect(evalKeys).toEqual([]); continue; }
    expect(m.metrics).toMatchObject({
      'eval/greedy_reward': m.step / 10, 'eval/sample_reward_mean': 0.25, 'eval/pass@1': 0.125, 'eval/pass@4': 0.5,
      'eval/prompts': 3, 'eval/version_min': m.step, 'rollout/reward_mean': 0.5, loss: 0.5,
    });
  }
}, 40_000);
