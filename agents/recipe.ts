// The recipe config: one zod schema, checked before anything starts. A recipe is a folder with
// recipe.json (this schema) and the agent module it names (exports `AgentRunner`).
import { existsSync, readdirSync, readFileSync, statSync } from 'node:fs';
import * as path from 'node:path';
import { z } from 'zod';
import { LIVE_SETTINGS, stepTooLarge } from './live-settings';

const sampling = z.strictObject({
  max_tokens: z.number().int().positive().describe('tokens sampled per turn at most'),
  temperature: z.number().min(0).default(1).describe('sampling temperature (0 = greedy)'),
  top_p: z.number().gt(0).max(1).default(1)
    .describe('nucleus sampling: the likeliest tokens holding this much probability'),
  top_k: z.number().int().min(0).default(0).describe('sample among the k likeliest tokens (0 = all)'),
  stop_token_ids: z.array(z.number().int()).default([]).describe('token ids that end a turn'),
});

// Mirrors AlgoConfig in gpu-services/contract.py (the actor validates it again).
const algo = z.strictObject({
  advantage: z.enum([
    'grpo', 'dr_grpo', 'rloo', 'reinforce_baseline', 'reinforce++', 'on_policy_distill', 'flash_reinforce',
  ]).default('grpo').describe('advantage estimator (gpu-services/algorithm.py)'),
  policy_loss: z.enum(['ppo', 'gspo', 'cispo']).default('ppo')
    .describe('ppo: clip per token; gspo: clip per sequence; cispo: clipped importance weight, gradient kept'),
  lr: LIVE_SETTINGS['algo.lr'].default(1e-6).describe('learning rate (Adam); live: `set`'),
  betas: z.tuple([z.number(), z.number()]).default([0.9, 0.95]).describe('Adam betas'),
  weight_decay: z.number().min(0).default(0).describe('AdamW weight decay'),
  grad_clip: z.number().positive().default(1).describe('gradient norm clip'),
  clip_low: z.number().min(0).default(0.2).describe('PPO clip: ratio >= 1 - clip_low'),
  clip_high: z.number().min(0).default(0.2).describe('PPO clip: ratio <= 1 + clip_high'),
  dual_clip: z.number().gt(1).nullable().default(null).describe('dual clip bound for negative advantages (null = off)'),
  // Formulas in gpu-services/algorithm.py (rollout_correction); the same refusals as contract.py's RolloutCorrection.
  rollout_correction: z.strictObject({
    level: z.enum(['off', 'token', 'seq', 'geo']).default('off')
      .describe('engine/actor mismatch correction: off, per token, per sequence, geometric mean'),
    mode: z.enum(['mask', 'clip', 'trunc']).default('mask')
      .describe('a token out of range: masked, clipped or truncated'),
    gate: z.enum(['ratio', 'binary_kl', 'tv']).default('ratio')
      .describe('what keeps or drops: the ratio, binary KL, total variation'),
    low: z.number().default(0.5).describe('ratio gate: kept if low <= ratio'),
    high: z.number().default(5).describe('ratio gate: kept if ratio <= high; binary_kl and tv: kept if <= high'),
  }).superRefine((rc, ctx) => {
    const refuse = (path: string, message: string) => ctx.addIssue({ code: 'custom', path: [path], message });
    if ((rc.level === 'seq' || rc.level === 'geo') && rc.mode !== 'mask') {
      refuse('mode', `rollout_correction level '${rc.level}' keeps or drops whole sequences and weights each kept `
        + `token by its own ratio: it needs mode 'mask', not '${rc.mode}'`);
    } else if (rc.level !== 'off' && rc.gate !== 'ratio' && rc.mode !== 'mask') {
      refuse('mode', `rollout_correction gate '${rc.gate}' keeps or drops tokens: it needs mode 'mask', `
        + `not '${rc.mode}'`);
    }
    if (rc.gate === 'ratio' && !(rc.low <= rc.high)) {
      refuse('low', `rollout_correction needs low <= high, got low ${rc.low} and high ${rc.high}`);
    }
  }).default({ level: 'off', mode: 'mask', gate: 'ratio', low: 0.5, high: 5 }),
  max_staleness: z.number().int().min(0).nullable().default(null)
    .describe('tokens more versions behind the policy are masked or their group dropped (null = no limit)'),
  kl_estimator: z.enum(['k1', 'k2', 'k3']).default('k3').describe('KL estimator against the reference policy'),
  kl_coef: LIVE_SETTINGS['algo.kl_coef'].default(0).describe('KL penalty coefficient; live: `set`'),
  entropy_coef: LIVE_SETTINGS['algo.entropy_coef'].default(0).describe('entropy bonus coefficient; live: `set`'),
  gamma: z.number().min(0).max(1).default(1).describe('discount over the turns of an episode'),
  // c: rewards clamped to [-c, c]; [low, high]: to that range
  reward_clip: z.union([
    z.number().positive(),
    z.tuple([z.number(), z.number()]).refine(([low, high]) => low < high, 'reward_clip [low, high] needs low < high'),
  ]).default(10).describe('c: rewards clamped to [-c, c]; [low, high]: to that range'),
  // MoE: the engine records each sampled token's experts and the actor trains through them
  routing_replay: z.boolean().default(false).describe('MoE: the actor trains through the experts the engine chose'),
  micro_batch_tokens: z.number().int().positive().default(8192).describe('tokens per actor micro-batch (memory)'),
  // How the token losses add up to the step's loss (formulas in gpu-services/algorithm.py, loss_divisor);
  // seq-mean-token-sum-norm divides by a constant token budget per sequence, loss_agg_tokens (Dr. GRPO).
  loss_agg: z.enum(['token-mean', 'seq-mean-token-sum', 'seq-mean-token-mean', 'seq-mean-token-sum-norm'])
    .default('token-mean').describe('how token losses add up to the step loss'),
  loss_agg_tokens: z.number().int().positive().nullable().default(null)
    .describe('seq-mean-token-sum-norm: the constant token budget per sequence'),
}).superRefine((a, ctx) => {
  if (a.loss_agg === 'seq-mean-token-sum-norm' && a.loss_agg_tokens === null) {
    ctx.addIssue({
      code: 'custom', path: ['loss_agg_tokens'], message: "loss_agg 'seq-mean-token-sum-norm' divides each sequence's "
        + 'token sum by a constant: set loss_agg_tokens to the per-sequence token budget (Dr. GRPO uses the generation '
        + 'budget)',
    });
  }
});

