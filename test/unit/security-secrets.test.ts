// The run's bearer token on the real local stack (Temporal dev server, engine, actor, worker, each a
// process started by infra/stack.ts): every engine and actor route refuses a request without it,
// and after a one-step run the token appears in no workflow history (payloads decoded), no process
// log and no command line. The worker and the services read it from their environment (MOLT_TOKEN);
// the workflow inputs carry only references.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { loadRecipe, REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { startStack, type Stack } from '../../infra/stack';
import { runWorkflowId, TASK_QUEUES, trainRun } from '../../workflows/train-run';
import { tinyModel } from './gpu-services';

const RECIPE_DIR = path.join(REPO_ROOT, 'recipes', 'copy');
let stack: Stack;
let client: Client;

beforeAll(async () => {
  tinyModel();
  delete process.env.MOLT_TOKEN; // the stack makes a random one, as a fresh run would
  stack = await startStack({ modelDir: resolveModelDir('tiny'), stateDir: fs.mkdtempSync(path.join(os.tmpdir(), 'molt-secrets-')), engines: 1, quiet: true });
  client = new Client({ connection: await Connection.connect({ address: stack.temporalAddress }) });
}, 300_000);
afterAll(async () => {
  await client?.connection.close();
  await stack?.stop();
  if (stack) fs.rmSync(stack.stateDir, { recursive: true, force: true });
});

test('every engine and actor route requires the bearer token', async () => {
  const routes = [
    ...['GET /health', 'POST /generate', 'POST /pause', 'POST /resume', 'POST /abort', 'POST /weights/receive', 'POST /weights/load']
      .map((r) => [stack.engines[0], r]),
    ...['GET /health', 'POST /train_step', 'POST /logprobs', 'POST /push_weights', 'POST /checkpoint/save', 'POST /checkpoint/load']
      .map((r) => [stack.actor, r]),
  ];
  for (const [base, route] of routes) {
    const [method, p] = route.split(' ');
    for (const authorization of [undefined, 'Bearer wrong', `Bearer ${stack.token}x`, stack.token]) {
      const res = await fetch(base + p, {
        method, headers: { 'content-type': 'application/json', ...(authorization ? { authorization } : {}) },
        body: method === 'POST' ? '{}' : undefined,
      });
      expect([route, authorization, res.status]).toEqual([route, authorization, 401]);
    }
  }
  const ok = await fetch(`${stack.engines[0]}/health`, { headers: { authorization: `Bearer ${stack.token}` } });
  expect(ok.status).toBe(200);
});

// Every payload in a history, decoded to text, plus the rest of the event as JSON.
function historyText(value: unknown): string {
  if (value instanceof Uint8Array) return Buffer.from(value).toString('utf8');
  if (Array.isArray(value)) return value.map(historyText).join('\n');
  if (value && typeof value === 'object') return Object.entries(value).map(([k, v]) => `${k}: ${historyText(v)}`).join('\n');
  return String(value);
}

test('after a run the token is in no workflow history, log or command line', async () => {
  const runId = `secrets-${Date.now()}`;
  const config = loadRecipe(RECIPE_DIR, { 'train.steps': '1', 'batch.groups': '1', 'pool.inflight': '1', group_size: '2', 'checkpoint.every': '1' });
  const handle = await client.workflow.start(trainRun, {
    workflowId: runWorkflowId(runId), taskQueue: TASK_QUEUES.control, args: [{ runId, recipeDir: RECIPE_DIR, config }],
  });
  expect((await handle.result()).steps).toBe(1);

  let histories = '';
  let workflows = 0;
  for await (const w of client.workflow.list()) {
    histories += historyText(await client.workflow.getHandle(w.workflowId, w.runId).fetchHistory());
    workflows++;
  }
  expect(workflows).toBe(1); // the run: its prompt groups are activities in its history
  // The payloads were decoded: what the activities were given is readable here.
  for (const expected of ['"recipeDir"', 'rolloutGroup', 'trainStep', `"runId":"${runId}"`, '"episodes":[', '"groups":[{"groupIndex":']) expect(histories).toContain(expected);
  expect(histories).not.toContain(stack.token);

  const logDir = path.join(stack.stateDir, 'logs');
  const logs = fs.readdirSync(logDir).map((f) => [f, fs.readFileSync(path.join(logDir, f), 'utf8')]);
  expect(logs.map(([f]) => f)).toEqual(expect.arrayContaining(['actor.log', 'engine-0.log', 'temporal.log']));
  for (const [file, text] of logs) expect([file, text.includes(stack.token)]).toEqual([file, false]);

  for (const [name, proc] of stack.processes) {
    const cmdline = fs.readFileSync(`/proc/${proc.pid}/cmdline`, 'utf8').replace(/\0/g, ' ');
    expect([name, cmdline.includes(stack.token)]).toEqual([name, false]);
  }
}, 300_000);
