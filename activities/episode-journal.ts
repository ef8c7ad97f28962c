// The journal of one episode's LLM calls, kept in the trajectory store so that a rollout worker
// can die at any point and the retried activity resumes the episode token-exactly (DESIGN.md
// "Durability, by crash", invariants 1 and 4).
//
// Every engine call of the episode (Env form: the framework's turns; ChatAgent form: what the
// loopback server asked for) goes through `generate`. The journal records each answered call, and
// the call in progress as its sampled ids so far (tokens, logprobs, versions), saved every
// `every.tokens` sampled tokens or `every.seconds` seconds, whichever comes first. The engine streams
// the call's tokens over the router as it samples them; one that dies mid-stream is left, and the
// call goes on from the ids that arrived on another engine.
//
// On the retry the episode's agent runs again from the start. Its k-th call is answered from the
// journal when it asks for exactly the same prompt ids (sha256) as the k-th recorded call: calls are
// keyed by their order, so an agent that asks the same thing twice on purpose gets both of its
// recorded samples back, in order. The call that was in progress continues on the engine from its
// saved ids. An agent that asks something else than before (it is not deterministic) gets fresh
// generations from that call on.
//
// Calls to the recipe's other pools (a judge, a teacher: `pool`) are journaled the same way, apart from the
// policy's and per pool: the k-th call to a pool is answered from the journal if it asks the same as before.
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { ServiceError, type GenerateChunk, type GenerateRequest, type GenerateResponse } from './gpu-client';
import { writeFileAtomic } from './store';
import { deriveSeed } from '../agents/env-runner';

interface Sampled { token_ids: number[]; logprobs: number[]; versions: number[] }
interface RecordedCall extends Sampled {
  prompt: string; // sha256 of the prompt ids
  finish_reason: GenerateResponse['finish_reason'];
  routed_experts?: GenerateResponse['routed_experts'];
}
export interface JournalFile {
  calls: RecordedCall[]; // answered calls, in order
  // the call in progress: what it has sampled so far
  current: (Sampled & { prompt: string; routed_experts?: RecordedCall['routed_experts'] }) | null;
  pools?: Record<string, ({ request: string; reply: unknown } | null)[]>; // per pool, its answered calls in order
}
// The engine, bound to the episode's router session: streams when given onChunk (see EngineRouter).
export type EngineCall = (body: GenerateRequest, onChunk?: (chunk: GenerateChunk) => boolean)
  => Promise<GenerateResponse>;

export function journalKey(runId: string, group: number, episode: number): string {
  return `${runId}/partials/g${group}/e${episode}.json`;
}

export function readJournal(storeRoot: string, key: string): JournalFile | null {
  const file = path.join(storeRoot, key);
  if (!fs.existsSync(file)) return null;
  try {
    const j = JSON.parse(fs.readFileSync(file, 'utf8')) as JournalFile;
    if (!Array.isArray(j.calls)) throw new Error('no calls list');
    return j;
  } catch (e) {
    // A journal is only a saving of work: a broken one costs regeneration, never correctness.
    console.warn(`episode journal ${key} is unreadable (${(e as Error).message}); the episode starts over`);
    return null;
  }
}

const promptHash = (ids: number[]) => createHash('sha256').update(Int32Array.from(ids)).digest('hex');

export class EpisodeJournal {
  readonly recorded: JournalFile = { calls: [], current: null };
  readonly stats = { replayedCalls: 0, resumedTokens: 0, generatedTokens: 0, replayedPoolCalls: 0 };
  private replay: RecordedCall[];
  private readonly poolReplay: NonNullable<JournalFile['pools']>;
  private resume: JournalFile['current'];
  private saving: Promise<void> = Promise.resolve();
  private saveQueued = false;
  private lastSave = { tokens: 0, at: Date.now() };
  private savedTokens = 0;
  private saveTimer: NodeJS.Timeout | undefined; // the deferred save of a finished call
  private onDisk: boolean; // a journal file exists (this one's, or a previous attempt's)

  constructor(
    private readonly storeRoot: string,
    readonly key: string,
    previous: JournalFile | null,
    private readonly every: { tokens: number; seconds: number }, // save the call in progress this often
    private readonly onSaved: () => void, // e.g. heartbeat the manifest
  ) {
    this.replay = previous?.calls ?? [];
    this.resume = previous?.current ?? null;
    this.poolReplay = previous?.pools ?? {};
    this.onDisk = previous !== null || fs.existsSync(path.join(storeRoot, key));
  }

