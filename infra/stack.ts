// The local stack: Temporal dev server (SQLite file + Web UI), N engines, the actor (torchrun) and the
// worker(s), each a child process with its log in <stateDir>/logs. Used by `molt-client dev`
// (`npm start`), `molt-client up`, the end-to-end tests and the benchmarks. stop() ends everything
// it started; stopStacksOnSignals() makes Ctrl-C and SIGTERM do that, also while a stack starts.
import { ChildProcess, spawn } from 'node:child_process';
import { randomBytes } from 'node:crypto';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { REPO_ROOT } from '../agents/recipe';
import { SEARCH_ATTRIBUTE_TYPES } from '../workflows/visibility';

const VENV_BIN = path.join(REPO_ROOT, '.venv', 'bin');
// What `temporal server start-dev --search-attribute` registers: the run's attributes (workflows/visibility.ts).
export const SEARCH_ATTRIBUTES = Object.entries(SEARCH_ATTRIBUTE_TYPES).map(([name, type]) => `${name}=${type}`);

export interface StackOptions {
  modelDir: string;
  stateDir?: string; // default <repo>/.molt/stack
  engines?: number;
  actorWorldSize?: number;
  temporal?: { port?: number; uiPort?: number } | { address: string }; // address = use a running server
  workers?: boolean; // start the worker process (default true)
  engineArgs?: string[];
  actorArgs?: string[];
  // A recipe's other engine pools (`pools`: judge, teacher): engines named pool-<name>-<i>, never refit.
  pools?: Record<string, { modelDir: string; count: number; backend?: string }>;
  // Pin the engines and the actor to these CPUs (taskset lists, e.g. '0' and '1'), as each has its
  // own GPU on a cluster; the benchmarks use it to compare loops on separate compute.
  cpus?: { engines: string; actor: string };
  quiet?: boolean;
  // Runs still RUNNING in the stack's Temporal database came from an earlier stack (stopped by
  // Ctrl-C or `down`): terminate them before any worker starts, so the stack starts clean;
  // `molt-client resume <runId>` continues one from where it stopped.
  endLeftoverRuns?: boolean;
}

export interface Stack {
  temporalAddress: string;
  uiUrl: string | null;
  engines: string[];
  pools: Record<string, string[]>; // pool name -> its engine URLs
  actor: string;
  token: string;
  storeRoot: string;
  stateDir: string;
  processes: Map<string, ChildProcess>;
  // A worker process on the given task queues (comma-separated); `engineUrls` (default: the stack's
  // engines) are the engine URLs its router uses.
  startWorker(name: string, queues: string, engineUrls?: string[]): Promise<ChildProcess>;
  // Ends process `name` (SIGKILL: a crash; SIGTERM: a clean stop) and starts it again with the same
  // command, arguments and port; resolves when it is ready. An engine or actor comes back bare (its
  // base weights, version 0): the activities bring it back to the run's state (activities/actor.ts).
  restart(name: string, signal?: 'SIGKILL' | 'SIGTERM'): Promise<ChildProcess>;
  stop(): Promise<void>;
}

// The stop() of every stack of this process that may have processes running, and whether a signal
// has come: from then on nothing new is started (a stack half way through its start stops too).
const liveStacks = new Set<() => Promise<void>>();
let signalled: NodeJS.Signals | null = null;

// Ctrl-C (SIGINT), SIGTERM or SIGHUP: stop every stack of this process once, then exit 128+signo.
// A second signal while stopping is ignored (and said so): cutting the stop short would leave
// processes behind. The stack's processes run in process groups of their own, so a Ctrl-C at the
// terminal reaches only this process, and the stop is done in order by stop().
export function stopStacksOnSignals(onSignal?: (signal: NodeJS.Signals) => void): void {
  for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) {
    process.on(signal, () => {
      if (signalled) {
        console.error(`[stack] ${signal}: still stopping the stack (on ${signalled}); it ends by itself`);
        return;
      }
      signalled = signal;
      onSignal?.(signal);
      void Promise.allSettled([...liveStacks].map((stop) => stop())).then(() => process.exit(128 + os.constants.signals[signal]));
    });
  }
}

