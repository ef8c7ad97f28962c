// `molt-client up` / `ps` / `down`: a local stack that outlives the command that started it, serves
// `start` and `status`, and is gone, every process of it, after `down`. (Ports are picked free here,
// because other stacks may hold Temporal's default 7233 on a shared machine; `up` without flags
// uses 7233 and 8233, which `start`, `list` and `status` use by default.)
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { freePort } from '../../infra/stack';
import { runCli } from '../helpers/cli';

// pid and every process below it (torchrun's ranks, tsx's node), from /proc.
function tree(pid: number): number[] {
  const children = new Map<number, number[]>();
  for (const e of fs.readdirSync('/proc').filter((x) => /^\d+$/.test(x))) {
    try {
      const stat = fs.readFileSync(`/proc/${e}/stat`, 'utf8');
      const ppid = Number(stat.slice(stat.lastIndexOf(')') + 2).split(' ')[1]);
      children.set(ppid, [...(children.get(ppid) ?? []), Number(e)]);
    } catch { /* exited meanwhile */ }
  }
  const out = [pid];
  for (let i = 0; i < out.length; i++) out.push(...(children.get(out[i]) ?? []));
  return out;
}

test('up starts a stack that stays; start and status use it; ps lists it; down stops every process', async () => {
  const stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-up-'));
  const [port, uiPort] = [await freePort(), await freePort()];
  const env = { MOLT_TEMPORAL_ADDRESS: `127.0.0.1:${port}` };
  const where = ['--state-dir', stateDir];
  const up = await runCli(['up', '--port', String(port), '--ui-port', String(uiPort), ...where], env);
  expect(up.stdout).toContain(`local stack up: Temporal 127.0.0.1:${port}`);
  const record = JSON.parse(fs.readFileSync(path.join(stateDir, 'stack.json'), 'utf8')) as { processes: { name: string; pid: number }[] };
  const pids = record.processes.map((p) => p.pid);
  let all = pids;
  const state = (pid: number) => { // "pid state command", or null once gone (a zombie is gone, waiting to be reaped)
    try {
      const stat = fs.readFileSync(`/proc/${pid}/stat`, 'utf8');
      const code = stat.slice(stat.lastIndexOf(')') + 2, stat.lastIndexOf(')') + 3);
      return code === 'Z' ? null : `${pid} ${code} ${fs.readFileSync(`/proc/${pid}/cmdline`, 'utf8').replace(/\0/g, ' ').slice(0, 120)}`;
    } catch { return null; }
  };
  const alive = () => all.filter((pid) => state(pid) !== null);
  try {
    expect(record.processes.map((p) => p.name).sort()).toEqual(['actor', 'engine-0', 'rollout', 'temporal', 'worker']);
    expect(alive()).toEqual(pids); // the command has exited; its stack has not
    all = pids.flatMap(tree);
    expect((await runCli(['up', ...where], env)).stdout).toContain('already up');
    const ps = await runCli(['ps', ...where], env);
    expect(ps.stdout.match(/\trunning\t/g)?.length).toBe(5);
    const started = await runCli(['start', 'recipes/copy', '--run-id', 'on-up', '--train.steps', '2', '--batch.groups', '2', '--follow'], env);
    expect(started.code).toBe(0);
    expect(started.stdout).toContain('run on-up finished after 2 steps');
    expect((await runCli(['status', 'on-up'], env)).stdout).toContain('COMPLETED');
  } finally {
    const down = await runCli(['down', ...where], env);
    expect(down.stdout).toContain('local stack down');
  }
  expect(alive().map(state)).toEqual([]);
  expect((await runCli(['ps', ...where], env)).stdout).toContain('no local stack is up');
  fs.rmSync(stateDir, { recursive: true, force: true });
}, 900_000);
