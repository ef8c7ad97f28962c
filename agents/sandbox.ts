// Sandboxed execution of untrusted Python (a policy's code, a tool call), for any recipe or tool.
//
// Each run is its own process tree: `unshare` (new network, mount, pid and IPC namespaces: no network but a
// loopback that is down, no view of other processes) -> a Python bootstrap, root in the namespaces, that joins
// the run's cgroups (pids.max bounds the process count: RLIMIT_NPROC does not bind root and counts per uid
// system-wide; memory bounds all its processes together), remounts every mount read-only and nosuid, puts a
// fresh size-capped tmpfs on /tmp (the working directory), and forks the code's process: RLIMIT_CPU, uid/gid
// 65534 (nobody: no capabilities, so nothing can be remounted, written as root or signalled outside),
// no_new_privs. The bootstrap stays pid 1 of the namespace: it reaps, reports the code's exit status on fd 3,
// kills the run at the wall limit + 5 s even if this worker died, and when it exits the kernel kills every
// process left. The cgroups are emptied and removed here. Needs root, cgroups (v1 or v2) and util-linux.
import { spawn } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import type { Readable } from 'node:stream';

export interface SandboxLimits {
  wallMs: number; // wall time, then SIGKILL
  cpuSeconds: number; // RLIMIT_CPU of the code's process (SIGXCPU)
  memoryMb: number; // all its processes together (cgroup), then the OOM killer
  processes: number; // tasks (processes and threads) at once, the bootstrap included (cgroup pids.max)
  outputBytes: number; // per stream; past it the run is killed and the stream truncated
  diskMb: number; // the tmpfs on /tmp
}
export const DEFAULT_LIMITS: SandboxLimits = {
  wallMs: 10_000, cpuSeconds: 5, memoryMb: 256, processes: 32, outputBytes: 64 * 1024, diskMb: 64,
};
export interface SandboxOptions { files?: Record<string, string>; stdin?: string; limits?: Partial<SandboxLimits> }
export type SandboxLimit = 'wall' | 'cpu' | 'memory' | 'processes' | 'output';
export interface SandboxResult {
  exitCode: number | null; signal: NodeJS.Signals | null; // one of them is null
  stdout: string; stderr: string;
  truncated: boolean; // an output stream passed limits.outputBytes
  limitsHit: SandboxLimit[]; // the limits the run ran into (a fork bomb: processes, then wall)
  wallMs: number;
}

// The system interpreter runs the code: the repo's .venv python lives under /root, which uid 65534 cannot read.
export const SANDBOX_PYTHON = '/usr/bin/python3';
const NOBODY = 65534;
const BOOTSTRAP = String.raw`
import ctypes, os, resource, signal, sys
def read(n):  # exactly n bytes: the rest of stdin is the code's
    b = b''
    while len(b) < n: b += os.read(0, n - len(b)) or sys.exit('molt-sandbox: stdin ended inside the job')
    return b
job = eval(read(int(read(12))), {'__builtins__': {}})  # JSON without true/false/null is a Python literal (json imports re)
for g in job['cgroups']:
    with open(g + '/cgroup.procs', 'w') as f: f.write('0')
libc = ctypes.CDLL(None, use_errno=True)
def mount(src, dst, fstype, flags, data=None):
    if libc.mount(src, dst.encode(), fstype, flags, data) != 0:
        sys.exit(f'molt-sandbox: mount {dst}: {os.strerror(ctypes.get_errno())}')
for line in open('/proc/self/mountinfo').read().splitlines():  # /proc stays: this pid namespace's own
    f = line.split(); opts = f[5].split(',')  # MS_REMOUNT|MS_BIND|MS_RDONLY|MS_NOSUID, keeping nodev/noexec
    flags = 0x1023 | 4 * ('nodev' in opts) | 8 * ('noexec' in opts)
    if f[4] != '/proc': mount(None, f[4].replace('\\040', ' '), None, flags)
mount(b'tmpfs', '/tmp', b'tmpfs', 6, f"size={job['diskMb']}m,mode=700,uid=${NOBODY},gid=${NOBODY}".encode())
os.chdir('/tmp')
pid = os.fork()
if pid:  # pid 1 of the namespace ignores signals it has no handler for, so the code runs in a child
    signal.signal(signal.SIGALRM, lambda *_: os._exit(137)); signal.alarm(job['backstopSeconds'])
    while True:
        done, status = os.wait()
        if done == pid: break
    os.write(3, str(os.waitstatus_to_exitcode(status)).encode())
    os._exit(0)  # nothing of ours to flush: skip the interpreter's teardown
with open('/proc/self/oom_score_adj', 'w') as f: f.write('1000')  # the OOM killer takes the code, not the init
resource.setrlimit(resource.RLIMIT_CPU, (job['cpuSeconds'], job['cpuSeconds'] + 1))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.setgroups([]); os.setgid(${NOBODY}); os.setuid(${NOBODY})
if libc.prctl(38, 1, 0, 0, 0): sys.exit('molt-sandbox: prctl(PR_SET_NO_NEW_PRIVS) failed')
for name, text in job['files'].items():
    os.makedirs(os.path.dirname(name) or '.', exist_ok=True)
    with open(name, 'w') as f: f.write(text)
sys.argv = ['main.py']; sys.path.insert(0, '/tmp')
os.write(3, b'ran '); os.close(3)  # set up: from here on, what fails is the code's
try:
    exec(compile(job.pop('files')['main.py'], 'main.py', 'exec'), {'__name__': '__main__', '__file__': 'main.py'})
except SystemExit: raise
except BaseException as e:
    sys.excepthook(type(e), e, e.with_traceback(e.__traceback__.tb_next).__traceback__); sys.exit(1)
`;