  // One call to another pool. Its place is taken when it starts, so concurrent calls keep the order the
  // agent made them in; a request unlike the recorded one is asked, and nothing after it replays.
  async pool<T>(pool: string, request: object, call: () => Promise<T>): Promise<T> {
    const key = createHash('sha256').update(JSON.stringify(request)).digest('hex');
    const done = ((this.recorded.pools ??= {})[pool] ??= []);
    const index = done.push(null) - 1;
    const old = this.poolReplay[pool]?.[index];
    if (old?.request === key) {
      this.stats.replayedPoolCalls++;
      return (done[index] = old).reply as T;
    }
    if (old) this.poolReplay[pool] = []; // the agent went another way (null: a call that was never answered)
    const reply = await call();
    done[index] = { request: key, reply };
    await this.save();
    return reply;
  }

  // One engine call of the episode. onToken (the loopback server's session) sees each sampled id as
  // it arrives, replayed and resumed ones included; true back ends the call after that id ("stop").
  async generate(body: GenerateRequest, engine: EngineCall, onToken?: (id: number) => boolean): Promise<GenerateResponse> {
    const prompt = promptHash(body.prompt_token_ids);
    const index = this.recorded.calls.length;
    if (index < this.replay.length) {
      const old = this.replay[index];
      if (old.prompt === prompt) {
        this.recorded.calls.push(old);
        this.stats.replayedCalls++;
        for (const id of old.token_ids) if (onToken?.(id)) break;
        const { prompt: _, ...reply } = old;
        return { request_id: `journal-${index}`, ...reply };
      }
      this.replay = []; // the agent went another way: nothing after this point can be replayed
      this.resume = null;
    }
    const routedCall = body.return_routed_experts === true;
    const current: NonNullable<JournalFile['current']> = { prompt, token_ids: [], logprobs: [], versions: [] };
    if (routedCall) current.routed_experts = [];
    this.recorded.current = current;
    let stopped = false; // onToken ended the call
    const take = (id: number, logprob: number, version: number, routed?: number[][]) => {
      current.token_ids.push(id);
      current.logprobs.push(logprob);
      current.versions.push(version);
      if (routed) current.routed_experts!.push(routed);
      return (stopped = onToken?.(id) ?? false);
    };
    // A partial of a call with routed experts resumes only if it kept them.
    const resumed = this.resume;
    this.resume = null;
    if (index === this.replay.length && resumed?.prompt === prompt && (!routedCall || resumed.routed_experts)) {
      this.stats.resumedTokens += resumed.token_ids.length;
      const { token_ids: ids, logprobs, versions, routed_experts: routed } = resumed;
      ids.some((id, i) => take(id, logprobs[i], versions[i], routed?.[i]));
    }

    const maxTokens = body.sampling.max_tokens;
    const stopIds = new Set(body.sampling.stop_token_ids);

    let finish: GenerateResponse['finish_reason'] = 'length';
    try {
      for (;;) {
        const have = current.token_ids.length;
        if (stopped || (have && stopIds.has(current.token_ids[have - 1]))) { // resumed right after a stop
          finish = 'stop';
          break;
        }
        if (have >= maxTokens) { finish = 'length'; break; }
        // The first part keeps the caller's seed; a continuation draws its own stream from it.
        const { seed: first } = body.sampling;
        const seed = first === undefined || have === 0 ? first : deriveSeed(first, have);
        let arrived = 0;
        // Streamed only when someone reads the tokens as they come (the loopback server) or the call can
        // sample more than a save interval's tokens: a short call (an Env turn of a few dozen tokens) is
        // one plain reply, not a JSON line per decode step to write, parse and check at both ends.
        const stream = onToken !== undefined || maxTokens - have > this.every.tokens;
        // Streamed for the saves alone, the tokens come in chunks of a quarter of the save interval: a chunk per
        // decode step cost the engine's event loop and this process more CPU than the tiny model's decode.
        const chunk = stream && onToken === undefined ? { stream_chunk: Math.ceil(this.every.tokens / 4) } : {};
        try {
          const res = await engine({
            ...body, ...chunk,
            prompt_token_ids: [...body.prompt_token_ids, ...current.token_ids],
            sampling: { ...body.sampling, max_tokens: maxTokens - have, ...(seed === undefined ? {} : { seed }) },
          }, stream ? (chunk) => {
            for (const [i, id] of chunk.token_ids.entries()) {
              arrived++;
              this.stats.generatedTokens++;
              if (take(id, chunk.logprobs[i], chunk.versions[i], chunk.routed_experts?.[i])) return true;
            }
            if (!routedCall) this.saveIfDue();
            return false;
          } : undefined);
          // An engine call that did not stream hands over its ids here (a chunk's schema check does not see them).
          if (res.logprobs.length !== res.token_ids.length || res.versions.length !== res.token_ids.length) {
            throw new ServiceError(`engine returned ${res.token_ids.length} tokens but ${res.logprobs.length} logprobs and ${res.versions.length} versions`);
          }
          for (let i = arrived; i < res.token_ids.length && !stopped; i++) {
            this.stats.generatedTokens++;
            take(res.token_ids[i], res.logprobs[i], res.versions[i], res.routed_experts?.[i]);
          }
          finish = stopped ? 'stop' : res.finish_reason;
          break;
        } catch (e) {
          // The engine died mid-stream: go on from the ids that arrived (the router picks another).
          const retryable = e instanceof ServiceError && (e.status === undefined || e.status >= 500);
          if (!(retryable && arrived > 0 && !stopped)) throw e;
        }
      }
    } catch (e) {
      await this.save().catch(() => undefined); // keep what was sampled for the retry
      throw e;
    }
    const { prompt: _, routed_experts: routed, ...sampled } = current;
    const reply = { ...sampled, finish_reason: finish, ...(routed ? { routed_experts: routed } : {}) };
    this.recorded.calls.push({ prompt, ...reply });
    this.recorded.current = null;
    await this.saveFinishedCall();
    return { request_id: `journal-${index}`, ...reply };
  }