export const RecipeConfig = z.strictObject({
  name: z.string().min(1).describe('recipe name; default run ids start with it'),
  agent: z.string().min(1).describe('agent module path, relative to the recipe folder'),
  model: z.string().min(1).describe('local HF model directory, or "tiny" for the generated tiny model'),
  init: z.string().min(1).optional()
    .describe('start from these weights: an HF model dir or a Molt checkpoint (model stays the architecture/tokenizer)'),
  seed: z.number().int().default(0).describe('run seed: tasks and sampling seeds derive from it'),
  group_size: z.number().int().positive().describe('episodes per prompt group (G)'),
  // The settings `molt-client set` may change on a running run are in agents/live-settings.ts.
  pool: z.strictObject({ inflight: LIVE_SETTINGS['pool.inflight'] }),
  batch: z.strictObject({ groups: LIVE_SETTINGS['batch.groups'] }),
  // async: groups keep generating while a step trains (tokens may be a few versions stale). sync: the
  // same activities with no overlap: generate one batch with the current weights, train, refit, repeat
  // (the baseline of bench/learning.ts, and a mode for debugging).
  loop: z.enum(['async', 'sync']).default('async')
    .describe('async: groups generate while a step trains; sync: no overlap'),
  // What to do with groups whose tokens exceed algo.max_staleness: mask those tokens, or drop the group.
  staleness_mode: z.enum(['mask', 'drop']).default('mask')
    .describe('tokens over algo.max_staleness: mask them, or drop the group'),
  train: z.strictObject({ steps: z.number().int().positive().describe('optimizer steps of the run') }),
  checkpoint: z.strictObject({ every: z.number().int().positive().describe('a checkpoint every this many steps') }),
  sampling,
  algo,
  engines: z.strictObject({
    count: z.number().int().positive().default(1).describe('rollout engines of a local stack'),
    backend: z.enum(['torch', 'vllm']).default('torch').describe('torch: reference engine (CPU, GPU); vllm'),
  }).default({ count: 1, backend: 'torch' }),
  // Engine pools beside the policy's (a judge, a teacher): other weights, started by the stack, routed like
  // the policy's engines, never refit. Episodes call them through `pools` (agents/contract.ts), journaled.
  pools: z.record(z.string().regex(/^[a-z][a-z0-9_-]*$/, 'a pool name is lowercase letters, digits, - or _')
    .refine((n) => n !== 'policy', "'policy' names the policy's own engines"), z.strictObject({
    model: z.string().min(1).describe('local HF model directory, or "tiny"'),
    count: z.number().int().positive().default(1).describe('engines of this pool in a local stack'),
    backend: z.enum(['torch', 'vllm']).default('torch').describe('torch: reference engine (CPU, GPU); vllm'),
  })).default({}).describe('further engine pools by name (judge, teacher): model, count, backend'),
  teacher: z.string().min(1).optional()
    .describe("on_policy_distill: the pool that scores every sampled token (its logprobs are the teacher's)"),
  actor: z.strictObject({
    world_size: z.number().int().positive().default(1).describe('actor ranks (torchrun, FSDP2)'),
    offload_optimizer: z.boolean().default(false).describe('optimizer state in CPU memory'),
  }).default({ world_size: 1, offload_optimizer: false }),
  max_context: z.number().int().positive().default(1024)
    .describe('tokens per trajectory at most (prompt and every turn)'),
  rollout: z.strictObject({
    // A group whose failed episodes (the agent threw, the engine refused) exceed this fraction of
    // group_size fails the run: a broken agent should stop a run, not train on what is left.
    max_failed_fraction: z.number().min(0).max(1).default(0.5)
      .describe('a group with more failed episodes than this fraction fails the run'),
    // The episode journal (activities/episode-journal.ts) saves the call in progress every this many
    // sampled tokens; a killed rollout worker regenerates at most this many tokens per unfinished episode,
    // and the tokens of one engine chunk (a quarter of it) more.
    partial_tokens: z.number().int().positive().default(64)
      .describe('the journal of an episode in progress is saved every this many sampled tokens'),
    // ... or every this many seconds, whichever comes first (a slow engine loses seconds of work).
    partial_seconds: z.number().positive().default(5).describe('... or every this many seconds'),
  }).default({ max_failed_fraction: 0.5, partial_tokens: 64, partial_seconds: 5 }),
  // Evaluation on held-out prompt groups (group indexes EVAL_GROUP_BASE + i, never trained), every
  // `every` steps (0 = never): per prompt one greedy episode (temperature 0) and `samples` sampled ones.
  eval: z.strictObject({
    every: z.number().int().min(0).default(0).describe('evaluate held-out prompts every this many steps (0 = never)'),
    prompts: z.number().int().positive().default(16).describe('held-out prompt groups per evaluation'),
    samples: z.number().int().positive().default(4).describe('sampled episodes per prompt (pass@n)'),
    greedy: z.boolean().default(true).describe('also one greedy episode per prompt'),
  }).default({ every: 0, prompts: 16, samples: 4, greedy: true }),
  // The SFT warm start (`molt-client sft`, workflows/sft-run.ts): demonstrations from a JSONL file of
  // {messages, tools?} lines, or from the agent module's demonstration(index, settings).
  sft: z.strictObject({
    data: z.string().min(1).optional()
      .describe('JSONL of {"messages": [...], "tools"?: [...]} per line, relative to the recipe folder '
        + '(default: the agent\'s demonstration())'),
    steps: z.number().int().positive().describe('SFT optimizer steps'),
    batch: z.number().int().positive().default(32).describe('demonstrations per SFT step'),
    lr: z.number().positive().default(1e-3).describe('SFT learning rate (Adam; betas, grad_clip from algo)'),
    checkpoint_every: z.number().int().positive().optional().describe('default: checkpoint.every'),
  }).optional().describe('SFT warm start (molt-client sft): its output checkpoint is an `init` for RL'),
  // Optional Weights & Biases logging of every step's metrics (activities/metrics.ts); WANDB_MODE and
  // WANDB_API_KEY in the control worker's environment apply as usual.
  wandb: z.strictObject({
    project: z.string().min(1),
    entity: z.string().min(1).optional(),
    mode: z.enum(['online', 'offline']).default('online').describe('offline: written under the run folder, `wandb sync` later'),
  }).nullable().default(null).describe('Weights & Biases logging (null = off)'),
  // What the run's folder in the store keeps (activities/store-gc.ts): at each checkpoint, trajectories
  // and step manifests of the steps inside it are deleted, except those of its last `keep_steps` steps.
  // The steps after the last checkpoint always stay: a restarted actor replays them from the store.
  store: z.strictObject({
    keep_steps: z.number().int().min(0).default(10).describe('trajectories of this many steps before the last checkpoint are kept'),
    keep_checkpoints: z.number().int().positive().nullable().default(null).describe('checkpoints kept, newest first (null = all)'),
  }).default({ keep_steps: 10, keep_checkpoints: null }),
  env: z.record(z.string(), z.unknown()).default({}).describe('free-form settings passed to the agent'),
}).superRefine((c, ctx) => {
  const tooLarge = stepTooLarge(c);
  if (tooLarge) ctx.addIssue({ code: 'custom', path: ['batch', 'groups'], message: tooLarge });
  if (c.teacher !== undefined && !(c.teacher in c.pools)) {
    ctx.addIssue({ code: 'custom', path: ['teacher'], message: `no pool named '${c.teacher}' in pools `
      + `(have: ${Object.keys(c.pools).join(', ') || 'none'})` });
  }
});
export type RecipeConfig = z.infer<typeof RecipeConfig>;
export type AlgoConfig = RecipeConfig['algo'];
export type SamplingConfig = RecipeConfig['sampling'];

