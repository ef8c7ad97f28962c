// Arithmetic word problems for the `math` and `tool-calc` recipes: generated from a seed, with a
// held-out eval split; exact rational answers; a verifier for `\boxed{}` answers; a calculator.
//
// Everything is exact (bigint fractions): 7 liters shared by 4 bottles is 7/4, and an answer of
// 1.75, 7/4 or \frac{7}{4} is right. Floating point would call 0.1 + 0.2 wrong.
import { EVAL_GROUP_BASE } from '../../activities/evaluate';
import { deriveSeed } from '../../agents/env-runner';

// ----------------------------------------------------------------------------- exact numbers

const gcd = (a: bigint, b: bigint): bigint => {
  a = a < 0n ? -a : a;
  b = b < 0n ? -b : b;
  while (b) [a, b] = [b, a % b];
  return a;
};

export class Fraction {
  readonly n: bigint; // sign lives here
  readonly d: bigint; // > 0, lowest terms
  constructor(n: bigint, d: bigint = 1n) {
    if (d === 0n) throw new ToolInputError('division by zero');
    if (d < 0n) [n, d] = [-n, -d];
    const g = gcd(n, d) || 1n;
    this.n = n / g;
    this.d = d / g;
  }
  static of(x: number): Fraction { return new Fraction(BigInt(x)); }
  // "12", "-3.25", "0.5": a decimal literal, exactly.
  static decimal(text: string): Fraction {
    const m = /^([+-]?)(\d+)(?:\.(\d+))?$/.exec(text);
    if (!m) throw new ToolInputError(`not a number: ${JSON.stringify(text)}`);
    const frac = m[3] ?? '';
    const n = BigInt(m[2] + frac) * (m[1] === '-' ? -1n : 1n);
    return new Fraction(n, 10n ** BigInt(frac.length));
  }
  add(o: Fraction) { return new Fraction(this.n * o.d + o.n * this.d, this.d * o.d); }
  sub(o: Fraction) { return new Fraction(this.n * o.d - o.n * this.d, this.d * o.d); }
  mul(o: Fraction) { return new Fraction(this.n * o.n, this.d * o.d); }
  div(o: Fraction) {
    if (o.n === 0n) throw new ToolInputError('division by zero');
    return new Fraction(this.n * o.d, this.d * o.n);
  }
  equals(o: Fraction) { return this.n === o.n && this.d === o.d; }
  toString() { return this.d === 1n ? `${this.n}` : `${this.n}/${this.d}`; }
}

// An error the model caused (a malformed expression, a division by zero): the agent sends it back
// to the model as the tool's answer. Any other error from a tool is a bug in the recipe.
export class ToolInputError extends Error {
  constructor(message: string) {
    super(message);
    this.name = 'ToolInputError';
  }
}

// ----------------------------------------------------------------------------- calculator

const MAX_EXPRESSION = 200;

// + - * / and parentheses over decimal numbers, usual precedence, unary signs; exact.
export function calculate(expression: string): Fraction {
  if (typeof expression !== 'string') throw new ToolInputError('expression must be a string');
  if (expression.length > MAX_EXPRESSION) throw new ToolInputError(`expression longer than ${MAX_EXPRESSION} characters`);
  const tokens = expression.match(/\d+(?:\.\d+)?|[-+*/()]|\S/g) ?? [];
  let i = 0;
  const fail = (what: string): never => {
    throw new ToolInputError(`${what} in ${JSON.stringify(expression)}`);
  };
  const peek = () => tokens[i];
  const sum = (): Fraction => {
    let v = product();
    while (peek() === '+' || peek() === '-') v = tokens[i++] === '+' ? v.add(product()) : v.sub(product());
    return v;
  };
  const product = (): Fraction => {
    let v = unary();
    while (peek() === '*' || peek() === '/') v = tokens[i++] === '*' ? v.mul(unary()) : v.div(unary());
    return v;
  };
  const unary = (): Fraction => {
    if (peek() === '-') { i++; return unary().mul(Fraction.of(-1)); }
    if (peek() === '+') { i++; return unary(); }
    const t = tokens[i++];
    if (t === undefined) return fail('unexpected end');
    if (t === '(') {
      const v = sum();
      if (tokens[i++] !== ')') fail('missing )');
      return v;
    }
    if (/^\d/.test(t)) return Fraction.decimal(t);
    return fail(`unexpected ${JSON.stringify(t)}`);
  };
  if (!tokens.length) fail('empty expression');
  const value = sum();
  if (i < tokens.length) fail(`unexpected ${JSON.stringify(tokens[i])}`);
  return value;
}

