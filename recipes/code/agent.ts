// The code task: the policy writes a Python function `f` for a task generated from the group's seed, and the
// reward is the fraction of its unit tests that pass. The answer runs in the sandbox (agents/sandbox.ts) on
// the tests' arguments only; the expected values stay here, so an answer that prints a fake report or
// exits early gains nothing it did not compute.
import type { Env, EnvAgentRunner, EnvTask } from '../../agents/contract';
import { runInSandbox, type SandboxLimits } from '../../agents/sandbox';

export interface CodeTask {
  prompt: string;
  cases: { args: unknown[]; expected: unknown }[]; // f(...args) must equal expected (compared as JSON)
  reference: string; // a correct solution, for tests and warm starts
}

// mulberry32: a small PRNG, so the same seed gives the same task everywhere (every episode, every retry).
function prng(seed: number): (lo: number, hi: number) => number {
  let s = seed >>> 0;
  return (lo, hi) => {
    s = (s + 0x6d2b79f5) >>> 0;
    let x = Math.imul(s ^ (s >>> 15), s | 1);
    x ^= x + Math.imul(x ^ (x >>> 7), x | 61);
    return lo + Math.floor((((x ^ (x >>> 14)) >>> 0) / 2 ** 32) * (hi - lo + 1)); // an integer in [lo, hi]
  };
}

type Int = (lo: number, hi: number) => number;
const word = (int: Int, letters: string, max: number) =>
  Array.from({ length: int(0, max) }, () => letters[int(0, letters.length - 1)]).join('');
const list = (int: Int, min: number, max: number, lo: number, hi: number) =>
  Array.from({ length: int(min, max) }, () => int(lo, hi));

// Each family: what f does (for the prompt), an argument generator, the reference in TS and in Python.
interface Family { param: string; does: string; arg: () => unknown; f: (a: any) => unknown; py: string }
const FAMILIES: ((int: Int) => Family)[] = [
  (int) => {
    const [a, b] = [int(2, 9), int(0, 9)];
    return {
      param: 'x', does: `returns ${a} * x + ${b}`, arg: () => int(-20, 20),
      f: (x: number) => a * x + b, py: `return ${a} * x + ${b}`,
    };
  },
  (int) => {
    const c = 'abc'[int(0, 2)];
    return {
      param: 's', does: `returns how many times '${c}' occurs in the string s`, arg: () => word(int, 'abc', 8),
      f: (s: string) => [...s].filter((ch) => ch === c).length, py: `return s.count('${c}')`,
    };
  },
  (int) => {
    const k = int(0, 9);
    return {
      param: 'xs', does: `returns the sum of the numbers in the list xs that are greater than ${k}`,
      arg: () => list(int, 0, 6, 0, 20),
      f: (xs: number[]) => xs.filter((x) => x > k).reduce((s, x) => s + x, 0), py: `return sum(x for x in xs if x > ${k})`,
    };
  },
  (int) => {
    const k = int(2, 7);
    return {
      param: 'n', does: `returns True if n is divisible by ${k}, else False`, arg: () => int(0, 50),
      f: (n: number) => n % k === 0, py: `return n % ${k} == 0`,
    };
  },
  (int) => {
    const n = int(1, 3);
    return {
      param: 's', does: `returns the string s reversed, repeated ${n} times`, arg: () => word(int, 'abcd', 5),
      f: (s: string) => [...s].reverse().join('').repeat(n), py: `return s[::-1] * ${n}`,
    };
  },
  (int) => ({
    param: 'xs', does: 'returns the largest number in the non-empty list xs minus the smallest',
    arg: () => list(int, 1, 6, -20, 20),
    f: (xs: number[]) => Math.max(...xs) - Math.min(...xs), py: 'return max(xs) - min(xs)',
  }),
];

export function codeTask(seed: number, tests = 5): CodeTask {
  const int = prng(seed);
  const family = FAMILIES[int(0, FAMILIES.length - 1)](int);
  const cases = Array.from({ length: tests }, () => {
    const arg = family.arg();
    return { args: [arg], expected: family.f(arg) };
  });
  return {
    prompt: `Write a Python function f(${family.param}) that ${family.does}.\n`,
    cases, reference: `def f(${family.param}):\n    ${family.py}\n`,
  };
}

// The code in the answer: the first ```python (or bare ```) block, else the whole text.
export function extractCode(answer: string): string {
  return /```(?:python|py)?[^\n]*\n([\s\S]*?)(?:```|$)/.exec(answer)?.[1] ?? answer;
}

// Runs in the sandbox: the solution, then f on each test's arguments (from stdin); prints the results.
const HARNESS = `import json, sys
calls = json.loads(sys.stdin.read())
scope = {'__name__': 'solution'}
try:
    exec(compile(open('solution.py').read(), 'solution.py', 'exec'), scope)
    f = scope['f']
except BaseException as e:
    print(json.dumps({'error': f'{type(e).__name__}: {e}'}))
    sys.exit(0)
results = []
for args in calls:
    try: results.append({'value': f(*args)})
    except BaseException as e: results.append({'error': type(e).__name__})
print(json.dumps(results, default=repr))
`;
export const SCORE_LIMITS: Partial<SandboxLimits> = {
  wallMs: 5000, cpuSeconds: 2, memoryMb: 128, processes: 8, outputBytes: 16384,
};

export interface Score { reward: number; passed: number; total: number; error?: string }

export async function scoreSolution(answer: string, task: CodeTask): Promise<Score> {
  const run = await runInSandbox(HARNESS, {
    files: { 'solution.py': extractCode(answer) }, limits: SCORE_LIMITS,
    stdin: JSON.stringify(task.cases.map((c) => c.args)),
  });
  const total = task.cases.length;
  let results: unknown;
  try {
    results = JSON.parse(run.stdout.trim().split('\n').pop() ?? '');
  } catch { /* killed, or the solution broke the output: nothing passed */ }
  if (!Array.isArray(results) || results.length !== total) {
    const why = run.limitsHit.length ? `stopped at the ${run.limitsHit.join(', ')} limit`
      : (results as { error?: string } | undefined)?.error ?? 'no results';
    return { reward: 0, passed: 0, total, error: String(why) };
  }
  const passed = task.cases.filter((c, i) => {
    const r = results as { value?: unknown }[];
    return r[i] && 'value' in r[i] && JSON.stringify(r[i].value) === JSON.stringify(c.expected);
  }).length;
  return { reward: passed / total, passed, total };
}

function createEnv(settings: Record<string, unknown>): Env {
  const tests = Number(settings.tests ?? 5);
  let task: CodeTask;
  return {
    reset(t: EnvTask) {
      task = codeTask(t.seed, tests);
      return { observation: task.prompt };
    },
    async step(action) {
      const score = await scoreSolution(action.text, task);
      return { reward: score.reward, terminated: true, truncated: false, info: { ...score } };
    },
  };
}

export const AgentRunner: EnvAgentRunner = { kind: 'env', createEnv };
