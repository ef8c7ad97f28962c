// The arithmetic shared by the math and tool-calc recipes (recipes/math/problems.ts): the exact
// calculator, the \boxed{} verifier, the seeded problem generator and its held-out split.
import { EVAL_GROUP_BASE } from '../../activities/evaluate';
import {
  boxedAnswer, calculate, demonstrationProblem, Fraction, groupProblem, parseNumber, problemFor, problemSettings,
  splitOf, ToolInputError,
} from '../../recipes/math/problems';

const num = (s: string) => parseNumber(s)?.toString() ?? null;

test('the verifier reads numbers robustly: spaces, commas, signs, decimals, fractions, trailing text', () => {
  const cases: [string, string | null][] = [
    ['42', '42'], [' 42 apples', '42'], ['42.', '42'], ['The answer is 42', '42'], ['x = -5', '-5'],
    ['+5', '5'], ['-5', '-5'], ['\u22125', '-5'], ['- 5', '-5'],
    ['1,234', '1234'], ['1 234', '1234'], ['1,234,567.5', '2469135/2'], ['-1 000 000', '-1000000'],
    ['0.75', '3/4'], ['3/4', '3/4'], ['- 3 / 4', '-3/4'], ['3/-4', '-3/4'], ['6/8 liters', '3/4'],
    ['\\frac{3}{4}', '3/4'], ['\\dfrac{-3}{4}', '-3/4'], ['-\\frac{7}{2}', '-7/2'], ['1 1/2', '3/2'], ['-1 1/2', '-3/2'],
    ['$12', '12'], ['\\$12.50', '25/2'], ['12 apples and 3 pears', '12'], ['2, 3', '2'],
    ['none', null], ['', null], ['7/0', null],
  ];
  for (const [text, want] of cases) expect([text, num(text)]).toEqual([text, want]);
  // 1.75, 7/4 and \frac{7}{4} are the same answer; 0.1 + 0.2 is exactly 3/10 here.
  expect(parseNumber('1.75')!.equals(parseNumber('\\frac{7}{4}')!)).toBe(true);
});

test('the answer is the number in the last \\boxed{}, braces balanced', () => {
  expect(boxedAnswer('first \\boxed{1}, then \\boxed{\\frac{7}{4}} liters.')?.toString()).toBe('7/4');
  expect(boxedAnswer('\\boxed{ -1,204 dollars }')?.toString()).toBe('-1204');
  expect(boxedAnswer('\\boxed{{12}}')?.toString()).toBe('12');
  expect(boxedAnswer('the answer is 12')).toBeNull(); // no box: not an answer
  expect(boxedAnswer('\\boxed{twelve}')).toBeNull();
  expect(boxedAnswer('\\boxed{12')).toBeNull(); // never closed
});

test('the calculator: + - * / and parentheses, exact, with errors the model can read', () => {
  const cases: [string, string][] = [
    ['1+2*3', '7'], ['(1+2)*3', '9'], ['-3--4', '1'], ['7/4', '7/4'], ['0.1+0.2', '3/10'], [' 2 * ( 3 + 4 ) ', '14'],
    ['8877-48*6', '8589'], ['-(2+3)/-5', '1'], ['1.5*4', '6'],
  ];
  for (const [e, want] of cases) expect([e, calculate(e).toString()]).toEqual([e, want]);
  const errors: [string, RegExp][] = [
    ['2*(3', /missing \) in "2\*\(3"/], ['1/0', /division by zero/], ['1/(2-2)', /division by zero/],
    ['abc', /unexpected "a"/], ['', /empty expression/], ['2 3', /unexpected "3"/], ['2^3', /unexpected "\^"/],
    ['1+'.repeat(150) + '1', /longer than 200/],
  ];
  for (const [e, message] of errors) {
    expect(() => calculate(e)).toThrow(ToolInputError);
    expect(() => calculate(e)).toThrow(message);
  }
  expect(() => calculate(12 as unknown as string)).toThrow('expression must be a string');
});