// n distinct free ports: every listener stays open until all n have their port.
async function freePorts(n: number): Promise<number[]> {
  const servers = await Promise.all(Array.from({ length: n }, () => new Promise<net.Server>((resolve, reject) => {
    const server = net.createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => resolve(server));
  })));
  const ports = servers.map((server) => (server.address() as net.AddressInfo).port);
  await Promise.all(servers.map((server) => new Promise((resolve) => server.close(resolve))));
  return ports;
}

export const freePort = async (): Promise<number> => (await freePorts(1))[0];

async function waitFor(what: string, check: () => Promise<boolean>, proc: ChildProcess, log: string, timeoutMs = 180_000) {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (proc.exitCode !== null) throw new Error(`${what} exited with code ${proc.exitCode}; log ${log}:\n${tail(log)}`);
    if (await check().catch(() => false)) return;
    await new Promise((r) => setTimeout(r, 250));
  }
  throw new Error(`${what} not ready after ${timeoutMs / 1000}s; log ${log}:\n${tail(log)}`);
}

// A log's bytes, none if it cannot be read (not written yet).
function readLog(file: string): Buffer {
  try {
    return fs.readFileSync(file);
  } catch {
    return Buffer.alloc(0);
  }
}
// The end of a log, to show in an error.
const tail = (file: string) => readLog(file).toString('utf8').slice(-3000);

// Every process below `pid`, from /proc: torchrun starts its ranks in sessions of their own, so a
// signal to torchrun's process group does not reach them, and a SIGKILLed torchrun cannot pass it on.
export function descendants(pid: number): number[] {
  const children = new Map<number, number[]>();
  for (const entry of fs.readdirSync('/proc').filter((e) => /^\d+$/.test(e))) {
    try {
      const stat = fs.readFileSync(`/proc/${entry}/stat`, 'utf8');
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]); // fields after "(comm)": state ppid ...
      children.set(ppid, [...(children.get(ppid) ?? []), Number(entry)]);
    } catch { /* exited meanwhile */ }
  }
  const out: number[] = [];
  const walk = (p: number) => { for (const c of children.get(p) ?? []) { out.push(c); walk(c); } };
  walk(pid);
  return out;
}

// Signals a process, its process group and every descendant (each in its own group, if it has one).
export function killTree(pid: number, signal: NodeJS.Signals): void {
  const below = descendants(pid);
  for (const p of [pid, ...below]) {
    try { process.kill(-p, signal); } catch { /* not a group leader, or gone */ }
    try { process.kill(p, signal); } catch { /* gone */ }
  }
}

async function healthy(url: string, token: string): Promise<boolean> {
  const res = await fetch(`${url}/health`, { headers: { authorization: `Bearer ${token}` } });
  return res.ok;
}

async function tcpOpen(port: number): Promise<boolean> {
  return new Promise((resolve) => {
    const socket = net.connect(port, '127.0.0.1', () => { socket.end(); resolve(true); });
    socket.once('error', () => resolve(false));
  });
}

// Terminates every RUNNING trainRun; returns their run ids.
async function endLeftoverRuns(address: string): Promise<string[]> {
  const { Client, Connection } = await import('@temporalio/client');
  const connection = await Connection.connect({ address });
  try {
    const client = new Client({ connection });
    const ended: string[] = [];
    for await (const run of client.workflow.list({ query: `WorkflowType = 'trainRun' AND ExecutionStatus = 'Running'` })) {
      const runId = run.workflowId.replace(/^molt-/, '');
      await client.workflow.getHandle(run.workflowId).terminate(`left by an earlier stack; molt-client resume ${runId} continues it`);
      ended.push(runId);
    }
    return ended;
  } finally {
    await connection.close();
  }
}

