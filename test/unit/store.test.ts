// The trajectory store: a round trip in TS, and the Python actor's reader (safetensors) sees the same thing.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { trajectoryKey, writeTrajectory, type Trajectory } from '../../activities/store';
import { readTrajectory } from '../helpers/store';
import { REPO_ROOT } from '../../agents/recipe';

const PYTHON = path.join(REPO_ROOT, '.venv', 'bin', 'python');

const trajectory: Trajectory = {
  tokens: [256, 99, 111, 112, 121, 97, 98, 99, 62, 97, 98, 99],
  logprobs: [0, 0, 0, 0, 0, 0, 0, 0, 0, -1.25, -0.5, -3.0517578125e-5],
  versions: [-1, -1, -1, -1, -1, -1, -1, -1, -1, 3, 3, 4],
  lossMask: [0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1],
};
const meta = { run: 'r1', group: 7, episode: 2, segment: 0, reward: 2 / 3, finish: 'terminated' };

let root: string;
beforeAll(() => { root = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-store-')); });
afterAll(() => fs.rmSync(root, { recursive: true, force: true }));

test('keys are deterministic', () => {
  expect(trajectoryKey('r1', 7, 2, 0)).toBe('r1/trajectories/g7/e2-s0.safetensors');
});

test('round trip in TypeScript, with routed experts; a rewrite leaves one file and no temp files', async () => {
  const key = trajectoryKey('r1', 7, 2, 0);
  const routedExperts = trajectory.tokens.map((_, t) => [[t, t + 1], [t + 2, -1]]); // [T][L=2][K=2]
  await writeTrajectory(root, key, { ...trajectory, routedExperts }, meta);
  await writeTrajectory(root, key, { ...trajectory, routedExperts }, meta);
  const back = readTrajectory(root, key);
  expect(back.trajectory).toEqual({ ...trajectory, routedExperts });
  expect(back.meta).toEqual(meta);
  expect(fs.readdirSync(path.join(root, 'r1', 'trajectories', 'g7'))).toEqual(['e2-s0.safetensors']);
});

test('the Python safetensors library reads the file as written', async () => {
  const key = trajectoryKey('r1', 1, 0, 0);
  await writeTrajectory(root, key, trajectory, meta);
  const script = `
import json, sys
from safetensors import safe_open
from safetensors.torch import load_file
t = load_file(sys.argv[1])
with safe_open(sys.argv[1], framework="pt") as f:
    meta = f.metadata()
print(json.dumps({"meta": meta, "dtypes": {k: str(v.dtype) for k, v in t.items()},
                  "values": {k: v.tolist() for k, v in t.items()}}))`;
  const out = JSON.parse(execFileSync(PYTHON, ['-c', script, path.join(root, key)], { encoding: 'utf8' }));
  expect(out.meta).toEqual({ format: 'molt-trajectory-v1', run: 'r1', group: '7', episode: '2', segment: '0',
    reward: String(2 / 3), finish: 'terminated', sha256: expect.stringMatching(/^[0-9a-f]{64}$/) });
  expect(out.dtypes).toEqual({ tokens: 'torch.int32', logprobs: 'torch.float32', versions: 'torch.int32', loss_mask: 'torch.uint8' });
  expect(out.values.tokens).toEqual(trajectory.tokens);
  expect(out.values.logprobs).toEqual(trajectory.logprobs); // values chosen exactly representable in float32
  expect(out.values.versions).toEqual(trajectory.versions);
  expect(out.values.loss_mask).toEqual(trajectory.lossMask);
});

test('the actor-side reader (gpu-services/trajectories.py) accepts it', () => {
  const key = trajectoryKey('r1', 1, 0, 0);
  const script = `
import sys
sys.path.insert(0, "gpu-services")
from trajectories import load_segment
s = load_segment(sys.argv[1], sys.argv[2])
print(s.group, s.episode, s.segment, round(s.reward, 6), int(s.loss_mask.sum()))`;
  const out = execFileSync(PYTHON, ['-c', script, root, key], { encoding: 'utf8', cwd: REPO_ROOT }).trim();
  expect(out).toBe('7 2 0 0.666667 3');
});
