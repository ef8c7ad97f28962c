// Hosts apart, for real: a cluster of network namespaces on a bridge (test/cluster/netns.ts), each
// host with its own address. Temporal on one host, the control+actor worker on another, two rollout
// workers on two more, two engines on two "GPU hosts", and the actor as torchrun multi-node (2 nodes
// x 1 rank, gloo, a static rendezvous across hosts). The client runs on the login node (the bridge's
// address). A recipe run completes with every refit crossing hosts; nothing listens on every
// interface unless configured (torch's rendezvous store, which offers no choice, is the one named
// exception), nothing on 127.0.0.1 but the agents' loopback servers of the rollout workers, and every
// service wants its bearer token. `npm run test:cluster` (infra/test-cluster.sh); needs root.
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { Client, Connection } from '@temporalio/client';
import { resolveModelDir } from '../../agents/recipe';
import { SEARCH_ATTRIBUTES } from '../../infra/stack';
import { runWorkflowId } from '../../workflows/train-run';
import { runCli } from '../helpers/cli';
import { cleanup, type Host, listeners, LOGIN_IP, makeHosts, Processes, waitUntil } from './netns';

const STEPS = 4;
const RECIPE = ['--train.steps', String(STEPS), '--batch.groups', '2', '--group_size', '4', '--pool.inflight', '4',
  '--checkpoint.every', String(STEPS)];
const PY = path.resolve('.venv/bin/python');
const TSX = path.resolve('node_modules/.bin/tsx');
const token = randomBytes(16).toString('hex');
const stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-cluster-'));
const storeRoot = path.join(stateDir, 'runs'); // one folder all hosts see, as a shared filesystem would be
const procs = new Processes(path.join(stateDir, 'logs'));
const clientEnv = { TEMPORAL_CONFIG_FILE: path.join(stateDir, 'temporal.toml'), TEMPORAL_PROFILE: 'cluster' };
let hosts: Record<string, Host>;
let temporal: string;
let engines: string[]; // the workers' engines
let spare: string;
let actor: string;
const auth = { headers: { authorization: `Bearer ${token}` } };
const health = async (url: string) =>
  (await fetch(`${url}/health`, { ...auth, signal: AbortSignal.timeout(5_000) })).json() as Promise<{ version: number; world_size?: number }>;

beforeAll(async () => {
  cleanup(); // what a crashed run of this test left
  const names = ['temporal', 'control', 'rollout-0', 'rollout-1', 'engine-0', 'engine-1', 'engine-2', 'actor-0', 'actor-1'];
  hosts = Object.fromEntries(makeHosts(names).map((h) => [h.name, h]));
  const model = resolveModelDir('tiny');
  const env = { MOLT_TOKEN: token };

  // The dev server's own services dial each other at 127.0.0.1 whatever --ip says (temporal CLI 1.9.1:
  // with --ip 10.x it never becomes ready), so on its host it listens on loopback, and a TCP relay
  // serves it on the host's address. A production Temporal cluster has no such limit.
  temporal = `${hosts.temporal.ip}:7233`;
  procs.start(hosts.temporal, 'temporal', path.resolve('.venv/bin/temporal'), ['server', 'start-dev', '--ip', '127.0.0.1',
    '--port', '7233', '--http-port', '7243', '--metrics-port', '7244', '--headless', '--log-level', 'warn',
    '--db-filename', path.join(stateDir, 'temporal.db'), ...SEARCH_ATTRIBUTES.flatMap((a) => ['--search-attribute', a]),
    '--dynamic-config-value', 'matching.numTaskqueueReadPartitions=1', '--dynamic-config-value', 'matching.numTaskqueueWritePartitions=1']);
  procs.start(hosts.temporal, 'temporal-relay', process.execPath, ['-e', `require('net').createServer((c) => {
    const s = require('net').connect(7233, '127.0.0.1'); c.pipe(s).pipe(c); c.on('error', () => s.destroy()); s.on('error', () => c.destroy());
  }).listen(7233, '${hosts.temporal.ip}')`]);
  // engine-2 serves no run at first: the elastic test adds it to a running one.
  const all = ['engine-0', 'engine-1', 'engine-2'].map((name) => {
    procs.start(hosts[name], name, PY, ['gpu-services/engine.py', '--model', model, '--host', hosts[name].ip, '--port', '8100',
      '--name', name], env);
    return `http://${hosts[name].ip}:8100`;
  });
  engines = all.slice(0, 2);
  spare = all[2];
  actor = `http://${hosts['actor-0'].ip}:8200`;
  for (const [rank, name] of ['actor-0', 'actor-1'].entries()) {
    procs.start(hosts[name], name, PY, ['-m', 'torch.distributed.run', '--nnodes=2', '--nproc-per-node=1', `--node-rank=${rank}`,
      `--master-addr=${hosts['actor-0'].ip}`, '--master-port=29500', 'gpu-services/actor.py', '--model', model,
      '--host', hosts[name].ip, '--port', '8200', '--state-dir', path.join(stateDir, 'actor')], env);
  }
  await Promise.all([...all, actor].map((url) => waitUntil(`${url} healthy`, async () => (await health(url)).version === 0, 600_000)));

  // Configured as on a real cluster: Temporal from its environment variables, the services from one
  // placement file (the token in a file beside it), the client from a Temporal TOML profile.
  const placement = path.join(stateDir, 'placement.json');
  fs.writeFileSync(path.join(stateDir, 'token'), token);
  fs.writeFileSync(placement, JSON.stringify({ engines, actor, store: 'runs', token_file: 'token' }));
  fs.writeFileSync(clientEnv.TEMPORAL_CONFIG_FILE, `[profile.cluster]\naddress = "${temporal}"\n`);
  const workerEnv = (queues: string) => ({ TEMPORAL_ADDRESS: temporal, MOLT_QUEUES: queues, MOLT_PLACEMENT: placement });
  procs.start(hosts.control, 'control', TSX, ['infra/worker.ts'], workerEnv('control,actor'));
  for (const name of ['rollout-0', 'rollout-1']) procs.start(hosts[name], name, TSX, ['infra/worker.ts'], workerEnv('rollout'));
  await Promise.all(['control', 'rollout-0', 'rollout-1'].map((name) =>
    waitUntil(`${name} worker ready`, () => fs.readFileSync(procs.log(name), 'utf8').includes('worker ready'), 600_000)));
}, 1_200_000);