// ----------------------------------------------------------------------------- verifier

// The content of the last \boxed{...} in the text (braces balanced), or null.
export function lastBoxed(text: string): string | null {
  const at = text.lastIndexOf('\\boxed{');
  if (at < 0) return null;
  let depth = 0;
  for (let i = at + '\\boxed'.length; i < text.length; i++) {
    if (text[i] === '{') depth++;
    else if (text[i] === '}' && --depth === 0) return text.slice(at + '\\boxed{'.length, i);
  }
  return null;
}

// The first number in the text, read robustly: signs (+, -, unicode minus), thousands separators
// (1,234 or 1 234), decimals, fractions (3/4, - 3 / 4, \frac{3}{4}, \dfrac), mixed numbers (1 1/2);
// text after it ($, units, words) is ignored. Null when there is none.
export function parseNumber(text: string): Fraction | null {
  const t = text
    .replace(/\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}/g, '($1)/($2)')
    .replace(/[\u2212\u2013]/g, '-') // unicode minus, en dash
    .replace(/\\[,!; ]|\$|\\\$/g, ' ');
  const int = String.raw`\d{1,3}(?:[, ]\d{3})+(?!\d)|\d+`;
  const num = String.raw`(?:${int})(?:\.\d+)?`;
  const m = new RegExp(String.raw`([+-]?)\s*(?:(\d+)\s+(?=\(?\d+\)?\s*/))?\(?(${num})\)?(?:\s*/\s*\(?([+-]?)\s*(${num})\)?)?`).exec(t);
  if (!m) return null;
  const clean = (s: string) => s.replace(/[, ]/g, '');
  let value = Fraction.decimal(clean(m[3]));
  if (m[5] !== undefined) {
    const den = Fraction.decimal(clean(m[5]));
    if (den.n === 0n) return null;
    value = value.div(den);
    if (m[4] === '-') value = value.mul(Fraction.of(-1));
  }
  if (m[2] !== undefined) value = value.add(Fraction.decimal(m[2])); // mixed number: 1 1/2
  return m[1] === '-' ? value.mul(Fraction.of(-1)) : value;
}

// The answer in the text's last \boxed{}, or null when there is no box or no number in it.
export function boxedAnswer(text: string): Fraction | null {
  const boxed = lastBoxed(text);
  return boxed === null ? null : parseNumber(boxed);
}

// ----------------------------------------------------------------------------- problems

export interface Problem {
  text: string;
  answer: Fraction;
  steps: string[]; // calculator expressions that solve it, in order (for demonstrations)
}

// mulberry32: a small PRNG, the same sequence for the same seed on every machine.
function rng(seed: number): () => number {
  let s = seed >>> 0;
  return () => {
    s = (s + 0x6d2b79f5) >>> 0;
    let x = Math.imul(s ^ (s >>> 15), s | 1);
    x ^= x + Math.imul(x ^ (x >>> 7), x | 61);
    return ((x ^ (x >>> 14)) >>> 0) / 2 ** 32;
  };
}

const NAMES = ['Mia', 'Tom', 'Ana', 'Raj', 'Lea', 'Sam', 'Ivy', 'Ben'];
type Template = (r: (lo: number, hi: number) => number, name: string) => Problem;
const F = Fraction.of;
// Each template draws its numbers with r(lo, hi) (integers, inclusive) and says how to solve it. The names are
// what env.templates lists.
export const TEMPLATES: Record<string, Template> = {
  add: (r, name) => {
    const [a, b] = [r(10, 999), r(10, 999)];
    return { text: `${name} has ${a} marbles and finds ${b} more. How many marbles does ${name} have now?`,
      answer: F(a + b), steps: [`${a}+${b}`] };
  },
  mul: (r) => {
    const [a, b] = [r(3, 99), r(3, 99)];
    return { text: `A box holds ${a} pens. How many pens are in ${b} boxes?`, answer: F(a * b), steps: [`${a}*${b}`] };
  },
  sub: (r) => {
    const [a, b] = [r(-20, 30), r(5, 60)];
    return { text: `The temperature was ${a} degrees and fell by ${b} degrees. What is the temperature now?`,
      answer: F(a - b), steps: [`${a}-${b}`] };
  },
  div: (r) => {
    const [a, b] = [r(2, 200), r(2, 12)];
    return { text: `${a} liters of juice are shared equally among ${b} bottles. How many liters go in each bottle?`,
      answer: F(a).div(F(b)), steps: [`${a}/${b}`] };
  },
  mul_add: (r, name) => {
    const [a, b, c] = [r(2, 40), r(6, 24), r(1, 99)];
    return { text: `${name} sells ${a} boxes of ${b} eggs and ${c} single eggs. How many eggs does ${name} sell?`,
      answer: F(a * b + c), steps: [`${a}*${b}`, `${a * b}+${c}`] };
  },
  mul_sub: (r) => {
    const [a, b, c] = [r(20, 120), r(2, 9), r(1000, 9999)];
    return { text: `A truck drives ${a} km a day for ${b} days. The trip is ${c} km. How many km are left?`,
      answer: F(c - a * b), steps: [`${a}*${b}`, `${c}-${a * b}`] };
  },
  sub_div: (r, name) => {
    const [a, b, c] = [r(100, 5000), r(10, 900), r(2, 8)];
    return { text: `${name} has ${a} dollars, spends ${b} and splits the rest equally among ${c} friends. ` +
      'How many dollars does each friend get?', answer: F(a - b).div(F(c)), steps: [`${a}-${b}`, `${a - b}/${c}`] };
  },
};