const v2 = fs.existsSync('/sys/fs/cgroup/cgroup.controllers');
let runs = 0;

// One directory per controller (v1) or one for both (v2), with the run's limits written in.
function makeCgroups(limits: SandboxLimits): { pids: string; memory: string; dirs: string[] } {
  const name = `molt-sandbox-${process.pid}-${Date.now()}-${++runs}`; // unique past a restart with the same pid
  const pids = v2 ? `/sys/fs/cgroup/${name}` : `/sys/fs/cgroup/pids/${name}`;
  const memory = v2 ? pids : `/sys/fs/cgroup/memory/${name}`;
  const dirs = [...new Set([pids, memory])];
  try {
    const control = '/sys/fs/cgroup/cgroup.subtree_control';
    const enabled = v2 ? fs.readFileSync(control, 'utf8') : '';
    if (v2 && !(/\bpids\b/.test(enabled) && /\bmemory\b/.test(enabled))) fs.writeFileSync(control, '+pids +memory');
    for (const d of dirs) fs.mkdirSync(d);
    fs.writeFileSync(`${pids}/pids.max`, String(limits.processes));
    const bytes = String(limits.memoryMb * 2 ** 20);
    fs.writeFileSync(`${memory}/${v2 ? 'memory.max' : 'memory.limit_in_bytes'}`, bytes);
    const swap = `${memory}/${v2 ? 'memory.swap.max' : 'memory.memsw.limit_in_bytes'}`; // no swapping past the limit
    if (fs.existsSync(swap)) fs.writeFileSync(swap, v2 ? '0' : bytes);
  } catch (e) {
    for (const d of dirs) try { fs.rmdirSync(d); } catch { /* not made */ }
    throw new Error(`sandbox: cannot set up its cgroups (it needs root and cgroups v1 or v2): ${(e as Error).message}`);
  }
  return { pids, memory, dirs };
}

const procsOf = (cgroup: string) => fs.readFileSync(`${cgroup}/cgroup.procs`, 'utf8').split('\n').filter(Boolean)
  .map(Number);
const counter = (file: string, key: string) => Number(new RegExp(`^${key} (\\d+)`, 'm')
  .exec(fs.readFileSync(file, 'utf8'))?.[1] ?? 0);