afterAll(async () => {
  await procs.stopAll();
  cleanup();
  console.log(`cluster logs: ${procs.log('*')}`);
});

const metrics = (runId: string) => {
  const file = path.join(storeRoot, runId, 'metrics.jsonl');
  return fs.existsSync(file) ? fs.readFileSync(file, 'utf8').trim().split('\n').filter(Boolean).map((l) => JSON.parse(l)) : [];
};
const mean = (xs: number[]) => xs.reduce((a, b) => a + b, 0) / xs.length;

test('a recipe run completes across hosts; refits cross hosts; bind addresses and tokens hold', async () => {
  const runId = `cluster-${Date.now()}`;
  const run = runCli(['start', 'recipes/copy', '--run-id', runId, ...RECIPE, '--follow'], clientEnv);

  // Who listens where, sampled on every host until the run ends (a weight push's store lives for
  // a second, an episode's loopback server for less).
  const seen = new Map<string, { host: Host; addr: string; port: number; command: string }>();
  let running = true;
  const sampler = (async () => {
    while (running) {
      for (const host of Object.values(hosts)) {
        for (const l of listeners(host)) seen.set(`${host.name} ${l.command} ${l.addr}:${l.port}`, { host, ...l });
      }
      await new Promise((r) => setTimeout(r, 100));
    }
  })();
  await waitUntil('the first step', () => metrics(runId).length >= 1, 900_000);
  // Every service wants its token, from any host.
  for (const url of [...engines, actor]) {
    expect((await fetch(`${url}/health`)).status).toBe(401);
    expect((await fetch(`${url}/health`, { headers: { authorization: 'Bearer wrong' } })).status).toBe(401);
  }

  const result = await run;
  running = false;
  await sampler;
  expect(result.stderr + result.stdout).toContain(`run ${runId} finished after ${STEPS} steps`);
  expect(result.code).toBe(0);
  const wildcard = new Set(['0.0.0.0', '*', '[::]', '::']);
  for (const [where, { host, addr, port, command }] of seen) {
    if (wildcard.has(addr)) {
      // torchrun's rendezvous store (torch's TCPStore binds every interface; torchrun has no option)
      expect([where, host.name, port]).toEqual([where, 'actor-0', 29500]);
    } else if (addr.startsWith('127.') || addr === '[::1]') {
      // the agents' loopback servers; the dev server (see above)
      expect([where, host.name.startsWith('rollout-') || command === 'temporal']).toEqual([where, true]);
    } else {
      expect([where, addr]).toEqual([where, host.ip]);
    }
  }
  // The actor trained on two hosts; the engines, on two others, hold the last step's weights.
  expect((await health(actor)).world_size).toBe(2);
  for (const url of engines) expect((await health(url)).version).toBe(STEPS);
  const lines = metrics(runId);
  expect(lines.map((m) => m.step)).toEqual(Array.from({ length: STEPS }, (_, i) => i + 1));
  for (const m of lines) expect(m['time/refit_transfer']).toBeGreaterThan(0);

  // The groups ran on the rollout hosts (identities are pid@hostname; Temporal hands a task to any
  // poller, so which of the two rollout workers took how many is not fixed).
  const connection = await Connection.connect({ address: temporal });
  const workers = new Map<string, Set<string>>(); // activity type -> identities
  try {
    const client = new Client({ connection });
    for await (const r of client.workflow.list({ query: `WorkflowId = '${runWorkflowId(runId)}'` })) {
      const types = new Map<string, string>();
      for (const event of (await client.workflow.getHandle(r.workflowId, r.runId).fetchHistory()).events ?? []) {
        const type = event.activityTaskScheduledEventAttributes?.activityType?.name;
        if (type) types.set(String(event.eventId), type);
        const started = event.activityTaskStartedEventAttributes;
        if (started) {
          const of = types.get(String(started.scheduledEventId))!;
          workers.set(of, (workers.get(of) ?? new Set()).add(started.identity!));
        }
      }
    }
  } finally {
    await connection.close();
  }
  const rollout = workers.get('rolloutGroup') ?? new Set();
  expect(rollout.size).toBeGreaterThanOrEqual(1);
  for (const id of workers.get('trainStep') ?? []) expect(rollout.has(id)).toBe(false);
  console.log(`cluster run: ${STEPS} steps, time/step mean ${mean(lines.map((m) => m['time/step'])).toFixed(2)} s, `
    + `refit across hosts mean ${mean(lines.map((m) => m['time/refit_transfer'])).toFixed(3)} s, ${rollout.size} rollout worker(s) used`
    + ` (client on ${LOGIN_IP})`);
}, 1_800_000);