// The split a problem belongs to, from a hash of its text: the same problem is never in both.
export type Split = 'train' | 'eval';
export function splitOf(text: string, evalFraction: number): Split {
  const h = deriveSeed(...Buffer.from(text, 'utf8'));
  return h % 10_000 < evalFraction * 10_000 ? 'eval' : 'train';
}

// env settings of both recipes. templates and operands make easier problems (a smaller model, a shorter warm
// start): only the named kinds of problem, and every number drawn from [lo, hi] instead of the template's range.
export interface ProblemSettings { evalFraction: number; templates: string[]; operands?: [number, number] }
export function problemSettings(settings: Record<string, unknown>): ProblemSettings {
  const evalFraction = Number(settings.eval_fraction ?? 0.1);
  if (!(evalFraction > 0 && evalFraction < 1)) {
    throw new Error(`env.eval_fraction must be a number in (0, 1), got ${JSON.stringify(settings.eval_fraction)}`);
  }
  const templates = settings.templates ?? Object.keys(TEMPLATES);
  if (!Array.isArray(templates) || !templates.length || templates.some((t) => !Object.hasOwn(TEMPLATES, t))) {
    throw new Error(`env.templates must be a non-empty list of ${Object.keys(TEMPLATES).join(', ')}, `
      + `got ${JSON.stringify(settings.templates)}`);
  }
  const operands = settings.operands as [number, number] | undefined;
  if (operands !== undefined && !(Array.isArray(operands) && operands.length === 2 && operands.every(Number.isInteger)
    && operands[0] >= 1 && operands[0] <= operands[1])) {
    // lo >= 1: a drawn 0 would divide by zero in div and sub_div
    throw new Error(`env.operands must be [lo, hi], integers with 1 <= lo <= hi, got ${JSON.stringify(settings.operands)}`);
  }
  return { evalFraction, templates, operands };
}

// The problem for a seed, drawn again until it falls in the wanted split.
export function problemFor(seed: number, split: Split, settings: ProblemSettings): Problem {
  const next = rng(seed);
  const draw = (lo: number, hi: number) => lo + Math.floor(next() * (hi - lo + 1));
  const [lo, hi] = settings.operands ?? [];
  const r = lo === undefined ? draw : () => draw(lo, hi!);
  for (let tries = 0; ; tries++) {
    // a few problems in all (small operands, one template) may have none in a split
    if (tries === 10_000) throw new Error(`no ${split} problem in 10000 draws: env.templates/operands leave too few problems`);
    const p = TEMPLATES[settings.templates[draw(0, settings.templates.length - 1)]](r, NAMES[draw(0, NAMES.length - 1)]);
    if (splitOf(p.text, settings.evalFraction) === split) return p;
  }
}

// The problem of a prompt group: held-out groups (evaluation, EVAL_GROUP_BASE and up) get eval problems.
export function groupProblem(task: { groupIndex: number; seed: number }, settings: ProblemSettings): Problem {
  return problemFor(task.seed, task.groupIndex >= EVAL_GROUP_BASE ? 'eval' : 'train', settings);
}

// Demonstration i (supervised warm-up): a train problem from a seed stream of its own.
const DEMO_STREAM = 0x64656d6f; // "demo"
export function demonstrationProblem(index: number, settings: ProblemSettings): Problem {
  return problemFor(deriveSeed(DEMO_STREAM, index), 'train', settings);
}