// "tiny" names the generated tiny model that infra/bootstrap.sh writes; anything else is a local HF directory.
export const REPO_ROOT = path.resolve(__dirname, '..');
export function resolveModelDir(model: string): string {
  // the models made locally (infra/bootstrap.sh): a text policy and a vision-language one (recipes/geo)
  return model === 'tiny' || model === 'tiny-vlm' ? path.join(REPO_ROOT, '.molt', 'models', model) : path.resolve(model);
}

// Reads <recipeDir>/recipe.json, applies dotted overrides ({"algo.lr": "1e-6"}: values that look
// like numbers, booleans, null or JSON arrays/objects become those) and checks the result.
// Throws RecipeError naming the file or the field.
export class RecipeError extends Error {}
export function loadRecipe(recipeDir: string, overrides: Record<string, string> = {}): RecipeConfig {
  const file = path.join(path.resolve(recipeDir), 'recipe.json');
  let raw: Record<string, unknown>;
  try {
    raw = JSON.parse(readFileSync(file, 'utf8'));
  } catch (err) {
    throw new RecipeError(`recipe config: ${file}: ${(err as Error).message}`);
  }
  for (const [key, value] of Object.entries(overrides)) {
    const parts = key.split('.');
    let node = raw;
    for (const part of parts.slice(0, -1)) {
      if (typeof node[part] !== 'object' || node[part] === null) node[part] = {};
      node = node[part] as Record<string, unknown>;
    }
    node[parts[parts.length - 1]] = parseOverride(value);
  }
  const parsed = RecipeConfig.safeParse(raw);
  if (!parsed.success) {
    const issues = parsed.error.issues.map((i) => `${i.path.join('.') || '(root)'}: ${i.message.replace(/^Invalid input: /, '')}`);
    throw new RecipeError(`recipe config: ${issues.join('; ')}`);
  }
  if (parsed.data.sft?.data !== undefined) {
    parsed.data.sft.data = path.resolve(recipeDir, parsed.data.sft.data);
    if (!existsSync(parsed.data.sft.data)) {
      throw new RecipeError(`recipe config: sft.data: ${parsed.data.sft.data} does not exist`);
    }
  }
  for (const [name, pool] of Object.entries(parsed.data.pools)) {
    pool.model = resolveModelDir(pool.model); // absolute, as init: the stack may start elsewhere
    if (!existsSync(path.join(pool.model, 'config.json'))) {
      throw new RecipeError(`recipe config: pools.${name}.model: ${pool.model} is not a model directory (no config.json)`);
    }
  }
  if (parsed.data.init !== undefined) {
    parsed.data.init = path.resolve(parsed.data.init); // workers may run elsewhere: pass an absolute path
    checkInitDir(parsed.data.init, resolveModelDir(parsed.data.model));
  }
  return parsed.data;
}