// Elastic engines: engine-2 joins a running run, engine-0 drains, engine-1 is killed without draining.
// The run never stalls and loses no episode: every step trains its full batch.
test('engines join, drain and die mid-run; every step trains a full batch', async () => {
  const runId = `elastic-${Date.now()}`;
  const env = clientEnv;
  const at = (step: number) => waitUntil(`step ${step}`, () => metrics(runId).length >= step, 900_000);
  // More steps than it will take: it is cancelled (a graceful stop) once the three events are behind it.
  const run = runCli(['start', 'recipes/copy', '--run-id', runId, ...RECIPE, '--train.steps', '1000', '--follow'], env);
  const stepTimes = () => metrics(runId).map((m) => Date.parse(m.time));

  await at(2);
  const add = await runCli(['engines', 'add', runId, spare], env);
  expect(add.stdout).toMatch(new RegExp(`engine ${spare} serves from version \\d+ \\(joined in [\\d.]+ s\\)`));
  const joinedAt = Number(/serves from version (\d+)/.exec(add.stdout)![1]);
  expect((await health(spare)).version).toBeGreaterThanOrEqual(joinedAt); // the weights came before any group
  expect((await runCli(['engines', 'add', runId, engines[0]], env)).stderr).toContain(`engine ${engines[0]} already serves run ${runId}`);

  await at(joinedAt + 2);
  const drain = await runCli(['engines', 'drain', runId, engines[0]], env);
  expect(drain.stdout).toMatch(/left at version \d+ after [\d.]+ s \(\d+ groups finished on it\)/);
  const leftAt = Number(/left at version (\d+)/.exec(drain.stdout)![1]);
  const list = await runCli(['engines', 'list', runId], env);
  expect(list.stdout).toContain(`${spare}\tserving`);
  expect(list.stdout).toContain(`${engines[1]}\tserving`);
  expect(list.stdout).not.toContain(engines[0]);
  expect((await runCli(['engines', 'drain', runId, engines[0]], env)).stderr).toContain(`engine ${engines[0]} does not serve run ${runId}`);

  const killedAfter = metrics(runId).length;
  procs.kill('engine-1'); // no drain: the process and its requests are gone
  const killedAt = Date.now();
  await at(killedAfter + 3);
  const firstStepAfterKill = (stepTimes()[killedAfter] - killedAt) / 1000;
  expect((await runCli(['cancel', runId], env)).code).toBe(0);

  const result = await run;
  expect(result.code).toBe(0);
  const lines = metrics(runId);
  expect(lines.map((m) => m.step)).toEqual(Array.from({ length: lines.length }, (_, i) => i + 1));
  for (const m of lines) {
    expect([m.step, m.episodes, m['rollout/failed_episodes'], m['dropped/empty']]).toEqual([m.step, 8, 0, 0]);
  }
  expect((await health(spare)).version).toBe(lines.length);
  const drained = (await health(engines[0])).version; // it got no weights after it left
  expect(drained).toBeGreaterThanOrEqual(leftAt);
  expect(drained).toBeLessThanOrEqual(leftAt + 1); // a refit begun before the drain ended may still reach it
  expect(drained).toBeLessThan(lines.length);
  const moved = ['rollout-0', 'rollout-1'].flatMap((n) => fs.readFileSync(procs.log(n), 'utf8').match(/router: session \S+ moved/g) ?? []);
  expect(fs.readFileSync(procs.log('control'), 'utf8')).toContain('refit goes on without them');
  console.log(`elastic run (${lines.length} steps): ${add.stdout.trim()} | ${drain.stdout.trim()} | kill of engine-1 after step `
    + `${killedAfter}: the next step ended ${firstStepAfterKill.toFixed(1)} s later, ${moved.length} sessions moved | `
    + `time/step mean ${mean(lines.map((m) => m['time/step'])).toFixed(2)} s`);
}, 1_800_000);
