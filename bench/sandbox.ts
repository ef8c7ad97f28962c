// Sandbox overhead per run (agents/sandbox.ts): runInSandbox('pass') against a bare `python3 -c pass`,
// alternating, medians of N runs each. Usage: tsx bench/sandbox.ts [N=50]
import { spawnSync } from 'node:child_process';
import { runInSandbox, SANDBOX_PYTHON } from '../agents/sandbox';

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

async function main() {
  const n = Number(process.argv[2] ?? 50);
  const bare: number[] = [];
  const sandboxed: number[] = [];
  for (let i = 0; i < n; i++) {
    let t = performance.now();
    spawnSync(SANDBOX_PYTHON, ['-c', 'pass']);
    bare.push(performance.now() - t);
    t = performance.now();
    const r = await runInSandbox('pass');
    sandboxed.push(performance.now() - t);
    if (r.exitCode !== 0) throw new Error(`sandboxed run failed: ${JSON.stringify(r)}`);
  }
  const [b, s] = [median(bare), median(sandboxed)];
  console.log(`runs: ${n} each, alternating`);
  console.log(`bare ${SANDBOX_PYTHON} -c pass: median ${b.toFixed(1)} ms`);
  console.log(`runInSandbox('pass'):          median ${s.toFixed(1)} ms`);
  console.log(`overhead per run: ${(s - b).toFixed(1)} ms (ratio ${(s / b).toFixed(2)})`);
}
main().catch((e) => { console.error(e); process.exit(1); });