// The config keys that fix the weights' names and shapes and the token ids' meaning: an init dir
// that differs from the model in one of them cannot be loaded, or would be read with another vocabulary.
const SHAPE_KEYS = ['model_type', 'architectures', 'vocab_size', 'hidden_size', 'num_hidden_layers',
  'num_attention_heads', 'num_key_value_heads', 'head_dim', 'intermediate_size', 'tie_word_embeddings'];
export function checkInitDir(init: string, modelDir: string): void {
  const readConfig = (dir: string) => JSON.parse(readFileSync(path.join(dir, 'config.json'), 'utf8')) as Record<string, unknown>;
  if (!existsSync(init) || !statSync(init).isDirectory()) throw new RecipeError(`init: ${init} is not a directory`);
  if (!existsSync(path.join(init, 'config.json'))) throw new RecipeError(`init: ${init} has no config.json`);
  if (!readdirSync(init).some((f) => f.endsWith('.safetensors'))) throw new RecipeError(`init: ${init} has no *.safetensors weights`);
  if (!existsSync(path.join(modelDir, 'config.json'))) return; // the model's own check names that
  const [got, want] = [readConfig(init), readConfig(modelDir)];
  const differ = SHAPE_KEYS.filter((k) => JSON.stringify(got[k]) !== JSON.stringify(want[k]))
    .map((k) => `${k} ${JSON.stringify(got[k])} (model: ${JSON.stringify(want[k])})`);
  if (differ.length) throw new RecipeError(`init: ${init} does not fit model ${modelDir}: ${differ.join(', ')}`);
}

function parseOverride(value: string): unknown {
  if (/^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$/.test(value)) return Number(value);
  if (value === 'true' || value === 'false') return value === 'true';
  if (value === 'null') return null;
  if (/^[[{]/.test(value)) {
    try { return JSON.parse(value); } catch { /* not JSON: keep the string */ }
  }
  return value;
}
