// Partial rollouts across refits. N long generations run on a real engine while the actor pushes
// new weights to it R times. Pause mode keep holds them across each push and they continue on the
// new weights (nothing sampled is lost); pause mode abort ends them with finish_reason 'abort', and
// the baseline — a loop without partial rollouts — regenerates each from scratch, so every token
// sampled before the abort is discarded.
import { callService, type EngineHealth, type GenerateResponse } from '../activities/gpu-client';
import type { RecipeConfig } from '../agents/recipe';
import type { Stack } from '../infra/stack';
import { withStack } from './loops';

export interface PartialOptions { requests: number; maxTokens: number; refits: number; intervalMs: number }

export interface PartialResult {
  mode: 'keep' | 'abort';
  refits: number; // pushes that happened while generations were in flight
  usefulTokens: number; // tokens of the finished generations
  discardedTokens: number; // tokens sampled, then thrown away by an abort
  regenerated: number; // generations started again from scratch
  maxVersionsInOne: number; // most weight versions seen within one finished generation
  seconds: number;
}

// Both modes, one after the other on one stack (the versions keep counting up).
export async function partialRollouts(config: RecipeConfig, o: PartialOptions): Promise<PartialResult[]> {
  return withStack(config, false, async (stack) => [await acrossRefits(stack, 'keep', o), await acrossRefits(stack, 'abort', o)]);
}

async function acrossRefits(stack: Stack, mode: 'keep' | 'abort', o: PartialOptions): Promise<PartialResult> {
  const { token } = stack;
  const engine = stack.engines[0];
  let version = (await callService<EngineHealth>(engine, '/health', token, { response: 'EngineHealth' })).version;
  let discardedTokens = 0;
  let regenerated = 0;
  let finished = false;
  const generate = async (i: number): Promise<GenerateResponse> => {
    const prompt = [256, ...Buffer.from(`copy ${String.fromCharCode(97 + (i % 26))}>`)]; // BOS + bytes
    for (;;) {
      const res = await callService<GenerateResponse>(engine, '/generate', token, {
        body: { prompt_token_ids: prompt, sampling: { max_tokens: o.maxTokens, temperature: 1.0, top_p: 1.0, top_k: 0, stop_token_ids: [], seed: i } },
        request: 'GenerateRequest', response: 'GenerateResponse',
      });
      if (res.finish_reason !== 'abort') return res;
      discardedTokens += res.token_ids.length;
      regenerated++;
    }
  };
  const started = performance.now();
  const all = Promise.all(Array.from({ length: o.requests }, (_, i) => generate(i))).finally(() => { finished = true; });
  let refits = 0;
  while (refits < o.refits && !finished) {
    await new Promise((r) => setTimeout(r, o.intervalMs));
    if (finished) break;
    await callService(engine, '/pause', token, { body: { mode }, request: 'PauseRequest' });
    await callService(stack.actor, '/push_weights', token, {
      body: { engines: [{ url: engine }], version: ++version }, request: 'PushWeightsRequest', response: 'PushWeightsResponse',
    });
    await callService(engine, '/resume', token, { body: {} });
    refits++;
  }
  const results = await all;
  return {
    mode, refits, discardedTokens, regenerated, seconds: (performance.now() - started) / 1000,
    usefulTokens: results.reduce((n, r) => n + r.token_ids.length, 0),
    maxVersionsInOne: Math.max(...results.map((r) => new Set(r.versions).size)),
  };
}
