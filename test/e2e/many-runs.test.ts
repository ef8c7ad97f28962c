// Many runs on one stack (real Temporal dev server, engine, FSDP2 actor, workers), as a user makes
// them with molt-client: two runs started together, then a schedule that fires three times. The
// actor and the engines serve one run at a time: the other run waits, visibly, and then trains
// from its own initial weights (the engines sample from it, not from the run before).
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { readMetrics } from '../../activities/metrics';
import { REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { startStack, type Stack } from '../../infra/stack';
import { progressQuery, runWorkflowId, type TrainRunSummary } from '../../workflows/train-run';
import { runCli } from '../helpers/cli';

const RECIPE = path.join(REPO_ROOT, 'recipes', 'copy');
// Small steps; lr high enough that three steps move the policy far from the initial weights.
const SMALL = ['--train.steps', '3', '--checkpoint.every', '2', '--batch.groups', '2', '--pool.inflight', '3', '--group_size', '4',
  '--algo.lr', '0.01'];

let stack: Stack;
let client: Client;
let stateDir: string;
const cli = (...args: string[]) => runCli(args, { MOLT_TEMPORAL_ADDRESS: stack.temporalAddress });

async function startLocalStack() {
  stack = await startStack({ modelDir: resolveModelDir('tiny'), stateDir, quiet: true, endLeftoverRuns: true });
  client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
}
beforeAll(async () => {
  stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-runs-'));
  await startLocalStack();
});
afterAll(async () => {
  await client?.connection.close();
  await stack?.stop();
});

// Polls every half second (the CPUs are shared; the runs need them more than the test).
async function until(what: string, check: () => Promise<boolean>, timeoutMs = 600_000): Promise<void> {
  for (const deadline = Date.now() + timeoutMs; !(await check());) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await new Promise((r) => setTimeout(r, 500));
  }
}

// Step 1 of a run trains on tokens the engines sampled from this run's initial weights: the actor
// (back at the initial weights) computes the same logprobs for them.
async function expectStepsOnce(runId: string, steps: number) {
  const lines = await readMetrics(stack.storeRoot, runId);
  expect(lines.map((l) => l.step)).toEqual(Array.from({ length: steps }, (_, i) => i + 1));
  expect(lines[0].rollout_logp_max_abs_diff).toBeLessThan(1e-3);
}

test('two runs started together: one waits for the actor, then both train every step once', async () => {
  const [a, b] = await Promise.all(['first', 'second'].map((id) => cli('start', RECIPE, '--run-id', id, ...SMALL)));
  expect(a.code).toBe(0);
  expect(b.code).toBe(0);
  const waits = new Set<string>();
  const handles = ['first', 'second'].map((id) => client.workflow.getHandle(runWorkflowId(id)));
  const results: TrainRunSummary[] = [];
  const done = Promise.all(handles.map((h) => h.result())).then((r) => results.push(...r));
  await until('both runs done', async () => {
    for (const [i, h] of handles.entries()) {
      const p = await h.query(progressQuery).catch(() => null);
      if (p?.waitingFor) waits.add(`${['first', 'second'][i]} waits for ${p.waitingFor}`);
    }
    return results.length === 2;
  });
  await done;
  expect([...waits].length).toBe(1); // one of them waited for the other
  expect([...waits][0]).toMatch(/^(first waits for second|second waits for first)$/);
  expect(results.map((r) => r.steps)).toEqual([3, 3]);
  await expectStepsOnce('first', 3);
  await expectStepsOnce('second', 3);
  const status = await cli('status', 'second');
  expect(status.stdout).toContain('COMPLETED');
}, 900_000);

test('a schedule fires again and again: three firings, each run trains', async () => {
  const created = await cli('schedule', 'create', 'thrice', RECIPE, '--every', '2s', '--overlap', 'skip', ...SMALL);
  expect(created.code).toBe(0);
  const completed = async () => {
    const ids: string[] = [];
    for await (const w of client.workflow.list({ query: `ExecutionStatus = 'Completed'` })) ids.push(w.workflowId);
    return ids.filter((id) => id.startsWith('molt-thrice-')).sort();
  };
  await until('three firings completed', async () => (await completed()).length >= 3);
  expect((await cli('schedule', 'delete', 'thrice')).code).toBe(0);
  for (const workflowId of (await completed()).slice(0, 3)) {
    expect(await client.workflow.getHandle(workflowId).result()).toMatchObject({ steps: 3, stopped: false });
    await expectStepsOnce(workflowId.replace(/^molt-/, ''), 3);
  }
}, 900_000);

test('a schedule with --continue-from-schedule: each firing starts from the previous firing\'s last checkpoint', async () => {
  const created = await cli('schedule', 'create', 'lineage', RECIPE, '--every', '2s', '--continue-from-schedule', ...SMALL);
  expect(created.code).toBe(0);
  expect((await cli('schedule', 'describe', 'lineage')).stdout).toContain('from the previous one\'s latest checkpoint');
  const completed = async () => {
    const ids: string[] = [];
    for await (const w of client.workflow.list({ query: `ExecutionStatus = 'Completed'` })) ids.push(w.workflowId);
    return ids.filter((id) => id.startsWith('molt-lineage-')).sort();
  };
  await until('two firings completed', async () => (await completed()).length >= 2);
  expect((await cli('schedule', 'delete', 'lineage')).code).toBe(0);
  const [first, second] = (await completed()).slice(0, 2).map((id) => id.replace(/^molt-/, ''));
  const firstSummary = await client.workflow.getHandle(runWorkflowId(first)).result();
  expect(fs.existsSync(path.join(stack.storeRoot, first, 'init'))).toBe(false); // the first firing starts from the model
  expect(fs.readFileSync(path.join(stack.storeRoot, second, 'init'), 'utf8')).toBe(firstSummary.checkpoint);
  // The actor and the engines both start the second firing from that checkpoint: step 1's logprobs agree.
  await expectStepsOnce(second, 3);
}, 900_000);

test('a run an earlier stack left is terminated when the next stack starts, and resume continues it: every step once', async () => {
  const steps = ['--train.steps', '6', '--checkpoint.every', '2'];
  expect((await cli('start', RECIPE, '--run-id', 'left', ...SMALL, ...steps)).code).toBe(0);
  const handle = () => client.workflow.getHandle(runWorkflowId('left'));
  await until('step 3 trained', async () => ((await handle().query(progressQuery).catch(() => null))?.step ?? 0) >= 3);
  await client.connection.close();
  await stack.stop(); // as a Ctrl-C'd dev does
  await startLocalStack();
  expect((await handle().describe()).status.name).toBe('TERMINATED');
  const resumed = await cli('resume', 'left');
  expect(resumed.stdout).toContain('run left resumed (it was TERMINATED)');
  const summary = await handle().result();
  expect(summary).toMatchObject({ steps: 6, stopped: false });
  // The final checkpoint's step log (the steps inside its weights): each of the 6 steps once.
  const log = fs.readFileSync(path.join(summary.checkpoint!, 'steps.jsonl'), 'utf8').trim().split('\n').map((l) => JSON.parse(l));
  expect(log.map((e) => `${e.run_id}:${e.step}`)).toEqual([1, 2, 3, 4, 5, 6].map((n) => `left:${n}`));
}, 900_000);
