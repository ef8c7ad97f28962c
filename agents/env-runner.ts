// The framework's LLM loop for Env agents: one episode, token-exact.
//
// The trajectory is built only from token ids: observations are tokenized once and appended
// (loss_mask 0, logprob 0, version -1); the engine's sampled ids are appended as returned, with
// their logprobs and versions (loss_mask 1). Sampled text is decoded only to show the env its
// action, never re-encoded (invariant 1).
//
// MoE routing replay (routedExperts): each sampled token also keeps the experts the engine routed it
// through ([layers][top_k], from the forward that produced its logits); observation tokens, and sampled
// tokens the engine returned no routing for, get -1 rows: the actor routes those itself, and with
// replay on it masks such sampled tokens from the loss rather than guess their experts.
import { ServiceError, type GenerateRequest, type GenerateResponse } from '../activities/gpu-client';
import type { Trajectory } from '../activities/store';
import type { ProcessImageFn } from './chat-session';
import { encodeWithImages } from './chat-template';
import type { Env, EnvTask } from './contract';
import type { SamplingConfig } from './recipe';
import type { TextTokenizer } from './tokenizer';

// An error raised by the env itself (reset/step threw or returned nonsense): the episode fails,
// its group goes on. Any other error (an engine that cannot be reached) fails the activity.
export class AgentError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = 'AgentError';
  }
}

// A deterministic 31-bit seed from integers (FNV-1a over their 32-bit words), so the same
// (run seed, group, episode, turn) always asks the engine for the same random stream.
export function deriveSeed(...parts: number[]): number {
  let h = 0x811c9dc5;
  for (const p of parts) {
    let x = p | 0;
    for (let i = 0; i < 4; i++, x >>>= 8) h = Math.imul(h ^ (x & 0xff), 0x01000193);
  }
  return (h >>> 0) & 0x7fffffff;
}

export type EpisodeFinish = 'terminated' | 'truncated' | 'context';

export interface EpisodeInput {
  env: Env;
  task: EnvTask;
  tokenizer: TextTokenizer;
  generate: (body: GenerateRequest) => Promise<GenerateResponse>; // bound to this episode's session
  sampling: SamplingConfig;
  maxContext: number; // most tokens in the whole sequence
  runSeed: number;
  routedExperts?: boolean; // ask the engine for each sampled token's experts and store them (algo.routing_replay)
  processImage?: ProcessImageFn; // vision-language policies: an observation's image processed and stored once
}

export interface EpisodeResult {
  trajectory: Trajectory;
  reward: number; // sum of step rewards
  finish: EpisodeFinish;
  turns: number;
  metrics: Record<string, number>; // summed over the steps' `metrics`
}

async function envCall<T>(what: string, call: () => T | Promise<T>): Promise<T> {
  try {
    return await call();
  } catch (e) {
    throw new AgentError(`env ${what} threw: ${(e as Error)?.message ?? e}`, { cause: e });
  }
}

