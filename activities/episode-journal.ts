// The journal of one episode's LLM calls, kept in the trajectory store so that a rollout worker
// can die at any point and the retried activity resumes the episode token-exactly (DESIGN.md
// "Durability, by crash", invariants 1 and 4).
//
// Every engine call of the episode (Env form: the framework's turns; ChatAgent form: what the
// loopback server asked for) goes through `generate`. The journal records each answered call, and
// the call in progress as its sampled ids so far (tokens, logprobs, versions), saved every
// `chunkTokens` sampled tokens. A generation is asked of the engine in chunks of that many tokens,
// over the router, so the partial is known without a streaming path through the router (which
// keeps placement and failover).
//
// On the retry the episode's agent runs again from the start. Its k-th call is answered from the
// journal when it asks for exactly the same prompt ids (sha256) as the k-th recorded call; the call
// that was in progress continues on the engine from its saved ids. An agent that asks something else
// than before (it is not deterministic) gets fresh generations from that call on.
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import type { GenerateRequest, GenerateResponse } from './gpu-client';
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
  current: (Sampled & { prompt: string }) | null; // the call in progress: what it has sampled so far
}

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
  readonly stats = { replayedCalls: 0, resumedTokens: 0, generatedTokens: 0 };
  private replay: RecordedCall[];
  private resume: JournalFile['current'];
  private saving: Promise<void> = Promise.resolve();
  private saveQueued = false;

  constructor(
    private readonly storeRoot: string,
    readonly key: string,
    previous: JournalFile | null,
    private readonly chunkTokens: number,
    private readonly onSaved: () => void, // e.g. heartbeat the manifest
  ) {
    this.replay = previous?.calls ?? [];
    this.resume = previous?.current ?? null;
  }

  // One engine call of the episode; `engine` is the router bound to the episode's session.
  async generate(body: GenerateRequest, engine: (body: GenerateRequest) => Promise<GenerateResponse>): Promise<GenerateResponse> {
    const prompt = promptHash(body.prompt_token_ids);
    const index = this.recorded.calls.length;
    if (index < this.replay.length) {
      const old = this.replay[index];
      if (old.prompt === prompt) {
        this.recorded.calls.push(old);
        this.stats.replayedCalls++;
        const { prompt: _, ...reply } = old;
        return { request_id: `journal-${index}`, ...reply };
      }
      this.replay = []; // the agent went another way: nothing after this point can be replayed
      this.resume = null;
    }
    const current = { prompt, token_ids: [] as number[], logprobs: [] as number[], versions: [] as number[] };
    if (index === this.replay.length && this.resume?.prompt === prompt) {
      Object.assign(current, structuredClone(this.resume));
      this.stats.resumedTokens += current.token_ids.length;
    }
    this.resume = null;
    this.recorded.current = current;

    const maxTokens = body.sampling.max_tokens;
    const stopIds = new Set(body.sampling.stop_token_ids);
    let finish: GenerateResponse['finish_reason'] = 'length';
    let routed: GenerateResponse['routed_experts'];
    try {
      // Routed experts come back whole, not per chunk: such a call is journaled only once answered.
      const chunk = body.return_routed_experts ? maxTokens : this.chunkTokens;
      for (;;) {
        const have = current.token_ids.length;
        const last = current.token_ids[have - 1];
        if (have && stopIds.has(last)) { finish = 'stop'; break; } // resumed right after the stop token
        if (have >= maxTokens) { finish = 'length'; break; }
        const want = Math.min(chunk, maxTokens - have);
        // The first part keeps the caller's seed; later parts draw their own stream from it.
        const seed = body.sampling.seed === undefined || have === 0 ? body.sampling.seed : deriveSeed(body.sampling.seed, have);
        const res = await engine({
          ...body,
          prompt_token_ids: [...body.prompt_token_ids, ...current.token_ids],
          sampling: { ...body.sampling, max_tokens: want, ...(seed === undefined ? {} : { seed }) },
        });
        current.token_ids.push(...res.token_ids);
        current.logprobs.push(...res.logprobs);
        current.versions.push(...res.versions);
        this.stats.generatedTokens += res.token_ids.length;
        routed = res.routed_experts;
        finish = res.finish_reason;
        // Go on only when the chunk limit (not a stop, an abort, or the model's own length limit) ended it.
        if (!(res.finish_reason === 'length' && res.token_ids.length === want && current.token_ids.length < maxTokens)) break;
        void this.save().catch(() => undefined); // a failed save surfaces at the next awaited one
      }
    } catch (e) {
      await this.save().catch(() => undefined); // keep what was sampled for the retry
      throw e;
    }
    const { prompt: _, ...sampled } = current;
    this.recorded.calls.push({ prompt, ...sampled, finish_reason: finish, ...(routed ? { routed_experts: routed } : {}) });
    this.recorded.current = null;
    await this.save();
    return { request_id: `journal-${index}`, ...sampled, finish_reason: finish, ...(routed ? { routed_experts: routed } : {}) };
  }

  // Saves are serialized and coalesced: at most one queued behind the one being written, and that
  // one writes the journal as it is when it starts.
  save(): Promise<void> {
    if (!this.saveQueued) {
      this.saveQueued = true;
      this.saving = this.saving.then(async () => {
        this.saveQueued = false;
        await writeFileAtomic(path.join(this.storeRoot, this.key), JSON.stringify(this.recorded));
        this.onSaved();
      });
    }
    return this.saving;
  }

  // Sampled tokens of the journal as saved: answered calls plus the call in progress.
  tokens(): number {
    return this.recorded.calls.reduce((n, c) => n + c.token_ids.length, 0) + (this.recorded.current?.token_ids.length ?? 0);
  }
}
