// The sandbox (agents/sandbox.ts) on this machine's real namespaces and cgroups: each hostile program is
// contained, comes back as a structured result, and leaves this test process, its other children and
// the host's files as they were, with no process or cgroup left behind.
import { spawn, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as net from 'node:net';
import * as os from 'node:os';
import * as path from 'node:path';
import { runInSandbox, type SandboxResult } from '../../agents/sandbox';

let sentinel: ChildProcess; // a process of this test's that the sandboxed code tries to kill
// A world-writable host directory, so that only the read-only mount stops writes (not under /tmp: the
// sandbox sees its own /tmp there).
let hostDir: string;
beforeAll(() => {
  sentinel = spawn('sleep', ['1000'], { stdio: 'ignore' });
  hostDir = fs.mkdtempSync('/var/tmp/molt-sandbox-test-');
  fs.chmodSync(hostDir, 0o777);
  fs.writeFileSync(path.join(hostDir, 'keep.txt'), 'original');
  fs.chmodSync(path.join(hostDir, 'keep.txt'), 0o666);
});
afterAll(() => {
  sentinel.kill('SIGKILL');
  fs.rmSync(hostDir, { recursive: true, force: true });
});

const nobodyProcesses = () => fs.readdirSync('/proc').filter((p) => /^\d+$/.test(p)).filter((p) => {
  try { return /^Uid:\s+65534\b/m.test(fs.readFileSync(`/proc/${p}/status`, 'utf8')); } catch { return false; }
});
const leftoverCgroups = () => ['pids', 'memory'].flatMap((c) => {
  try { return fs.readdirSync(`/sys/fs/cgroup/${c}`).filter((d) => d.startsWith(`molt-sandbox-${process.pid}-`)); } catch { return []; }
});

// After any run: the sentinel and this process live, no sandbox process or cgroup is left, and the
// sandbox still works.
async function expectUnharmed(): Promise<void> {
  expect(sentinel.exitCode).toBeNull();
  expect(() => process.kill(sentinel.pid!, 0)).not.toThrow();
  expect(nobodyProcesses()).toEqual([]);
  expect(leftoverCgroups()).toEqual([]);
  const again = await runInSandbox('print(6 * 7)');
  expect(again).toMatchObject({ exitCode: 0, stdout: '42\n', limitsHit: [] });
}

// Most programs below print one JSON line of what they observed.
const observed = (r: SandboxResult) => JSON.parse(r.stdout.trim().split('\n').pop()!);

test('runs code with its files and stdin, as uid 65534 in a fresh /tmp, and reports its exit', async () => {
  const r = await runInSandbox([
    'import json, os, sys',
    'print(json.dumps({"uid": os.getuid(), "cwd": os.getcwd(), "files": sorted(os.listdir(".")), "data": open("data/x.txt").read(),',
    '  "stdin": sys.stdin.read(), "pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "env": dict(os.environ)}))',
    'sys.exit(3)',
  ].join('\n'), { files: { 'data/x.txt': 'hello' }, stdin: 'input!' });
  expect(r).toMatchObject({ exitCode: 3, signal: null, stderr: '', truncated: false, limitsHit: [] });
  const o = observed(r);
  expect(o).toMatchObject({ uid: 65534, cwd: '/tmp', files: ['data', 'main.py'], data: 'hello', stdin: 'input!' });
  expect(o.pids).toEqual([1, 2]); // its own pid namespace: the sandbox's init and the code
  expect(o.env.MOLT_TOKEN).toBeUndefined(); // the worker's environment does not leak in
  const failed = await runInSandbox('1 / 0');
  expect(failed).toMatchObject({ exitCode: 1, signal: null, limitsHit: [] });
  expect(failed.stderr).toBe('Traceback (most recent call last):\n  File "main.py", line 1, in <module>\n    1 / 0\n    ~~^~~\nZeroDivisionError: division by zero\n');
  await expectUnharmed();
});

test('a fork bomb is held at the process limit and killed at the wall limit', async () => {
  const r = await runInSandbox('import os\nwhile True:\n    try: os.fork()\n    except OSError: pass', { limits: { processes: 16, wallMs: 3000 } });
  expect(r).toMatchObject({ exitCode: null, signal: 'SIGKILL' });
  expect(r.limitsHit.sort()).toEqual(['processes', 'wall']);
  await expectUnharmed();
});

test('an infinite loop is stopped by the CPU limit, a sleeping one by the wall limit', async () => {
  const busy = await runInSandbox('while True: pass', { limits: { cpuSeconds: 1, wallMs: 60_000 } });
  expect(busy).toMatchObject({ exitCode: null, signal: 'SIGXCPU', limitsHit: ['cpu'] });
  const idle = await runInSandbox('import time\nprint("before", flush=True)\ntime.sleep(1000)', { limits: { wallMs: 1500 } });
  expect(idle).toMatchObject({ exitCode: null, signal: 'SIGKILL', limitsHit: ['wall'], stdout: 'before\n' });
  await expectUnharmed();
});

test('memory exhaustion is killed at the memory limit; a full /tmp is an error inside', async () => {
  const r = await runInSandbox('x = []\nwhile True: x.append(b"x" * 2**20)', { limits: { memoryMb: 64 } });
  expect(r).toMatchObject({ exitCode: null, signal: 'SIGKILL', limitsHit: ['memory'] });
  const disk = await runInSandbox([
    'try:',
    '    with open("big", "wb") as f:',
    '        for _ in range(64): f.write(b"x" * 2**20)',
    'except OSError as e: print(e.strerror)',
  ].join('\n'), { limits: { diskMb: 8 } });
  expect(disk).toMatchObject({ exitCode: 0, stdout: 'No space left on device\n', limitsHit: [] });
  await expectUnharmed();
});

test('no network: sockets cannot reach this host nor the outside', async () => {
  let connections = 0;
  const server = net.createServer((s) => { connections++; s.destroy(); });
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  const port = (server.address() as net.AddressInfo).port;
  try {
    const r = await runInSandbox([
      'import json, socket',
      'out = {}',
      `for name, addr in [("loopback", ("127.0.0.1", ${port})), ("outside", ("1.1.1.1", 53))]:`,
      '    try: socket.create_connection(addr, timeout=2); out[name] = "connected"',
      '    except OSError as e: out[name] = e.strerror',
      'try: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("8.8.8.8", 53)); out["udp"] = "sent"',
      'except OSError as e: out["udp"] = e.strerror',
      'try: socket.getaddrinfo("example.com", 80); out["dns"] = "resolved"',
      'except OSError as e: out["dns"] = "failed"',
      'print(json.dumps(out))',
    ].join('\n'));
    expect(observed(r)).toEqual({ loopback: 'Network is unreachable', outside: 'Network is unreachable', udp: 'Network is unreachable', dns: 'failed' });
    expect(connections).toBe(0);
  } finally {
    server.close();
  }
  await expectUnharmed();
});

test('writes outside its /tmp fail, mounts cannot be changed, other processes cannot be signalled', async () => {
  const keep = path.join(hostDir, 'keep.txt');
  const marker = `molt-sandbox-marker-${process.pid}`;
  const r = await runInSandbox([
    'import ctypes, json, os, signal',
    'out = {}',
    'def attempt(name, fn):',
    '    try: fn(); out[name] = "done"',
    '    except OSError as e: out[name] = e.strerror',
    `attempt("append", lambda: open(${JSON.stringify(keep)}, "a").write("changed"))`,
    `attempt("create", lambda: open(${JSON.stringify(path.join(hostDir, 'new.txt'))}, "w"))`,
    `attempt("remove", lambda: os.remove(${JSON.stringify(keep)}))`,
    'attempt("etc", lambda: open("/etc/molt-sandbox-test", "w"))',
    'attempt("shm", lambda: open("/dev/shm/molt-sandbox-test", "w"))',
    'attempt("home", lambda: open("/root/molt-sandbox-test", "w"))',
    `attempt("own_tmp", lambda: open("/tmp/${marker}", "w").write("x"))`,
    'libc = ctypes.CDLL(None, use_errno=True)',
    'out["remount"] = os.strerror(ctypes.get_errno()) if libc.mount(None, b"/", None, 0x20, None) else "remounted"',
    `attempt("kill_sentinel", lambda: os.kill(${sentinel.pid}, signal.SIGKILL))`,
    `attempt("kill_worker", lambda: os.kill(${process.pid}, signal.SIGKILL))`,
    'attempt("kill_all", lambda: os.kill(-1, signal.SIGKILL))',
    'print(json.dumps(out))',
  ].join('\n'));
  expect(r).toMatchObject({ exitCode: 0, limitsHit: [] });
  expect(observed(r)).toEqual({
    append: 'Read-only file system', create: 'Read-only file system', remove: 'Read-only file system',
    etc: 'Read-only file system', shm: 'Read-only file system', home: 'Permission denied',
    own_tmp: 'done', remount: 'Operation not permitted',
    kill_sentinel: 'No such process', kill_worker: 'No such process', kill_all: 'No such process',
  });
  expect(fs.readFileSync(keep, 'utf8')).toBe('original');
  expect(fs.readdirSync(hostDir)).toEqual(['keep.txt']);
  expect(fs.existsSync(path.join('/tmp', marker))).toBe(false); // its /tmp was its own, and is gone
  await expectUnharmed();
});

test('huge output is cut at the output limit and the run killed', async () => {
  const r = await runInSandbox('while True: print("x" * 1000)', { limits: { outputBytes: 10_000 } });
  expect(r).toMatchObject({ exitCode: null, signal: 'SIGKILL', truncated: true, limitsHit: ['output'] });
  expect(r.stdout.length).toBe(10_000);
  expect(r.stdout === `${'x'.repeat(1000)}\n`.repeat(10).slice(0, 10_000)).toBe(true); // the first 10,000 bytes
  const err = await runInSandbox('import sys\nwhile True: sys.stderr.write("e" * 1000)', { limits: { outputBytes: 5000 } });
  expect(err).toMatchObject({ truncated: true, limitsHit: ['output'], stderr: 'e'.repeat(5000) });
  await expectUnharmed();
});

test('bad options are refused, naming what is wrong', async () => {
  await expect(runInSandbox('pass', { limits: { wallMs: 0 } })).rejects.toThrow('sandbox: limits.wallMs must be a positive integer, got 0');
  await expect(runInSandbox('pass', { files: { '../escape.py': '' } })).rejects.toThrow('sandbox: files: "../escape.py" must be a relative path');
  await expect(runInSandbox('pass', { files: { 'main.py': '' } })).rejects.toThrow('other than main.py');
});
