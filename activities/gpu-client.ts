// HTTP to the GPU services (engines, actor): bearer token, JSON, and every body checked with ajv
// against gpu-services/contract.schema.json (generated from the pydantic models in contract.py),
// so both ends check the same shapes.
import * as fs from 'node:fs';
import * as path from 'node:path';
import Ajv2020, { type ValidateFunction } from 'ajv/dist/2020';
import type { AlgoConfig } from '../agents/recipe';

const SCHEMA_FILE = path.resolve(__dirname, '..', 'gpu-services', 'contract.schema.json');
const schemas = JSON.parse(fs.readFileSync(SCHEMA_FILE, 'utf8')) as Record<string, object>;
// Each model's schema is self-contained: its `$defs` sit at its own root, so compile them one by one.
const ajv = new Ajv2020({ strict: false, allErrors: true });
const validators = new Map<string, ValidateFunction>();
function validator(model: string): ValidateFunction {
  let v = validators.get(model);
  if (!v) {
    if (!schemas[model]) throw new Error(`${SCHEMA_FILE} has no model ${model}`);
    validators.set(model, (v = ajv.compile(schemas[model])));
  }
  return v;
}

// The contract bodies this side sends and reads (mirrors of contract.py).
export interface SamplingParams {
  max_tokens: number; temperature: number; top_p: number; top_k: number; stop_token_ids: number[]; seed?: number;
}
export interface GenerateRequest {
  prompt_token_ids: number[]; sampling: SamplingParams; request_id?: string; stream?: boolean; return_routed_experts?: boolean;
  stream_chunk?: number; // a streamed reply's tokens may be held until this many are ready (the torch engine's chunks)
  images?: string[]; // vision-language models: processed image files (ImageResponse.path), in placeholder order
}
export interface ImageRequest { data: string; dir: string } // base64 of the file; where the processed tensors go
export interface ImageResponse { path: string; grid_thw: number[]; tokens: number }
export interface GenerateChunk {
  token_ids: number[]; logprobs: number[]; versions: number[];
  finish_reason?: GenerateResponse['finish_reason'] | null; routed_experts?: number[][][] | null;
}
export interface GenerateResponse {
  request_id: string; token_ids: number[]; logprobs: number[]; versions: number[];
  finish_reason: 'stop' | 'length' | 'abort'; routed_experts?: number[][][] | null;
}
export interface EngineHealth { backend: string; model: string; version: number; paused: boolean; load: { running: number; waiting: number } }
export interface TrainStepRequest { run_id: string; step: number; store_root: string; trajectories: string[]; algo: AlgoConfig }
export interface SftExample { tokens: number[]; mask: number[] } // mask 1 on the tokens trained (assistant turns)
export interface SftStepRequest { run_id: string; step: number; examples: SftExample[]; algo: AlgoConfig }
export interface TrainStepResponse { run_id: string; step: number; version: number; replayed: boolean; metrics: Record<string, number> }
export interface PushWeightsRequest { engines: { url: string }[]; version: number }
export interface PushWeightsResponse { version: number; bytes: number; seconds: number; new_group?: boolean }
export interface CheckpointResponse { path: string; step: number; version: number }
export interface ActorHealth { version: number; last_step: number; run_id: string | null; world_size: number; model: string }

// status is the HTTP status, or undefined when the service could not be reached at all; code: the
// connection's error code then (e.g. UND_ERR_SOCKET: the server closed the connection unanswered).
export class ServiceError extends Error {
  constructor(message: string, readonly status?: number, readonly code?: string) {
    super(message);
    this.name = 'ServiceError';
  }
}

function check(model: string, body: unknown, what: string, status: number): void {
  const v = validator(model);
  if (!v(body)) {
    const problems = (v.errors ?? []).map((e) => `${e.instancePath || '(body)'} ${e.message}`).join('; ');
    throw new ServiceError(`${what}: does not match ${model}: ${problems}`, status);
  }
}

// timeoutMs: the whole call (answer included) must finish by then, or it fails like an unreachable
// service (status undefined): a hung process (SIGSTOPped, deadlocked) holds its connections open.
export interface CallOptions {
  body?: unknown; request?: string; response?: string; signal?: AbortSignal; timeoutMs?: number;
}