export async function startStack(opts: StackOptions): Promise<Stack> {
  const stateDir = path.resolve(opts.stateDir ?? path.join(REPO_ROOT, '.molt', 'stack'));
  const logDir = path.join(stateDir, 'logs');
  const storeRoot = path.join(stateDir, 'runs');
  fs.mkdirSync(logDir, { recursive: true });
  fs.mkdirSync(storeRoot, { recursive: true });
  const token = process.env.MOLT_TOKEN ?? randomBytes(16).toString('hex');
  const processes = new Map<string, ChildProcess>();
  const say = (msg: string) => opts.quiet || console.error(`[stack] ${msg}`);

  // How each process was started and how to tell it is ready, so restart() can do the same again.
  const specs = new Map<string, { cmd: string; args: string[]; env: Record<string, string>; ready: (logFrom: number) => Promise<boolean> }>();
  const launch = (name: string, cmd: string, args: string[], env: Record<string, string>, ready: (logFrom: number) => Promise<boolean>, cpus?: string) => {
    if (signalled) throw new Error(`stack: not starting ${name}, stopping on ${signalled}`);
    if (cpus !== undefined) [cmd, args] = ['taskset', ['-c', cpus, cmd, ...args]];
    specs.set(name, { cmd, args, env, ready });
    const log = path.join(logDir, `${name}.log`);
    const logFrom = fs.existsSync(log) ? fs.statSync(log).size : 0; // readiness is read from here on
    const out = fs.openSync(log, 'a');
    const proc = spawn(cmd, args, {
      cwd: REPO_ROOT, detached: true, stdio: ['ignore', out, out],
      env: { ...process.env, OMP_NUM_THREADS: '1', MOLT_TOKEN: token, ...env },
    });
    fs.closeSync(out);
    processes.set(name, proc);
    return { proc, log, ready: () => waitFor(name, () => ready(logFrom), proc, log) };
  };
  const alive = (p: ChildProcess) => p.exitCode === null && p.signalCode === null;
  const exited = (p: ChildProcess) => new Promise<void>((resolve) => (alive(p) ? p.once('exit', () => resolve()) : resolve()));

  const restart = async (name: string, signal: 'SIGKILL' | 'SIGTERM' = 'SIGKILL') => {
    const spec = specs.get(name);
    const old = processes.get(name);
    if (!spec || !old) throw new Error(`restart: no process named ${name} (have ${[...processes.keys()].join(', ')})`);
    const below = descendants(old.pid!);
    killTree(old.pid!, signal);
    await exited(old);
    for (const p of below) try { process.kill(p, 'SIGKILL'); } catch { /* gone, as it should be */ } // none may hold the port
    const { proc, ready } = launch(name, spec.cmd, spec.args, spec.env, spec.ready);
    await ready();
    say(`restarted ${name}`);
    return proc;
  };

  const stop = async () => {
    const live = [...processes.values()].filter(alive);
    const below = live.flatMap((p) => descendants(p.pid!));
    for (const p of live) killTree(p.pid!, 'SIGTERM');
    const deadline = Date.now() + 15_000;
    while (live.some(alive) && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 100));
    }
    for (const p of live) killTree(p.pid!, 'SIGKILL');
    for (const p of below) try { process.kill(p, 'SIGKILL'); } catch { /* gone */ }
    processes.clear();
    liveStacks.delete(stop);
  };
  liveStacks.add(stop);

  try {
    let temporalAddress: string;
    let uiUrl: string | null = null;
    if (opts.temporal && 'address' in opts.temporal) {
      temporalAddress = opts.temporal.address;
    } else {
      // A port picked free can be taken by another process before the server binds it: on an early
      // exit, try again with new ports (unless the caller fixed them).
      let port = 0;
      let uiPort = 0;
      for (let attempt = 1; ; attempt++) {
        const [p, ui, http, metrics] = await freePorts(4);
        port = opts.temporal?.port ?? p;
        uiPort = opts.temporal?.uiPort ?? ui;
        const args = ['server', 'start-dev', '--db-filename', path.join(stateDir, 'temporal.db'), '--port', String(port),
          '--ui-port', String(uiPort), '--http-port', String(http), '--metrics-port', String(metrics),
          '--log-level', 'warn', ...SEARCH_ATTRIBUTES.flatMap((a) => ['--search-attribute', a]),
          // One partition per task queue: with several, a task can sit in a partition no poller is on.
          '--dynamic-config-value', 'matching.numTaskqueueReadPartitions=1', '--dynamic-config-value', 'matching.numTaskqueueWritePartitions=1',
          // A write-ahead log synced at checkpoints, not at every commit: half the server's CPU per
          // step. A killed server loses nothing (only a power cut could lose the last commits).
          '--sqlite-pragma', 'journal_mode=wal', '--sqlite-pragma', 'synchronous=normal'];
        const launched = launch('temporal', path.join(VENV_BIN, 'temporal'), args, {}, () => tcpOpen(port));
        try {
          await launched.ready();
          break;
        } catch (err) {
          if (attempt === 3 || launched.proc.exitCode === null) throw err;
          say(`temporal exited at start (attempt ${attempt}), retrying with other ports`);
        }
      }
      temporalAddress = `127.0.0.1:${port}`;
      uiUrl = `http://localhost:${uiPort}`;
      say(`temporal ${temporalAddress}, UI ${uiUrl}`);
    }

    if (opts.endLeftoverRuns) {
      for (const runId of await endLeftoverRuns(temporalAddress)) say(`run ${runId} was left by an earlier stack: terminated (molt-client resume ${runId} continues it)`);
    }

    const engineCount = opts.engines ?? 1;
    const poolSpecs = Object.entries(opts.pools ?? {});
    const [actorPort, ...enginePorts] = await freePorts(engineCount + 1 + poolSpecs.reduce((n, [, p]) => n + p.count, 0));
    const ready: Promise<void>[] = [];
    const startEngines = (prefix: string, count: number, args: string[]) => Array.from({ length: count }, (_, i) => {
      const port = enginePorts.shift()!;
      const url = `http://127.0.0.1:${port}`;
      ready.push(launch(`${prefix}-${i}`, path.join(VENV_BIN, 'python'),
        ['gpu-services/engine.py', '--port', String(port), '--name', `${prefix}-${i}`, ...args],
        {}, () => healthy(url, token), opts.cpus?.engines).ready());
      return url;
    });
    const engines = startEngines('engine', engineCount, ['--model', opts.modelDir, ...(opts.engineArgs ?? [])]);
    const pools = Object.fromEntries(poolSpecs.map(([name, p]) => [name, startEngines(`pool-${name}`, p.count,
      ['--model', p.modelDir, '--backend', p.backend ?? 'torch'])]));
    const actor = `http://127.0.0.1:${actorPort}`;
    ready.push(launch('actor', path.join(VENV_BIN, 'python'), ['-m', 'torch.distributed.run', '--standalone',
      `--nproc-per-node=${opts.actorWorldSize ?? 1}`, 'gpu-services/actor.py', '--model', opts.modelDir,
      '--port', String(actorPort), '--state-dir', path.join(stateDir, 'actor'), ...(opts.actorArgs ?? [])],
      {}, () => healthy(actor, token), opts.cpus?.actor).ready());
    await Promise.all(ready);
    say(`engines ${engines.join(' ')}; actor ${actor}${poolSpecs.length ? `; pools ${JSON.stringify(pools)}` : ''}`);

    const startWorker = async (name: string, queues: string, engineUrls = engines) => {
      const log = path.join(logDir, `${name}.log`);
      const launched = launch(name, path.join(REPO_ROOT, 'node_modules', '.bin', 'tsx'), ['infra/worker.ts'], {
        MOLT_TEMPORAL_ADDRESS: temporalAddress, MOLT_ENGINES: engineUrls.join(','), MOLT_POOLS: JSON.stringify(pools), MOLT_ACTOR: actor,
        MOLT_STORE: storeRoot, MOLT_QUEUES: queues,
      }, async (logFrom) => readLog(log).subarray(logFrom).toString('utf8').includes('worker ready'));
      await launched.ready();
      return launched.proc;
    };
    // Two worker processes: the rollout activities' JavaScript (agents, tokenizer, store writes)
    // would otherwise hold up the workflow tasks of the loop in the same event loop. Measured on
    // the heavier bench workload: 17 instead of 24 worker CPU seconds, and a shorter step.
    if (opts.workers ?? true) await Promise.all([startWorker('worker', 'molt-control,molt-actor'), startWorker('rollout', 'molt-rollout')]);

    return { temporalAddress, uiUrl, engines, pools, actor, token, storeRoot, stateDir, processes, startWorker, restart, stop };
  } catch (err) {
    await stop();
    throw err;
  }
}
