// `molt-client schedule ...` as a user runs it, against a real Temporal dev server with a worker
// in this process whose activities finish instantly.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type { TestWorkflowEnvironment } from '@temporalio/testing';
import type { GroupResult, RolloutGroupInput, TrainStepInput } from '../../activities/types';
import { startTemporal, withWorkers } from '../helpers/temporal';
import { runCli } from '../helpers/cli';

let env: TestWorkflowEnvironment;
let recipeDir: string;
beforeAll(async () => {
  env = await startTemporal();
  recipeDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-schedule-'));
  fs.writeFileSync(path.join(recipeDir, 'recipe.json'), JSON.stringify({
    name: 'sched', agent: 'agent.ts', model: 'tiny', group_size: 2, pool: { inflight: 2 }, batch: { groups: 1 },
    train: { steps: 50 }, checkpoint: { every: 10 }, sampling: { max_tokens: 4 }, algo: { lr: 1e-5 },
  }));
});
afterAll(async () => {
  await env?.teardown();
  fs.rmSync(recipeDir, { recursive: true, force: true });
});

const cli = (...args: string[]) => runCli(args, { MOLT_TEMPORAL_ADDRESS: env.address });

const activities = {
  async rolloutGroup(input: RolloutGroupInput): Promise<GroupResult> {
    return { groupIndex: input.groupIndex, episodes: [0], segments: [1], rewards: [1], failed: 0, tokens: 4, minVersion: 0, maxVersion: 0, seconds: 0 };
  },
  async trainStep(input: TrainStepInput) { return { step: input.step, version: input.step, replayed: false, metrics: { loss: 0.25 } }; },
  async refit(input: { version: number }) { return { version: input.version, seconds: 0, bytes: 0 }; },
  async claimActor() { return { heldBy: null }; },
  async checkpoint(input: { step: number }) { return { path: `/ckpt/step-${input.step}`, step: input.step }; },
  async recordMetrics() { return { written: true }; },
  async writeRunConfig() {},
};

test('schedule: create with an overlap policy, trigger starts a run, describe lists it, pause and delete', async () => {
  await withWorkers(env, activities, async () => {
    const bad = await cli('schedule', 'create', 'nightly', recipeDir, '--cron', '0 2 * * *', '--overlap', 'sometimes');
    expect(bad.code).toBe(2);
    expect(bad.stderr).toContain('--overlap: "sometimes" is not a policy');
    const neither = await cli('schedule', 'create', 'nightly', recipeDir);
    expect(neither.stderr).toContain('give exactly one of --cron');
    const created = await cli('schedule', 'create', 'nightly', recipeDir, '--cron', '0 2 * * *', '--overlap', 'buffer_one', '--train.steps', '2');
    expect(created.stdout).toContain('schedule nightly created: cron "0 2 * * *", overlap buffer_one');
    expect((await cli('schedule', 'trigger', 'nightly')).code).toBe(0);
    let runId = '';
    for (let i = 0; i < 500 && !runId; i++) {
      const d = await env.client.schedule.getHandle('nightly').describe();
      const action = d.info.recentActions[0]?.action;
      if (action?.type === 'startWorkflow') runId = action.workflow.workflowId;
      else await new Promise((r) => setTimeout(r, 20));
    }
    expect(runId).toMatch(/^molt-nightly-/);
    const summary = await env.client.workflow.getHandle(runId).result();
    expect(summary).toMatchObject({ runId: runId.slice('molt-'.length), steps: 2 }); // the run is named by its workflow id
    const described = await cli('schedule', 'describe', 'nightly');
    expect(described.stdout).toContain('overlap buffer_one');
    expect(described.stdout).toContain(`-> ${runId}`);
    expect((await cli('schedule', 'list')).stdout).toMatch(/^nightly\tACTIVE\tcron "0 2 \* \* \*"/m);
    await cli('schedule', 'pause', 'nightly', '--note', 'maintenance');
    expect((await cli('schedule', 'describe', 'nightly')).stdout).toContain('PAUSED (maintenance)');
    expect((await cli('schedule', 'delete', 'nightly')).code).toBe(0);
    expect((await cli('schedule', 'describe', 'nightly')).code).toBe(1);
  });
});
