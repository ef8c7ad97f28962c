// A small cluster on one machine: each "host" is a Linux network namespace with its own address on a
// bridge (10.213.7.0/24), and this process, on the bridge's address, is the login node. Processes are
// started in a host with `ip netns exec`, so each one sees only its host's interfaces (its eth0 and
// its own loopback). Needs root. Everything made here is named with PREFIX, so cleanup() can remove
// what a crashed run left (its processes included) without touching anything else of the machine.
import { ChildProcess, execFileSync, spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { REPO_ROOT } from '../../agents/recipe';
import { killTree } from '../../infra/stack';

const PREFIX = 'moltcl';
const BRIDGE = `${PREFIX}-br`;
const SUBNET = '10.213.7';
export const LOGIN_IP = `${SUBNET}.1`;

export interface Host { name: string; ns: string; ip: string }

const ip = (...args: string[]) => execFileSync('ip', args, { encoding: 'utf8', stdio: ['ignore', 'pipe', 'pipe'] });

// Removes this harness's namespaces (killing every process in them first: deleting a namespace
// does not end its processes), its veths and its bridge.
export function cleanup(): void {
  const spaces = ip('netns', 'list').split('\n').map((l) => l.split(' ')[0]).filter((n) => n.startsWith(`${PREFIX}-`));
  for (const ns of spaces) {
    for (const pid of ip('netns', 'pids', ns).split('\n').filter(Boolean)) {
      try { process.kill(Number(pid), 'SIGKILL'); } catch { /* gone */ }
    }
  }
  for (const ns of spaces) ip('netns', 'del', ns);
  for (const link of ip('-o', 'link', 'show').split('\n').map((l) => l.split(': ')[1]?.split('@')[0])) {
    if (link?.startsWith(PREFIX)) try { ip('link', 'del', link); } catch { /* a veth goes with its namespace's end */ }
  }
}

export function makeHosts(names: string[]): Host[] {
  if (process.getuid?.() !== 0) throw new Error('the namespace cluster needs root (ip netns, veth pairs, a bridge)');
  const taken = ip('-4', 'route', 'show').split('\n').find((r) => r.startsWith(`${SUBNET}.`));
  if (taken) throw new Error(`${SUBNET}.0/24 is already routed on this machine (${taken}); the cluster would clash with it`);
  ip('link', 'add', BRIDGE, 'type', 'bridge');
  ip('addr', 'add', `${LOGIN_IP}/24`, 'dev', BRIDGE);
  ip('link', 'set', BRIDGE, 'up');
  return names.map((name, i) => {
    const host = { name, ns: `${PREFIX}-${name}`, ip: `${SUBNET}.${10 + i}` };
    const [outside, inside] = [`${PREFIX}${i}h`, `${PREFIX}${i}n`];
    ip('netns', 'add', host.ns);
    ip('link', 'add', outside, 'type', 'veth', 'peer', 'name', inside);
    ip('link', 'set', outside, 'master', BRIDGE);
    ip('link', 'set', outside, 'up');
    ip('link', 'set', inside, 'netns', host.ns);
    ip('-n', host.ns, 'link', 'set', inside, 'name', 'eth0');
    ip('-n', host.ns, 'addr', 'add', `${host.ip}/24`, 'dev', 'eth0');
    ip('-n', host.ns, 'link', 'set', 'eth0', 'up');
    ip('-n', host.ns, 'link', 'set', 'lo', 'up');
    return host;
  });
}

// One process on a host, detached (a process group of its own), its output in <logDir>/<name>.log.
// GLOO_SOCKET_IFNAME: torch's gloo binds the interface the host's name resolves to, which in a
// namespace is no interface of it; a real cluster sets it the same way.
export class Processes {
  readonly all = new Map<string, ChildProcess>();
  constructor(private readonly logDir: string) { fs.mkdirSync(logDir, { recursive: true }); }

  start(host: Host, name: string, cmd: string, args: string[], env: Record<string, string> = {}): ChildProcess {
    const out = fs.openSync(this.log(name), 'a');
    const proc = spawn('ip', ['netns', 'exec', host.ns, cmd, ...args], {
      cwd: REPO_ROOT, detached: true, stdio: ['ignore', out, out],
      env: { ...process.env, OMP_NUM_THREADS: '1', GLOO_SOCKET_IFNAME: 'eth0', ...env },
    });
    fs.closeSync(out);
    this.all.set(name, proc);
    return proc;
  }

  log(name: string): string { return path.join(this.logDir, `${name}.log`); }

  kill(name: string, signal: NodeJS.Signals = 'SIGKILL'): void {
    const proc = this.all.get(name);
    if (proc?.pid !== undefined && proc.exitCode === null) killTree(proc.pid, signal);
  }

  async stopAll(): Promise<void> {
    for (const name of this.all.keys()) this.kill(name, 'SIGTERM');
    const deadline = Date.now() + 10_000;
    while ([...this.all.values()].some((p) => p.exitCode === null && p.signalCode === null) && Date.now() < deadline) {
      await new Promise((r) => setTimeout(r, 200));
    }
    for (const name of this.all.keys()) this.kill(name, 'SIGKILL');
  }
}

// The TCP listeners of a host: local address, port and the command of the process that holds it.
export function listeners(host: Host): { addr: string; port: number; command: string }[] {
  const out = execFileSync('ip', ['netns', 'exec', host.ns, 'ss', '-ltnpH'], { encoding: 'utf8' });
  return out.split('\n').filter(Boolean).map((line) => {
    const local = line.trim().split(/\s+/)[3];
    const cut = local.lastIndexOf(':');
    return { addr: local.slice(0, cut), port: Number(local.slice(cut + 1)), command: /users:\(\("([^"]+)"/.exec(line)?.[1] ?? '?' };
  });
}

export async function waitUntil(what: string, check: () => Promise<boolean> | boolean, timeoutMs = 300_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (Date.now() < deadline) {
    if (await Promise.resolve().then(check).catch(() => false)) return;
    await new Promise((r) => setTimeout(r, 500));
  }
  throw new Error(`${what}: not after ${timeoutMs / 1000} s`);
}
