// Picks an engine for each generate request of an episode session: a session's turns stay on one
// engine (its prefix cache stays warm), new sessions go to the engine with the fewest requests in
// flight, and a request that fails on one engine (unreachable or 5xx) is retried on another.
//
// A hung engine (stopped, deadlocked, swapping) keeps its connections open and never answers, so
// every engine call has a deadline, and one that passes it fails over like a dead engine:
//   deadline = base + per_token * max_tokens, by default 60 s + 0.25 s per token
// (env MOLT_ENGINE_DEADLINE_S, MOLT_ENGINE_DEADLINE_PER_TOKEN_S). The base covers waiting in the
// engine's queue and a refit's pause (requests are held while the weights move); the per-token
// term allows a decode rate down to 4 tokens/s per sequence, far below any engine's rate, so only
// a hang reaches it. The journal asks in chunks of rollout.partial_tokens, so max_tokens is small.
//
// An engine that failed is out of rotation until it rejoins: it is probed (at most once a second)
// and takes traffic again once it answers /health at a weight version no older than the other
// live engines' — a restarted engine comes back at version 0 and must first be refit (the refit
// activity pushes to every engine not at the run's version), or its tokens would be stale.
//
// A run's engines change while it runs (`molt-client engines add|drain`): each call may name the
// engines it may use (a prompt group's, fixed when the group started); the default is the worker's.
import {
  callService, ServiceError, streamGenerate, type EngineHealth, type GenerateChunk, type GenerateRequest, type GenerateResponse,
  type ImageRequest, type ImageResponse,
} from '../activities/gpu-client';

const PROBE_INTERVAL_MS = 1_000;
const PROBE_TIMEOUT_MS = 5_000; // /health answers at once unless the engine hangs

export interface Deadline { baseMs: number; perTokenMs: number }
const envSeconds = (name: string, fallback: number): number => {
  const v = Number(process.env[name] ?? fallback);
  if (!(v > 0)) throw new Error(`${name}=${process.env[name]}: expected a number of seconds > 0`);
  return v * 1000;
};
export const defaultDeadline = (): Deadline => ({
  baseMs: envSeconds('MOLT_ENGINE_DEADLINE_S', 60), perTokenMs: envSeconds('MOLT_ENGINE_DEADLINE_PER_TOKEN_S', 0.25),
});

export class EngineRouter {
  private readonly inflight = new Map<string, number>(); // engine -> requests in flight (every engine seen)
  private readonly affinity = new Map<string, string>(); // session -> engine URL
  private readonly down = new Map<string, number>(); // engine out of rotation -> time of its last probe (ms)
  private probing: Promise<void> | null = null;

  constructor(
    readonly engines: string[], private readonly token: string, readonly deadline: Deadline = defaultDeadline(),
  ) {
    if (engines.length === 0) throw new Error('EngineRouter: no engine URLs given');
    for (const e of engines) this.inflight.set(e, 0);
  }

  private leastLoaded(exclude: Set<string>, pool: string[]): string | undefined {
    let best: string | undefined;
    for (const e of pool) {
      if (!exclude.has(e) && !this.down.has(e) && (best === undefined || this.inflight.get(e)! < this.inflight.get(best)!)) best = e;
    }
    return best;
  }

  // Probes the engines out of rotation (one probe round at a time, shared by concurrent requests).
  // Requests do not wait for it while some engine is in rotation: a hung engine's probe takes
  // PROBE_TIMEOUT_MS to fail.
  private async probeDown(): Promise<void> {
    const due = [...this.down].filter(([, last]) => Date.now() - last >= PROBE_INTERVAL_MS).map(([e]) => e);
    if (due.length === 0) return;
    this.probing ??= (async () => {
      for (const e of due) this.down.set(e, Date.now());
      const health = async (e: string) =>
        callService<EngineHealth>(e, '/health', this.token, { response: 'EngineHealth', timeoutMs: PROBE_TIMEOUT_MS })
          .catch(() => null);
      const live = await Promise.all([...this.inflight.keys()].filter((e) => !this.down.has(e)).map(health));
      const newest = Math.max(0, ...live.flatMap((h) => (h ? [h.version] : [])));
      await Promise.all(due.map(async (e) => {
        const h = await health(e);
        if (h && h.version >= newest) this.down.delete(e); // answers, and caught up: back in rotation
      }));
    })().finally(() => { this.probing = null; });
    await this.probing;
  }

