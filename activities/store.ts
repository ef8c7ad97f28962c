// The trajectory store (claim check): one safetensors file per episode segment under
// <storeRoot>/<runId>/trajectories/. Temporal carries only the keys. gpu-services/trajectories.py
// reads these files; keep the format exactly.
//
// safetensors layout: u64 little-endian header length N | N bytes of JSON header (padded with spaces
// to a multiple of 8) | raw little-endian tensor data. The header maps each tensor name to
// {dtype, shape, data_offsets: [begin, end]} (offsets into the data part) plus "__metadata__"
// (string -> string). The metadata also holds `sha256`: the hex digest of the whole data part, so a
// corrupted file is refused by every reader (gpu-services/trajectories.py, and the tests' reader in
// test/helpers/store.ts) instead of trained on.
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import type { GroupTrajectories } from './types';

export const TRAJECTORY_FORMAT = 'molt-trajectory-v1';

export type DType = 'I32' | 'F32' | 'U8' | 'I16';
type TypedArray = Int32Array | Float32Array | Uint8Array | Int16Array;
export const ARRAY_OF: Record<DType, { new (buffer: ArrayBuffer): TypedArray; BYTES_PER_ELEMENT: number }> = {
  I32: Int32Array, F32: Float32Array, U8: Uint8Array, I16: Int16Array,
};

export interface Tensor { dtype: DType; shape: number[]; data: TypedArray }

export function encodeSafetensors(tensors: Record<string, Tensor>, metadata: Record<string, string>): Buffer {
  // Wider dtypes first, so each tensor starts aligned to its element size.
  const names = Object.keys(tensors).sort((a, b) => tensors[b].data.BYTES_PER_ELEMENT - tensors[a].data.BYTES_PER_ELEMENT);
  const header: Record<string, unknown> = { __metadata__: metadata };
  let offset = 0;
  for (const name of names) {
    const t = tensors[name];
    const count = t.shape.reduce((a, b) => a * b, 1);
    if (count !== t.data.length) throw new Error(`tensor ${name}: shape ${JSON.stringify(t.shape)} holds ${count} elements, data has ${t.data.length}`);
    if (!(t.data instanceof ARRAY_OF[t.dtype])) throw new Error(`tensor ${name}: data is not a ${t.dtype} array`);
    header[name] = { dtype: t.dtype, shape: t.shape, data_offsets: [offset, offset + t.data.byteLength] };
    offset += t.data.byteLength;
  }
  const data = Buffer.alloc(offset);
  let at = 0;
  for (const name of names) {
    const d = tensors[name].data; // typed arrays are host-endian; every supported host is little-endian
    Buffer.from(d.buffer, d.byteOffset, d.byteLength).copy(data, at);
    at += d.byteLength;
  }
  header.__metadata__ = { ...metadata, sha256: createHash('sha256').update(data).digest('hex') };
  let json = JSON.stringify(header);
  json += ' '.repeat((8 - (Buffer.byteLength(json) % 8)) % 8);
  const headerBytes = Buffer.from(json, 'utf8');
  const out = Buffer.alloc(8 + headerBytes.length + offset);
  out.writeBigUInt64LE(BigInt(headerBytes.length), 0);
  headerBytes.copy(out, 8);
  data.copy(out, 8 + headerBytes.length);
  return out;
}

// A write that failed for want of room (ENOSPC), or for another system reason, as an error that
// names the file: Node's own message ("ENOSPC: no space left on device, write") does not. Temporal
// retries the activity; once there is room again the write succeeds.
export function writeError(e: unknown, file: string): Error {
  const code = (e as NodeJS.ErrnoException)?.code;
  if (code === undefined) return e as Error;
  const what = code === 'ENOSPC' ? 'no space left on device (ENOSPC)' : (e as Error).message;
  return Object.assign(new Error(`${what} writing ${file}`, { cause: e }), { code });
}