  // The call in progress is saved every `every.tokens` sampled tokens or `every.seconds` seconds,
  // whichever comes first (a slow engine loses seconds of work, not a token count's worth).
  private saveIfDue(): void {
    const tokens = this.sampled();
    const due = tokens - this.lastSave.tokens >= this.every.tokens
      || (tokens > this.lastSave.tokens && Date.now() - this.lastSave.at >= this.every.seconds * 1000);
    if (!due) return;
    this.lastSave = { tokens, at: Date.now() };
    void this.save().catch(() => undefined); // a failed save surfaces at the next awaited one
  }

  // A finished call is saved at once only when every.tokens were sampled since the last save; else
  // every.seconds later, unless the episode is over by then. So an episode of one short call (most Env
  // episodes) reaches the store without its journal ever being written (a write with two fsyncs, then
  // an unlink, per episode), and a crash still loses no more than one save interval of work.
  private async saveFinishedCall(): Promise<void> {
    if (this.sampled() - this.lastSave.tokens >= this.every.tokens) {
      this.lastSave = { tokens: this.sampled(), at: Date.now() };
      return this.save();
    }
    this.saveTimer ??= setTimeout(() => {
      this.saveTimer = undefined;
      void this.save().catch(() => undefined); // a failed save surfaces at the next awaited one
    }, this.every.seconds * 1000).unref();
  }

  // Saves are serialized and coalesced: at most one queued behind the one being written, and that
  // one writes the journal as it is when it starts.
  save(): Promise<void> {
    if (!this.saveQueued) {
      this.saveQueued = true;
      this.saving = this.saving.then(async () => {
        this.saveQueued = false;
        this.onDisk = true;
        const [text, tokens] = [JSON.stringify(this.recorded), this.sampled()]; // tokens keep arriving while it is written
        await writeFileAtomic(path.join(this.storeRoot, this.key), text);
        this.savedTokens = tokens;
        this.onSaved();
      });
    }
    return this.saving;
  }

  // Once the episode is in the store (or failed for good) its journal is only clutter: half the files
  // of a run's folder were journals of finished episodes. Losing it early would cost regeneration only.
  async discard(): Promise<void> {
    clearTimeout(this.saveTimer);
    await this.saving.catch(() => undefined);
    if (this.onDisk) await fs.promises.rm(path.join(this.storeRoot, this.key), { force: true });
  }

  // Sampled tokens of the journal as saved: answered calls plus the call in progress.
  tokens(): number {
    return this.savedTokens;
  }

  private sampled(): number {
    return this.recorded.calls.reduce((n, c) => n + c.token_ids.length, 0) + (this.recorded.current?.token_ids.length ?? 0);
  }
}
