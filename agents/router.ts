// Picks an engine for each generate request of an episode session: a session's turns stay on one
// engine (its prefix cache stays warm), new sessions go to the engine with the fewest requests in
// flight, and a request that fails on one engine (unreachable or 5xx) is retried on another.
import { callService, ServiceError, type GenerateRequest, type GenerateResponse } from '../activities/gpu-client';

export class EngineRouter {
  private readonly inflight: Map<string, number>;
  private readonly affinity = new Map<string, string>(); // session -> engine URL

  constructor(readonly engines: string[], private readonly token: string) {
    if (engines.length === 0) throw new Error('EngineRouter: no engine URLs given');
    this.inflight = new Map(engines.map((e) => [e, 0]));
  }

  private leastLoaded(exclude: Set<string>): string | undefined {
    let best: string | undefined;
    for (const e of this.engines) {
      if (!exclude.has(e) && (best === undefined || this.inflight.get(e)! < this.inflight.get(best)!)) best = e;
    }
    return best;
  }

  async generate(session: string, body: GenerateRequest, signal?: AbortSignal): Promise<GenerateResponse> {
    const tried = new Set<string>();
    let engine = this.affinity.get(session) ?? this.leastLoaded(tried)!;
    for (;;) {
      const current = engine;
      tried.add(current);
      this.affinity.set(session, current);
      this.inflight.set(current, this.inflight.get(current)! + 1);
      try {
        return await callService<GenerateResponse>(current, '/generate', this.token,
          { body, request: 'GenerateRequest', response: 'GenerateResponse', signal });
      } catch (e) {
        const retryable = e instanceof ServiceError && (e.status === undefined || e.status >= 500);
        const next = retryable ? this.leastLoaded(tried) : undefined;
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
