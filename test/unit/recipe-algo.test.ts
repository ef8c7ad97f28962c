// The recipe's `algo` section (zod, agents/recipe.ts) mirrors AlgoConfig in gpu-services/contract.py: the same
// fields with the same defaults, and the same refusals with errors naming the field, before anything starts.
import { readFileSync } from 'node:fs';
import * as path from 'node:path';
import { loadRecipe, RecipeConfig, REPO_ROOT } from '../../agents/recipe';

const COPY = path.join(REPO_ROOT, 'recipes', 'copy');
const algo = (overrides: Record<string, string>) => loadRecipe(COPY, overrides).algo;

test('every AlgoConfig field of contract.schema.json is in the recipe schema, with the same default', () => {
  const file = path.join(REPO_ROOT, 'gpu-services', 'contract.schema.json');
  const schema = JSON.parse(readFileSync(file, 'utf8')).AlgoConfig;
  const defaults = RecipeConfig.shape.algo.parse({}) as Record<string, unknown>;
  expect(Object.keys(defaults).sort()).toEqual(Object.keys(schema.properties).sort());
  for (const [key, prop] of Object.entries<{ default?: unknown }>(schema.properties)) {
    expect([key, defaults[key]]).toEqual([key, prop.default ?? null]);
  }
});

test('reward_clip: a symmetric bound or a [low, high] range', () => {
  expect(algo({}).reward_clip).toBe(10);
  expect(algo({ 'algo.reward_clip': '3' }).reward_clip).toBe(3);
  expect(algo({ 'algo.reward_clip': '[-2,5]' }).reward_clip).toEqual([-2, 5]);
  expect(algo({ 'algo.advantage': 'flash_reinforce' }).advantage).toBe('flash_reinforce');
  expect(() => algo({ 'algo.reward_clip': '[5,1]' }))
    .toThrow('recipe config: algo.reward_clip: reward_clip [low, high] needs low < high');
  expect(() => algo({ 'algo.reward_clip': '0' })).toThrow(/recipe config: algo\.reward_clip: .*>0/);
});

test('rollout_correction: sequence gates and divergence gates need mode mask; low <= high', () => {
  // the schema's default is off, as in the original; the copy recipe sets token-level truncation
  expect(RecipeConfig.shape.algo.parse({}).rollout_correction).toEqual({ level: 'off', mode: 'mask', gate: 'ratio', low: 0.5, high: 5 });
  expect(algo({}).rollout_correction).toEqual({ level: 'token', mode: 'trunc', gate: 'ratio', low: 0.5, high: 2 });
  expect(algo({ 'algo.rollout_correction': '{"level":"geo","gate":"tv","high":0.1}' }).rollout_correction)
    .toEqual({ level: 'geo', mode: 'mask', gate: 'tv', low: 0.5, high: 0.1 });
  expect(algo({ 'algo.rollout_correction': '{"level":"token","mode":"clip"}' }).rollout_correction.mode).toBe('clip');
  expect(() => algo({ 'algo.rollout_correction': '{"level":"seq","mode":"clip"}' })).toThrow(
    "recipe config: algo.rollout_correction.mode: rollout_correction level 'seq' keeps or drops whole sequences and "
    + "weights each kept token by its own ratio: it needs mode 'mask', not 'clip'");
  expect(() => algo({ 'algo.rollout_correction': '{"level":"token","mode":"trunc","gate":"binary_kl"}' })).toThrow(
    "algo.rollout_correction.mode: rollout_correction gate 'binary_kl' keeps or drops tokens: it needs mode 'mask'");
  expect(() => algo({ 'algo.rollout_correction': '{"level":"token","low":2,"high":1}' })).toThrow(
    'algo.rollout_correction.low: rollout_correction needs low <= high, got low 2 and high 1');
});

test('loss_agg: token-mean by default; the Dr. GRPO mode needs its constant', () => {
  expect(algo({})).toMatchObject({ loss_agg: 'token-mean', loss_agg_tokens: null });
  expect(algo({ 'algo.loss_agg': 'seq-mean-token-mean' }).loss_agg).toBe('seq-mean-token-mean');
  expect(algo({ 'algo.loss_agg': 'seq-mean-token-sum-norm', 'algo.loss_agg_tokens': '64' }).loss_agg_tokens).toBe(64);
  expect(() => algo({ 'algo.loss_agg': 'seq-mean-token-sum-norm' })).toThrow(
    "recipe config: algo.loss_agg_tokens: loss_agg 'seq-mean-token-sum-norm' divides each sequence's token sum by a "
    + 'constant: set loss_agg_tokens');
  expect(() => algo({ 'algo.loss_agg': 'token-sum' })).toThrow(/recipe config: algo\.loss_agg: .*token-mean/);
});