export async function runEnvEpisode(input: EpisodeInput): Promise<EpisodeResult> {
  const { env, task, tokenizer, maxContext } = input;
  const t: Trajectory = { tokens: [], logprobs: [], versions: [], lossMask: [] };
  const routes: (number[][] | null)[] = []; // aligned with t.tokens: a sampled token's experts, null where none
  const images: string[] = []; // the trajectory's processed images, in placeholder order
  const appendObservation = (ids: number[]) => {
    for (const id of ids) { t.tokens.push(id); t.logprobs.push(0); t.versions.push(-1); t.lossMask.push(0); routes.push(null); }
  };
  const end = (finish: EpisodeFinish, turns: number): EpisodeResult => {
    const shape = routes.find((r) => r !== null); // [layers][top_k] of any record; none: nothing to store
    if (input.routedExperts && shape) t.routedExperts = routes.map((r) => r ?? shape.map((layer) => layer.map(() => -1)));
    if (images.length) t.images = images;
    return { trajectory: t, reward, finish, turns, metrics };
  };

  // An observation's ids, its images expanded to their placeholder counts; a bad image fails the episode.
  const observe = async (text: string, images: unknown, what: string): Promise<{ ids: number[]; paths: string[] }> => {
    if (images !== undefined && (!Array.isArray(images) || images.some((x) => typeof x !== 'string'))) {
      throw new AgentError(`env ${what}: images must be a list of base64 image files`);
    }
    const stored = [];
    for (const [k, data] of ((images ?? []) as string[]).entries()) {
      if (!input.processImage) throw new AgentError(`env ${what}: images[${k}]: the policy takes no images here`);
      stored.push(await input.processImage(data).catch((e) => {
        const bad = e instanceof ServiceError && e.status === 400; // the image, not the engine
        throw bad ? new AgentError(`env ${what}: images[${k}]: ${e.message}`, { cause: e }) : e;
      }));
    }
    try {
      return { ids: encodeWithImages(tokenizer, text, stored.map((s) => s.tokens), `env ${what}: the observation`),
        paths: stored.map((s) => s.path) };
    } catch (e) {
      throw new AgentError((e as Error).message);
    }
  };
  const first = await envCall('reset', () => env.reset(task));
  if (typeof first?.observation !== 'string') throw new AgentError('env reset must return { observation: string }');
  const bos = tokenizer.config.add_bos_token ? tokenizer.tokenId(String(tokenizer.config.bos_token)) : undefined;
  const obs = await observe(first.observation, first.images, 'reset');
  appendObservation([...(bos === undefined ? [] : [bos]), ...obs.ids]);
  images.push(...obs.paths);
  if (t.tokens.length === 0) throw new AgentError('env reset returned an empty observation: nothing to generate from');
  if (t.tokens.length >= maxContext) throw new AgentError(`the first observation is ${t.tokens.length} tokens, max_context is ${maxContext}`);

  let reward = 0;
  const metrics: Record<string, number> = {};
  let overrides: Partial<SamplingConfig> = {};
  for (let turn = 0; ; turn++) {
    if (t.tokens.length >= maxContext) return end('context', turn);
    const sampling = { ...input.sampling, ...overrides };
    const action: number[] = [];
    // An engine aborted mid-turn (pause with mode abort) returns what it sampled so far: keep it
    // and continue from the accumulated ids (partial rollout).
    for (let attempt = 0, idleAborts = 0; ; attempt++) {
      const maxTokens = Math.min(sampling.max_tokens - action.length, maxContext - t.tokens.length);
      const res = await input.generate({
        prompt_token_ids: [...t.tokens],
        sampling: {
          max_tokens: maxTokens, temperature: sampling.temperature, top_p: sampling.top_p, top_k: sampling.top_k,
          stop_token_ids: sampling.stop_token_ids,
          seed: deriveSeed(input.runSeed, task.groupIndex, task.episode, turn, attempt),
        },
        ...(input.routedExperts ? { return_routed_experts: true } : {}),
        ...(images.length ? { images: [...images] } : {}),
      });
      if (res.logprobs.length !== res.token_ids.length || res.versions.length !== res.token_ids.length) {
        throw new Error(`engine returned ${res.token_ids.length} tokens but ${res.logprobs.length} logprobs and ${res.versions.length} versions`);
      }
      res.token_ids.forEach((id, i) => {
        t.tokens.push(id); t.logprobs.push(res.logprobs[i]); t.versions.push(res.versions[i]); t.lossMask.push(1);
        routes.push(res.routed_experts?.[i] ?? null);
      });
      action.push(...res.token_ids);
      if (res.finish_reason !== 'abort' || action.length >= sampling.max_tokens || t.tokens.length >= maxContext) break;
      idleAborts = res.token_ids.length ? 0 : idleAborts + 1;
      if (idleAborts >= 3) throw new Error('engine aborted the request three times without sampling a token');
    }

    const result = await envCall('step', () => env.step({ text: tokenizer.decode(action), tokenIds: action }));
    if (typeof result?.reward !== 'number' || !Number.isFinite(result.reward)) {
      throw new AgentError(`env step must return a finite numeric reward, got ${JSON.stringify(result?.reward)}`);
    }
    reward += result.reward;
    for (const [k, v] of Object.entries(result.metrics ?? {})) if (Number.isFinite(v)) metrics[k] = (metrics[k] ?? 0) + v;
    if (result.terminated) return end('terminated', turn + 1);
    if (result.truncated) return end('truncated', turn + 1);
    if (result.observation) {
      const { ids, paths } = await observe(result.observation, result.images, 'step');
      // No room for the observation and a reply: the episode ends here.
      if (t.tokens.length + ids.length >= maxContext) return end('context', turn + 1);
      appendObservation(ids);
      images.push(...paths);
    }
    overrides = result.sampling ?? {};
  }
}