test('problems: the same seed gives the same problem; their steps compute their answers', () => {
  const settings = problemSettings({});
  expect(problemFor(5, 'train', settings)).toEqual(problemFor(5, 'train', settings));
  const problems = Array.from({ length: 300 }, (_, s) => problemFor(s, 'train', settings));
  expect(new Set(problems.map((p) => p.text)).size).toBeGreaterThan(290);
  for (const p of problems) expect(calculate(p.steps[p.steps.length - 1]).equals(p.answer)).toBe(true);
  // Signs and fractions occur: the verifier's cases are the generator's.
  expect(problems.some((p) => p.answer.n < 0n)).toBe(true);
  expect(problems.some((p) => p.answer.d > 1n)).toBe(true);
});

test('the eval split is held out: no problem is in both, and held-out groups get only eval problems', () => {
  const settings = problemSettings({ eval_fraction: 0.2 });
  const train = new Set(Array.from({ length: 2000 }, (_, s) => problemFor(s, 'train', settings).text));
  const evalTexts = Array.from({ length: 300 }, (_, i) =>
    groupProblem({ groupIndex: EVAL_GROUP_BASE + i, seed: 7000 + i }, settings).text);
  for (const t of evalTexts) {
    expect(splitOf(t, 0.2)).toBe('eval');
    expect(train.has(t)).toBe(false);
  }
  for (const t of train) expect(splitOf(t, 0.2)).toBe('train');
  // About the asked fraction of all problems is held out.
  const all = Array.from({ length: 2000 }, (_, s) => problemFor(s, 'train', problemSettings({ eval_fraction: 1e-9 })).text);
  const held = all.filter((t) => splitOf(t, 0.2) === 'eval').length / all.length;
  expect(held).toBeGreaterThan(0.15);
  expect(held).toBeLessThan(0.25);
  // Demonstrations are train problems.
  for (let i = 0; i < 100; i++) expect(splitOf(demonstrationProblem(i, settings).text, 0.2)).toBe('train');
  expect(() => problemSettings({ eval_fraction: 1 })).toThrow('env.eval_fraction must be a number in (0, 1), got 1');
});

test('fractions are kept in lowest terms with the sign in the numerator', () => {
  expect(new Fraction(6n, -8n).toString()).toBe('-3/4');
  expect(() => new Fraction(1n, 0n)).toThrow('division by zero');
});

test('env.templates and env.operands: only the named problems, every number in [lo, hi]; bad values are named', () => {
  const settings = problemSettings({ templates: ['add', 'mul'], operands: [10, 99] });
  const problems = Array.from({ length: 300 }, (_, s) => problemFor(s, s % 2 ? 'train' : 'eval', settings));
  for (const p of problems) {
    expect(p.text).toMatch(/^(\w+ has \d+ marbles and finds \d+ more|A box holds \d+ pens)/);
    for (const n of p.text.match(/\d+/g)!) expect(Number(n)).toBeGreaterThanOrEqual(10);
    for (const n of p.text.match(/\d+/g)!) expect(Number(n)).toBeLessThanOrEqual(99);
    expect(calculate(p.steps[p.steps.length - 1]).equals(p.answer)).toBe(true);
  }
  expect(new Set(problems.map((p) => p.text.slice(0, 5))).size).toBeGreaterThan(2); // both kinds, several names
  // The default is every template with its own ranges, as before the settings existed.
  expect(problemFor(5, 'train', problemSettings({}))).toEqual(problemFor(5, 'train', problemSettings({ templates: undefined })));
  expect(() => problemSettings({ templates: ['add', 'pow'] })).toThrow('env.templates must be a non-empty list of add, mul');
  expect(() => problemSettings({ templates: [] })).toThrow('env.templates must be a non-empty list');
  expect(() => problemSettings({ operands: [0, 9] })).toThrow('env.operands must be [lo, hi], integers with 1 <= lo <= hi, got [0,9]');
  expect(() => problemSettings({ operands: [9, 2] })).toThrow('env.operands must be [lo, hi]');
  expect(() => problemSettings({ operands: 5 })).toThrow('env.operands must be [lo, hi]');
  // One problem in all: it is in one split, and the other has none (an error, not a loop forever).
  const one = problemSettings({ templates: ['mul'], operands: [3, 3], eval_fraction: 0.5 });
  const text = 'A box holds 3 pens. How many pens are in 3 boxes?';
  const [has, none] = splitOf(text, 0.5) === 'train' ? ['train', 'eval'] as const : ['eval', 'train'] as const;
  expect(problemFor(1, has, one).text).toBe(text);
  expect(() => problemFor(1, none, one)).toThrow(`no ${none} problem in 10000 draws`);
});