  // With onChunk the reply is streamed (gpu-client streamGenerate); a failure after the first chunk is
  // not retried here: the caller has the tokens so far and continues from them.
  async generate(session: string, body: GenerateRequest, signal?: AbortSignal,
    onChunk?: (chunk: GenerateChunk) => boolean, pool = this.engines): Promise<GenerateResponse> {
    const timeoutMs = this.deadline.baseMs + this.deadline.perTokenMs * (body.sampling?.max_tokens ?? 0);
    return this.route(session, signal, pool, (engine, streamed) => (onChunk
      ? streamGenerate(engine, this.token, body, (c) => { streamed(); return onChunk(c); }, signal, timeoutMs)
      : callService<GenerateResponse>(engine, '/generate', this.token, {
        body, request: 'GenerateRequest', response: 'GenerateResponse', signal, timeoutMs,
      })));
  }

  // Teacher scoring (POST /score): the logprob of each of these ids given those before it.
  async score(session: string, tokenIds: number[], signal?: AbortSignal): Promise<number[]> {
    const res = await this.route(session, signal, this.engines, (engine) => callService<{ logprobs: number[] }>(engine, '/score',
      this.token, { body: { token_ids: tokenIds }, request: 'ScoreRequest', response: 'ScoreResponse', signal,
        timeoutMs: this.deadline.baseMs }));
    return res.logprobs;
  }

  // An image processed by the session's engine (POST /images) and stored content-addressed in body.dir.
  async image(session: string, body: ImageRequest, signal?: AbortSignal, pool = this.engines): Promise<ImageResponse> {
    return this.route(session, signal, pool, (engine) => callService<ImageResponse>(engine, '/images',
      this.token, { body, request: 'ImageRequest', response: 'ImageResponse', signal, timeoutMs: this.deadline.baseMs }));
  }

  // One call of a session on one of these engines, failed over to another on an unreachable or 5xx engine
  // (unless the call had streamed: then the caller continues from what arrived).
  private async route<T>(session: string, signal: AbortSignal | undefined, pool: string[],
    call: (engine: string, streamed: () => void) => Promise<T>): Promise<T> {
    for (const e of pool) if (!this.inflight.has(e)) this.inflight.set(e, 0);
    const probe = this.probeDown();
    if (pool.every((e) => this.down.has(e))) await probe; // nothing to route to before it
    const tried = new Set<string>();
    let reasked = false;
    const pinned = this.affinity.get(session);
    let engine = pinned !== undefined && pool.includes(pinned) && !this.down.has(pinned) ? pinned : this.leastLoaded(tried, pool);
    if (engine === undefined) throw new ServiceError(`no engine in rotation: ${pool.join(', ')} all failed and have not rejoined`);
    for (;;) {
      const current = engine;
      tried.add(current);
      const before = this.affinity.get(session);
      // A session that leaves its engine (failed, hung, gone) goes on elsewhere from its accumulated ids.
      if (before !== undefined && before !== current) console.warn(`router: session ${session} moved from ${before} to ${current}`);
      this.affinity.set(session, current);
      this.inflight.set(current, this.inflight.get(current)! + 1);
      let streamed = false;
      try {
        return await call(current, () => { streamed = true; });
      } catch (e) {
        const retryable = e instanceof ServiceError && (e.status === undefined || e.status >= 500);
        // A kept-alive connection the engine closed as we reused it (its idle timeout racing ours, a race a
        // loaded machine wins often): the engine is fine, ask it again once.
        if (retryable && e.code === 'UND_ERR_SOCKET' && !streamed && !reasked && !signal?.aborted) {
          reasked = true;
          continue;
        }
        if (retryable && !signal?.aborted) this.down.set(current, Date.now());
        const next = retryable && !streamed ? this.leastLoaded(tried, pool) : undefined;
        if (next === undefined) throw e;
        engine = next;
      } finally {
        this.inflight.set(current, this.inflight.get(current)! - 1);
      }
    }
  }

  engineFor(session: string): string | undefined {
    return this.affinity.get(session);
  }

  endSession(session: string): void {
    this.affinity.delete(session);
  }

  load(): Record<string, number> {
    return Object.fromEntries(this.inflight);
  }
}