// One call: `request`/`response` name contract models to validate against (omit for bodies the
// contract does not define, like /pause's reply).
export async function callService<T>(baseUrl: string, route: string, token: string, opts: CallOptions = {}): Promise<T> {
  const url = baseUrl.replace(/\/+$/, '') + route;
  const method = opts.body === undefined ? 'GET' : 'POST';
  let payload: string | undefined;
  if (opts.body !== undefined) {
    payload = JSON.stringify(opts.body);
    if (opts.request) check(opts.request, JSON.parse(payload), `request to ${url}`, 400); // our bug: never retried
  }
  const deadline = opts.timeoutMs === undefined ? undefined : AbortSignal.timeout(opts.timeoutMs);
  const signal = deadline && opts.signal ? AbortSignal.any([opts.signal, deadline]) : deadline ?? opts.signal;
  let res: Response;
  let text: string;
  try {
    res = await fetch(url, {
      method, body: payload, signal,
      headers: { authorization: `Bearer ${token}`, ...(payload ? { 'content-type': 'application/json' } : {}) },
    });
    text = await res.text();
  } catch (e) {
    if (deadline?.aborted && !opts.signal?.aborted) {
      throw new ServiceError(`${method} ${url}: no answer within ${opts.timeoutMs! / 1000} s`);
    }
    const cause = (e as any)?.cause?.message ?? (e as Error).message;
    throw new ServiceError(`${method} ${url} failed: ${cause}`, undefined, (e as any)?.cause?.code);
  }
  let json: any;
  try {
    json = text ? JSON.parse(text) : undefined;
  } catch {
    throw new ServiceError(`${method} ${url}: HTTP ${res.status}, body is not JSON: ${text.slice(0, 200)}`, res.status);
  }
  if (!res.ok) {
    throw new ServiceError(`${method} ${url}: HTTP ${res.status}: ${json?.error ?? text.slice(0, 200)}`, res.status);
  }
  if (opts.response) check(opts.response, json, `response from ${method} ${url}`, 502);
  return json as T;
}

// POST /generate streamed: the engine's NDJSON lines (GenerateChunk, each checked) go to onChunk as
// they arrive; onChunk returning true ends the request there (the connection is closed, which aborts
// it in the engine) and the reply is what arrived, finish_reason "stop". Returns the whole reply.
// timeoutMs: as for callService, the whole stream.
export async function streamGenerate(baseUrl: string, token: string, body: GenerateRequest,
  onChunk: (chunk: GenerateChunk) => boolean, signal?: AbortSignal, timeoutMs?: number): Promise<GenerateResponse> {
  const url = baseUrl.replace(/\/+$/, '') + '/generate';
  const request = { ...body, stream: true };
  check('GenerateRequest', request, `request to ${url}`, 400);
  const done = new AbortController();
  const deadline = timeoutMs === undefined ? undefined : AbortSignal.timeout(timeoutMs);
  const out: GenerateResponse = {
    request_id: body.request_id ?? '', token_ids: [], logprobs: [], versions: [], finish_reason: 'abort',
  };
  let finished = false;
  let res: Response;
  try {
    res = await fetch(url, {
      method: 'POST', body: JSON.stringify(request),
      signal: AbortSignal.any([done.signal, ...[signal, deadline].filter((x) => x !== undefined)]),
      headers: { authorization: `Bearer ${token}`, 'content-type': 'application/json' },
    });
    if (!res.ok) {
      const text = await res.text();
      let detail = text.slice(0, 200);
      try { detail = JSON.parse(text)?.error ?? detail; } catch { /* not JSON */ }
      throw new ServiceError(`POST ${url}: HTTP ${res.status}: ${detail}`, res.status);
    }
    const status = res.status;
    const take = (line: string): boolean => { // true: no more lines wanted
      let chunk: GenerateChunk;
      try {
        chunk = JSON.parse(line);
      } catch {
        throw new ServiceError(`POST ${url}: HTTP ${status}, body is not JSON: ${line.slice(0, 200)}`, status);
      }
      check('GenerateChunk', chunk, `response from POST ${url}`, 502);
      out.token_ids.push(...chunk.token_ids);
      out.logprobs.push(...chunk.logprobs);
      out.versions.push(...chunk.versions);
      if (chunk.routed_experts) (out.routed_experts ??= []).push(...chunk.routed_experts);
      if (chunk.finish_reason) [out.finish_reason, finished] = [chunk.finish_reason, true];
      return (stopped = onChunk(chunk)) || finished;
    };
    const decoder = new TextDecoder();
    let buffered = '';
    let stopped = false;
    read: for await (const bytes of res.body as unknown as AsyncIterable<Uint8Array>) {
      buffered += decoder.decode(bytes, { stream: true });
      let nl: number;
      while ((nl = buffered.indexOf('\n')) >= 0) {
        const line = buffered.slice(0, nl);
        buffered = buffered.slice(nl + 1);
        if (line.trim() && take(line)) break read; // leaving the loop cancels the body
      }
    }
    if (!stopped && !finished && buffered.trim()) take(buffered); // a last line without its newline
    if (stopped) {
      done.abort(); // the connection closes: the engine ends the request
      return { ...out, finish_reason: 'stop' };
    }
    if (finished) return out;
  } catch (e) {
    if (e instanceof ServiceError) throw e;
    const after = out.token_ids.length ? ` (${out.token_ids.length} tokens arrived)` : '';
    if (deadline?.aborted && !signal?.aborted) {
      throw new ServiceError(`POST ${url}: not answered within ${timeoutMs! / 1000} s${after}`);
    }
    const cause = (e as any)?.cause?.message ?? (e as Error).message;
    throw new ServiceError(`POST ${url} failed${out.token_ids.length ? ` after ${out.token_ids.length} tokens` : ''}: ${cause}`,
      undefined, (e as any)?.cause?.code);
  }
  throw new ServiceError(`POST ${url}: the stream ended without a finish_reason after ${out.token_ids.length} tokens`);
}
