// Picks an engine for each generate request of an episode session: a session's turns stay on one
// engine (its prefix cache stays warm), new sessions go to the engine with the fewest requests in
// flight, and a request that fails on one engine (unreachable or 5xx) is retried on another.
//
// An engine that failed is out of rotation until it rejoins: it is probed (at most once a second)
// and takes traffic again once it answers /health at a weight version no older than the other
// live engines' — a restarted engine comes back at version 0 and must first be refit (the refit
// activity pushes to every engine not at the run's version), or its tokens would be stale.
import { callService, ServiceError, type EngineHealth, type GenerateRequest, type GenerateResponse } from '../activities/gpu-client';

const PROBE_INTERVAL_MS = 1_000;

export class EngineRouter {
  private readonly inflight: Map<string, number>;
  private readonly affinity = new Map<string, string>(); // session -> engine URL
  private readonly down = new Map<string, number>(); // engine out of rotation -> time of its last probe (ms)
  private probing: Promise<void> | null = null;

  constructor(readonly engines: string[], private readonly token: string) {
    if (engines.length === 0) throw new Error('EngineRouter: no engine URLs given');
    this.inflight = new Map(engines.map((e) => [e, 0]));
  }

  private leastLoaded(exclude: Set<string>): string | undefined {
    let best: string | undefined;
    for (const e of this.engines) {
      if (!exclude.has(e) && !this.down.has(e) && (best === undefined || this.inflight.get(e)! < this.inflight.get(best)!)) best = e;
    }
    return best;
  }

  // Probes the engines out of rotation (one probe round at a time, shared by concurrent requests).
  private async probeDown(): Promise<void> {
    const due = [...this.down].filter(([, last]) => Date.now() - last >= PROBE_INTERVAL_MS).map(([e]) => e);
    if (due.length === 0) return;
    this.probing ??= (async () => {
      for (const e of due) this.down.set(e, Date.now());
      const health = async (e: string) => callService<EngineHealth>(e, '/health', this.token, { response: 'EngineHealth' }).catch(() => null);
      const live = await Promise.all(this.engines.filter((e) => !this.down.has(e)).map(health));
      const newest = Math.max(0, ...live.flatMap((h) => (h ? [h.version] : [])));
      for (const e of due) {
        const h = await health(e);
        if (h && h.version >= newest) this.down.delete(e); // caught up: back in rotation
      }
    })().finally(() => { this.probing = null; });
    await this.probing;
  }

  async generate(session: string, body: GenerateRequest, signal?: AbortSignal): Promise<GenerateResponse> {
    await this.probeDown();
    const tried = new Set<string>();
    const pinned = this.affinity.get(session);
    let engine = pinned !== undefined && !this.down.has(pinned) ? pinned : this.leastLoaded(tried);
    if (engine === undefined) throw new ServiceError(`no engine in rotation: ${this.engines.join(', ')} all failed and have not rejoined`);
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
        if (retryable && !signal?.aborted) this.down.set(current, Date.now());
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