// A retried write is the same write: the bytes go to a temp file, are fsynced, then renamed over
// the deterministic key, so readers see either nothing or the whole file. Asynchronous, so the
// fsyncs run off the event loop while the worker's other episodes keep generating. A failed write
// removes its temp file (a full disk once left dozens per episode behind).
export async function writeFileAtomic(file: string, data: Buffer | string): Promise<void> {
  const tmp = `${file}.tmp-${process.pid}-${Math.random().toString(36).slice(2)}`;
  try {
    // The folder exists for all but a run's first few writes: make it only when the open says it is missing.
    const handle = await fs.promises.open(tmp, 'w').catch(async (e) => {
      if ((e as NodeJS.ErrnoException).code !== 'ENOENT') throw e;
      await fs.promises.mkdir(path.dirname(file), { recursive: true });
      return fs.promises.open(tmp, 'w');
    });
    try {
      await handle.writeFile(data);
      await handle.sync();
    } finally {
      await handle.close();
    }
    await fs.promises.rename(tmp, file);
    const dir = await fs.promises.open(path.dirname(file), 'r');
    try { await dir.sync(); } finally { await dir.close(); }
  } catch (e) {
    await fs.promises.rm(tmp, { force: true });
    throw writeError(e, file);
  }
}

export interface Trajectory {
  tokens: number[]; // [T] prompt, sampled and observation tokens
  logprobs: number[]; // [T] rollout logprob of sampled tokens, 0 elsewhere
  versions: number[]; // [T] engine weight version of sampled tokens, -1 elsewhere
  lossMask: number[]; // [T] 1 = sampled by the policy
  routedExperts?: number[][][]; // [T][layers][top_k] for MoE routing replay
  teacherLogprobs?: number[]; // [T] on-policy distillation: the teacher pool's logprob of each sampled token, 0 elsewhere
  images?: string[]; // processed image files of its placeholder runs, in order (stored relative to the store root)
}

export interface TrajectoryMeta {
  run: string;
  group: number;
  episode: number;
  segment: number;
  reward: number;
  finish: string;
}

export function trajectoryKey(runId: string, group: number, episode: number, segment: number): string {
  return `${runId}/trajectories/g${group}/e${episode}-s${segment}.safetensors`;
}

// The store keys of a group's trajectories, as its result names them (types.ts).
export function groupRefs(runId: string, g: GroupTrajectories): string[] {
  return g.episodes.flatMap((episode, i) => Array.from({ length: g.segments[i] }, (_, s) => trajectoryKey(runId, g.groupIndex, episode, s)));
}

export async function writeTrajectory(storeRoot: string, key: string, t: Trajectory, meta: TrajectoryMeta): Promise<void> {
  const T = t.tokens.length;
  for (const [name, arr] of [['logprobs', t.logprobs], ['versions', t.versions], ['lossMask', t.lossMask]] as const) {
    if (arr.length !== T) throw new Error(`trajectory ${key}: ${name} has length ${arr.length}, tokens ${T}`);
  }
  const tensors: Record<string, Tensor> = {
    tokens: { dtype: 'I32', shape: [T], data: Int32Array.from(t.tokens) },
    logprobs: { dtype: 'F32', shape: [T], data: Float32Array.from(t.logprobs) },
    versions: { dtype: 'I32', shape: [T], data: Int32Array.from(t.versions) },
    loss_mask: { dtype: 'U8', shape: [T], data: Uint8Array.from(t.lossMask) },
  };
  if (t.teacherLogprobs) {
    if (t.teacherLogprobs.length !== T) throw new Error(`trajectory ${key}: teacherLogprobs has length ${t.teacherLogprobs.length}, tokens ${T}`);
    tensors.teacher_logprobs = { dtype: 'F32', shape: [T], data: Float32Array.from(t.teacherLogprobs) };
  }
  if (t.routedExperts) {
    const L = t.routedExperts[0]?.length ?? 0;
    const K = t.routedExperts[0]?.[0]?.length ?? 0;
    if (t.routedExperts.length !== T) throw new Error(`trajectory ${key}: routed_experts has ${t.routedExperts.length} rows, tokens ${T}`);
    tensors.routed_experts = { dtype: 'I16', shape: [T, L, K], data: Int16Array.from(t.routedExperts.flat(2)) };
  }
  const metadata = {
    format: TRAJECTORY_FORMAT, run: meta.run, group: String(meta.group), episode: String(meta.episode),
    segment: String(meta.segment), reward: String(meta.reward), finish: meta.finish,
    ...(t.images?.length
      ? { images: JSON.stringify(t.images.map((p) => path.relative(storeRoot, path.resolve(storeRoot, p)))) } : {}),
  };
  await writeFileAtomic(path.join(storeRoot, key), encodeSafetensors(tensors, metadata));
}

