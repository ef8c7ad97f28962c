// metrics.jsonl (one whole line per step, whatever is retried or torn), the TensorBoard events and
// Weights & Biases run written beside it as the run goes (read back by the real tensorboard and
// wandb libraries in the venv), and `molt-client plot`'s PNG drawn by matplotlib.
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { closeWandb, metricsFile, readMetrics, recordMetrics } from '../../activities/metrics';
import { crc32c, eventFile } from '../../activities/tensorboard';
import { carriesSample, SAMPLES_PER_STEP } from '../../activities/types';
import { REPO_ROOT } from '../../agents/recipe';
import { plotRun } from '../../client/plot';

const python = (code: string, ...args: string[]) =>
  execFileSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'), ['-c', code, ...args], { encoding: 'utf8', env: { ...process.env, OMP_NUM_THREADS: '1' } });

let storeRoot: string;
beforeEach(() => { storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-metrics-')); });
afterEach(() => fs.rmSync(storeRoot, { recursive: true, force: true }));
const endpoints = () => ({ engines: [], actor: '', token: '', storeRoot });

test('about SAMPLES_PER_STEP groups of a batch of consecutive groups carry a sample, wherever it starts', () => {
  for (const batch of [1, 2, 3, 4, 5, 7, 8, 11, 16, 33, 2048]) {
    for (const start of [0, 1, 7, 1000, 123_457]) {
      const carrying = Array.from({ length: batch }, (_, i) => start + i).filter((g) => carriesSample(g, batch)).length;
      expect(carrying).toBeGreaterThanOrEqual(Math.min(batch, SAMPLES_PER_STEP));
      expect(carrying).toBeLessThan(2 * SAMPLES_PER_STEP);
    }
  }
});

test('one line per step: a retried step writes nothing, a torn last line is cut off', async () => {
  expect(await recordMetrics(endpoints(), { runId: 'r', step: 1, metrics: { loss: 1 } })).toEqual({ written: true });
  expect(await recordMetrics(endpoints(), { runId: 'r', step: 1, metrics: { loss: 9 } })).toEqual({ written: false });
  fs.appendFileSync(metricsFile(storeRoot, 'r'), '{"step": 2, "loss": 0.'); // a crash mid-append
  await recordMetrics(endpoints(), { runId: 'r', step: 2, metrics: { loss: 0.5 } });
  await recordMetrics(endpoints(), { runId: 'r', step: 2, metrics: { loss: 0.7 } });
  const rows = await readMetrics(storeRoot, 'r');
  expect(rows.map((r) => [r.step, r.loss])).toEqual([[1, 1], [2, 0.5]]);
});

test('TensorBoard events are written live, one event per step: the tensorboard library reads them back', async () => {
  expect(crc32c(Buffer.from('123456789'))).toBe(0xe3069283); // the CRC-32C check value
  await recordMetrics(endpoints(), { runId: 't', step: 1, metrics: { 'rollout/reward_mean': 0.25, grad_norm: 3 } });
  await recordMetrics(endpoints(), { runId: 't', step: 2, metrics: { 'rollout/reward_mean': 0.5, grad_norm: 2 } });
  await recordMetrics(endpoints(), { runId: 't', step: 2, metrics: { 'rollout/reward_mean': 9, grad_norm: 9 } }); // a retry
  const scalars = JSON.parse(python(`
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1]); ea.Reload()
print(json.dumps({t: [[e.step, e.value] for e in ea.Scalars(t)] for t in ea.Tags()["scalars"]}))`, path.dirname(eventFile(path.join(storeRoot, 't')))));
  expect(scalars).toEqual({ 'rollout/reward_mean': [[1, 0.25], [2, 0.5]], grad_norm: [[1, 3], [2, 2]] });
});

test('Weights & Biases (offline): every step is logged to a wandb run named after the run, finished after the last step', async () => {
  const wandb = { project: 'molt-test', mode: 'offline' as const };
  process.env.WANDB_MODE = 'offline';
  try {
    for (let step = 1; step <= 3; step++) {
      await recordMetrics(endpoints(), { runId: 'w', step, metrics: { 'rollout/reward_mean': step / 4 }, wandb, last: step === 3 });
    }
    await closeWandb('w'); // already closing after the last step: waits for the logger to exit
  } finally {
    delete process.env.WANDB_MODE;
  }
  // The offline run file is a LevelDB-style log of wandb Record protos (7-byte header, 32 KiB blocks of
  // crc32 | u16 length | type | data records); its history records are the logged steps.
  const history = JSON.parse(python(`
import glob, json, sys
from wandb.proto import wandb_internal_pb2 as pb
[f] = glob.glob(sys.argv[1] + "/wandb/offline-run-*-w/run-w.wandb")
data, at, buf, rows = open(f, "rb").read(), 7, b"", []
while at + 7 <= len(data):
    if 32768 - at % 32768 < 7:
        at += 32768 - at % 32768; continue
    length, kind = int.from_bytes(data[at + 4:at + 6], "little"), data[at + 6]
    buf += data[at + 7:at + 7 + length]; at += 7 + length
    if kind in (1, 4):
        r = pb.Record(); r.ParseFromString(buf); buf = b""
        if r.WhichOneof("record_type") == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            rows.append([items["_step"], items["rollout/reward_mean"]])
print(json.dumps(rows))`, path.join(storeRoot, 'w')));
  expect(history).toEqual([[1, 0.25], [2, 0.5], [3, 0.75]]);
}, 120_000);

// The text chunks of a PNG (after the 8-byte signature: length, type, data, crc per chunk).
function pngText(png: Buffer): Record<string, string> {
  const text: Record<string, string> = {};
  for (let at = 8; at < png.length;) {
    const length = png.readUInt32BE(at);
    const type = png.toString('latin1', at + 4, at + 8);
    if (type === 'tEXt') {
      const data = png.subarray(at + 8, at + 8 + length);
      const nul = data.indexOf(0);
      text[data.toString('latin1', 0, nul)] = data.toString('latin1', nul + 1);
    }
    at += 12 + length;
  }
  return text;
}

test('plot: a PNG with one panel per quantity (grad norm and the same-version logprob gap among them), and TensorBoard events', async () => {
  for (let step = 1; step <= 3; step++) {
    await recordMetrics(endpoints(), { runId: 'p', step, metrics: {
      pg_loss: 1 / step, entropy: 2, kl: 0, rollout_kl: 1e-4, rollout_logp_max_abs_diff: 2e-4, rollout_logp_max_abs_diff_same_version: 1e-6,
      grad_norm: 0.5, 'rollout/reward_mean': step / 3, 'rollout/pass_rate': 0.1 * step, 'rollout/tokens_per_s': 100 * step,
    } });
  }
  const out = path.join(storeRoot, 'curves.png');
  const { png, tensorboard } = await plotRun('p', storeRoot, out);
  expect(png).toBe(out);
  const bytes = fs.readFileSync(png);
  expect(bytes.subarray(0, 8)).toEqual(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]));
  expect(bytes.toString('latin1', 12, 16)).toBe('IHDR');
  expect(JSON.parse(pngText(bytes).Series)).toEqual({
    'reward mean': { 'rollout/reward_mean': 3 },
    'pass rate (reward >= 1)': { 'rollout/pass_rate': 3 },
    'policy loss': { pg_loss: 3 },
    entropy: { entropy: 3 },
    'KL to reference': { kl: 3 },
    'grad norm': { grad_norm: 3 },
    'logprob gap, same version (max |actor - engine|)': { rollout_logp_max_abs_diff_same_version: 3 },
    'logprob gap, all tokens (max |actor - engine|)': { rollout_logp_max_abs_diff: 3 },
    'KL engine vs actor': { rollout_kl: 3 },
    'throughput (tokens/s)': { 'rollout/tokens_per_s': 3 },
  });
  expect(fs.readdirSync(tensorboard)).toEqual(['events.out.tfevents.molt']); // the live file; plot adds none
  // A run recorded before the worker wrote events: plot writes them from metrics.jsonl.
  fs.rmSync(tensorboard, { recursive: true });
  await plotRun('p', storeRoot, out);
  expect(fs.readdirSync(tensorboard).some((f) => f.startsWith('events.out.tfevents'))).toBe(true);
  await expect(plotRun('missing', storeRoot)).rejects.toThrow(`no metrics for run missing (looked for ${storeRoot}/missing/metrics.jsonl)`);
});
