// Ctrl-C and SIGTERM stop every process of a `dev` stack (what `npm start` runs: tsx client/cli.ts
// dev recipes/copy --follow), whenever they come: while the stack starts, mid-run, at the final
// checkpoint. A Ctrl-C reaches the whole foreground process group, and a second one follows it.
// Afterwards no process may be left: each test run marks its processes with an environment
// variable, which every process of the stack inherits, and /proc is scanned for it.
import { spawn, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { REPO_ROOT } from '../../agents/recipe';

const STEPS = 4;
const ARGS = ['client/cli.ts', 'dev', 'recipes/copy', '--follow', '--train.steps', String(STEPS), '--checkpoint.every', '100',
  '--batch.groups', '2', '--pool.inflight', '3', '--group_size', '4'];

// Processes (pid and command line) whose environment holds MOLT_SIGNAL_MARK=<mark>.
function marked(mark: string): string[] {
  const found: string[] = [];
  for (const pid of fs.readdirSync('/proc').filter((e) => /^\d+$/.test(e))) {
    try {
      if (!fs.readFileSync(`/proc/${pid}/environ`, 'utf8').split('\0').includes(`MOLT_SIGNAL_MARK=${mark}`)) continue;
      found.push(`${pid} ${fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').replace(/\0/g, ' ').slice(0, 160)}`);
    } catch { /* exited meanwhile, or not ours to read */ }
  }
  return found;
}

const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const exited = (p: ChildProcess) => new Promise<void>((resolve) => (p.exitCode !== null || p.signalCode !== null ? resolve() : p.once('exit', () => resolve())));

async function until(what: string, check: () => boolean, timeoutMs = 600_000): Promise<void> {
  for (const deadline = Date.now() + timeoutMs; !check();) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await sleep(200);
  }
}

type Moment = 'stack start' | 'mid-run' | 'final checkpoint';

// Starts dev in a process group of its own (a terminal job), waits for the moment, signals it, and
// returns what is left once it has exited (killing that, so that a failure leaves nothing behind).
async function interrupt(moment: Moment, how: 'Ctrl-C twice' | 'SIGTERM'): Promise<{ left: string[]; code: number | null; log: string }> {
  const mark = `${process.pid}-${moment.replace(/ /g, '-')}-${how.replace(/ /g, '-')}`;
  const stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-signal-'));
  const runId = `sig-${Date.now()}`;
  const dev = spawn(path.join(REPO_ROOT, 'node_modules', '.bin', 'tsx'), [...ARGS, '--run-id', runId], {
    cwd: REPO_ROOT, detached: true, stdio: ['ignore', 'pipe', 'pipe'],
    env: { ...process.env, MOLT_SIGNAL_MARK: mark, MOLT_STACK_DIR: stateDir, OMP_NUM_THREADS: '1' },
  });
  let log = '';
  dev.stdout!.on('data', (d) => { log += d; });
  dev.stderr!.on('data', (d) => { log += d; });
  const metrics = path.join(stateDir, 'runs', runId, 'metrics.jsonl');
  const lines = () => (fs.existsSync(metrics) ? fs.readFileSync(metrics, 'utf8').trim().split('\n').filter(Boolean).length : 0);
  // while the engines, the actor and the workers start (the Temporal server is up)
  if (moment === 'stack start') { await until('the Temporal server', () => log.includes('[stack] temporal')); await sleep(Math.random() * 3000); }
  if (moment === 'mid-run') { await until('step 1', () => lines() >= 1); await sleep(Math.random() * 1500); }
  if (moment === 'final checkpoint') await until('the last step', () => lines() >= STEPS); // the final checkpoint comes next
  const at = moment === 'stack start' && log.includes('started') ? ' (the run had started already)' : '';
  if (how === 'SIGTERM') {
    process.kill(dev.pid!, 'SIGTERM');
  } else {
    process.kill(-dev.pid!, 'SIGINT');
    await sleep(300 + Math.random() * 1000);
    try { process.kill(-dev.pid!, 'SIGINT'); } catch { /* already gone */ }
  }
  await Promise.race([exited(dev), sleep(120_000)]);
  await sleep(2000); // a process still going away
  const left = marked(mark);
  for (const line of left) try { process.kill(Number(line.split(' ')[0]), 'SIGKILL'); } catch { /* gone */ }
  console.log(`signal run: ${how} at ${moment}${at}: exit ${dev.exitCode ?? dev.signalCode}, ${left.length} processes left`);
  fs.rmSync(stateDir, { recursive: true, force: true });
  return { left, code: dev.exitCode, log };
}

const cases: [Moment, 'Ctrl-C twice' | 'SIGTERM'][] = [
  ['stack start', 'Ctrl-C twice'], ['mid-run', 'Ctrl-C twice'], ['final checkpoint', 'Ctrl-C twice'], ['mid-run', 'SIGTERM'],
];
test.each(cases)('%s, %s: every process of the stack stops', async (moment, how) => {
  const { left, log } = await interrupt(moment, how);
  expect({ left, log: left.length ? log.slice(-3000) : '' }).toEqual({ left: [], log: '' });
}, 900_000);