// Runs Python `code` as main.py in a fresh /tmp holding `files`. Whatever the code does comes back as a
// result (exit code or signal, output, the limits hit); it throws only when the sandbox cannot be set up.
export async function runInSandbox(code: string, opts: SandboxOptions = {}): Promise<SandboxResult> {
  const limits = { ...DEFAULT_LIMITS, ...opts.limits };
  const bad = Object.entries(limits).find(([, v]) => !Number.isInteger(v) || v <= 0);
  if (bad) throw new Error(`sandbox: limits.${bad[0]} must be a positive integer, got ${bad[1]}`);
  const badName = Object.keys(opts.files ?? {})
    .find((n) => n === 'main.py' || path.isAbsolute(n) || path.normalize(n).startsWith('..'));
  if (badName !== undefined) {
    throw new Error(`sandbox: files: ${JSON.stringify(badName)} must be a relative path inside /tmp other than main.py`);
  }
  // The code's whole environment: nothing of the worker's (tokens, addresses) goes in.
  const env = { PATH: '/usr/local/bin:/usr/bin:/bin', HOME: '/tmp', TMPDIR: '/tmp', LANG: 'C.UTF-8', OMP_NUM_THREADS: '1' };
  const cg = makeCgroups(limits);
  const job = JSON.stringify({
    cgroups: cg.dirs, diskMb: limits.diskMb, cpuSeconds: limits.cpuSeconds, files: { ...opts.files, 'main.py': code },
    backstopSeconds: Math.ceil(limits.wallMs / 1000) + 5,
  });
  const started = Date.now();
  const hit = new Set<SandboxLimit>();
  // -u: what the code printed before a kill still comes back. detached: its own process group, killed as one.
  const child = spawn('unshare', ['--net', '--mount', '--pid', '--ipc', '--fork', '--kill-child', '--mount-proc',
    SANDBOX_PYTHON, '-I', '-u', '-c', BOOTSTRAP], { stdio: ['pipe', 'pipe', 'pipe', 'pipe'], env, detached: true });
  // Kills the namespace's init (and the rest of the cgroup): the kernel then kills every process of the
  // namespace and reaps them before `unshare` sees init exit, so once `unshare` has exited none is left,
  // not even a zombie. Killing `unshare` too would end the wait before the reaping is done.
  const kill = () => {
    let inCgroup: number[] = [];
    try { inCgroup = procsOf(cg.pids); } catch { /* removed meanwhile */ }
    for (const pid of inCgroup) try { process.kill(pid, 'SIGKILL'); } catch { /* exited meanwhile */ }
    if (inCgroup.length === 0) try { process.kill(-child.pid!, 'SIGKILL'); } catch { /* exited */ } // not set up yet
  };
  const timer = setTimeout(() => { hit.add('wall'); kill(); }, limits.wallMs);
  const out: Record<'stdout' | 'stderr' | 'status', Buffer[]> = { stdout: [], stderr: [], status: [] };
  const streams = { stdout: child.stdout, stderr: child.stderr, status: child.stdio[3] as Readable };
  for (const [name, stream] of Object.entries(streams) as [keyof typeof out, Readable][]) {
    let size = 0;
    stream.on('data', (d: Buffer) => {
      const room = limits.outputBytes - size;
      if (d.length > room) { hit.add('output'); kill(); }
      out[name].push(d.subarray(0, Math.max(room, 0)));
      size += d.length;
    });
  }
  child.stdin.on('error', () => { /* the code exited without reading all of its stdin */ });
  const header = String(Buffer.byteLength(job)).padStart(12, '0');
  child.stdin.end(Buffer.concat([Buffer.from(header + job), Buffer.from(opts.stdin ?? '')]));
  try {
    await new Promise((resolve, reject) => child.on('error', reject).on('close', resolve));
    const text = (name: keyof typeof out) => Buffer.concat(out[name]).toString('utf8');
    const status = /^ran (-?\d+)$/.exec(text('status'));
    if (!status && !hit.has('wall') && !hit.has('output')) {
      throw new Error(`sandbox: setup failed (status ${JSON.stringify(text('status'))}): ${text('stderr').slice(0, 2000)}`);
    }
    const exit = status ? Number(status[1]) : -os.constants.signals.SIGKILL; // no status: killed here
    const signal = exit >= 0 ? null
      : Object.entries(os.constants.signals).find(([, n]) => n === -exit)?.[0] as NodeJS.Signals;
    if (signal === 'SIGXCPU') hit.add('cpu');
    if (counter(`${cg.memory}/${v2 ? 'memory.events' : 'memory.oom_control'}`, 'oom_kill') > 0) hit.add('memory');
    if (counter(`${cg.pids}/pids.events`, 'max') > 0) hit.add('processes');
    return {
      exitCode: exit < 0 ? null : exit, signal, stdout: text('stdout'), stderr: text('stderr'),
      truncated: hit.has('output'), limitsHit: [...hit], wallMs: Date.now() - started,
    };
  } finally {
    clearTimeout(timer);
    await removeCgroups(cg);
  }
}

// Kills what is left in the run's cgroups and removes them (a killed process leaves once the kernel reaped it).
async function removeCgroups(cg: { pids: string; dirs: string[] }): Promise<void> {
  for (let i = 0; ; i++) {
    for (const pid of procsOf(cg.pids)) try { process.kill(pid, 'SIGKILL'); } catch { /* gone already */ }
    try {
      for (const d of cg.dirs) fs.rmdirSync(d);
      return;
    } catch (e) {
      if (i >= 500) throw new Error(`sandbox: cannot remove cgroup ${cg.pids}: ${(e as Error).message}`);
      await new Promise((r) => setTimeout(r, 10));
    }
  }
}
