// Test-only readers of the trajectory store: the framework never reads trajectories back in
// TypeScript (gpu-services/trajectories.py does), but tests check what the rollouts wrote.
import { createHash } from 'node:crypto';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { ARRAY_OF, TRAJECTORY_FORMAT, type DType, type Tensor, type Trajectory, type TrajectoryMeta } from '../../activities/store';

export function decodeSafetensors(buf: Buffer, what: string): { tensors: Record<string, Tensor>; metadata: Record<string, string> } {
  if (buf.length < 8) throw new Error(`${what}: not safetensors (${buf.length} bytes)`);
  const n = Number(buf.readBigUInt64LE(0));
  if (8 + n > buf.length) throw new Error(`${what}: header length ${n} exceeds the file (${buf.length} bytes)`);
  let header: Record<string, any>;
  try {
    header = JSON.parse(buf.subarray(8, 8 + n).toString('utf8'));
  } catch (e) {
    throw new Error(`${what}: the header is not JSON (corrupted file?): ${(e as Error).message}`);
  }
  const dataStart = 8 + n;
  const expected = header.__metadata__?.sha256;
  // Files written before checksums (or by hand, e.g. Python tests) have none: nothing to verify.
  if (expected !== undefined) {
    const actual = createHash('sha256').update(buf.subarray(dataStart)).digest('hex');
    if (actual !== expected) throw new Error(`${what}: checksum mismatch (sha256 of the tensor data is ${actual}, the file says ${expected}): the file is corrupted`);
  }
  const tensors: Record<string, Tensor> = {};
  for (const [name, spec] of Object.entries(header)) {
    if (name === '__metadata__') continue;
    const Array_ = ARRAY_OF[spec.dtype as DType];
    if (!Array_) throw new Error(`${what}: tensor ${name} has unsupported dtype ${spec.dtype}`);
    const [begin, end] = spec.data_offsets as [number, number];
    if (dataStart + end > buf.length) throw new Error(`${what}: tensor ${name} runs past the end of the file`);
    // Copy into a fresh, aligned buffer: the slice inside the file need not be aligned.
    const bytes = new Uint8Array(end - begin);
    bytes.set(buf.subarray(dataStart + begin, dataStart + end));
    tensors[name] = { dtype: spec.dtype, shape: spec.shape, data: new Array_(bytes.buffer) };
  }
  return { tensors, metadata: header.__metadata__ ?? {} };
}

export function readTrajectory(storeRoot: string, key: string): { trajectory: Trajectory; meta: TrajectoryMeta } {
  const { tensors, metadata } = decodeSafetensors(fs.readFileSync(path.join(storeRoot, key)), `trajectory ${key}`);
  if (metadata.format !== TRAJECTORY_FORMAT) throw new Error(`trajectory ${key}: format ${metadata.format}, expected ${TRAJECTORY_FORMAT}`);
  for (const name of ['tokens', 'logprobs', 'versions', 'loss_mask']) {
    if (!tensors[name]) throw new Error(`trajectory ${key}: tensor ${name} is missing`);
  }
  const trajectory: Trajectory = {
    tokens: Array.from(tensors.tokens.data), logprobs: Array.from(tensors.logprobs.data),
    versions: Array.from(tensors.versions.data), lossMask: Array.from(tensors.loss_mask.data),
  };
  if (metadata.images) trajectory.images = JSON.parse(metadata.images);
  if (tensors.teacher_logprobs) trajectory.teacherLogprobs = Array.from(tensors.teacher_logprobs.data);
  const re = tensors.routed_experts;
  if (re) {
    const [T, L, K] = re.shape;
    trajectory.routedExperts = Array.from({ length: T }, (_, t) =>
      Array.from({ length: L }, (_, l) => Array.from(re.data.subarray((t * L + l) * K, (t * L + l + 1) * K))));
  }
  const meta: TrajectoryMeta = {
    run: metadata.run, group: Number(metadata.group), episode: Number(metadata.episode),
    segment: Number(metadata.segment), reward: Number(metadata.reward), finish: metadata.finish,
  };
  return { trajectory, meta };
}
