// metrics.jsonl (one whole line per step, whatever is retried or torn) and `molt-client plot`'s
// PNG and TensorBoard files, drawn by the real matplotlib/tensorboard in the venv.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { metricsFile, readMetrics, recordMetrics } from '../../activities/metrics';
import { plotRun } from '../../client/plot';

let storeRoot: string;
beforeEach(() => { storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-metrics-')); });
afterEach(() => fs.rmSync(storeRoot, { recursive: true, force: true }));
const endpoints = () => ({ engines: [], actor: '', token: '', storeRoot });

test('one line per step: a retried step writes nothing, a torn last line is cut off', async () => {
  expect(await recordMetrics(endpoints(), { runId: 'r', step: 1, metrics: { loss: 1 } })).toEqual({ written: true });
  expect(await recordMetrics(endpoints(), { runId: 'r', step: 1, metrics: { loss: 9 } })).toEqual({ written: false });
  fs.appendFileSync(metricsFile(storeRoot, 'r'), '{"step": 2, "loss": 0.'); // a crash mid-append
  await recordMetrics(endpoints(), { runId: 'r', step: 2, metrics: { loss: 0.5 } });
  await recordMetrics(endpoints(), { runId: 'r', step: 2, metrics: { loss: 0.7 } });
  const rows = await readMetrics(storeRoot, 'r');
  expect(rows.map((r) => [r.step, r.loss])).toEqual([[1, 1], [2, 0.5]]);
});

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

test('plot: a PNG with reward, loss, mismatch and throughput series, and TensorBoard events', async () => {
  for (let step = 1; step <= 3; step++) {
    await recordMetrics(endpoints(), { runId: 'p', step, metrics: {
      pg_loss: 1 / step, entropy: 2, kl: 0, rollout_kl: 1e-4, rollout_logp_max_abs_diff: 2e-4,
      'rollout/reward_mean': step / 3, 'rollout/pass_rate': 0.1 * step, 'rollout/tokens_per_s': 100 * step,
    } });
  }
  const out = path.join(storeRoot, 'curves.png');
  const { png, tensorboard } = await plotRun('p', storeRoot, out);
  expect(png).toBe(out);
  const bytes = fs.readFileSync(png);
  expect(bytes.subarray(0, 8)).toEqual(Buffer.from([0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]));
  expect(bytes.toString('latin1', 12, 16)).toBe('IHDR');
  expect(JSON.parse(pngText(bytes).Series)).toEqual({
    reward: { 'rollout/reward_mean': 3, 'rollout/pass_rate': 3 },
    loss: { pg_loss: 3, entropy: 3, kl: 3 },
    'logprob mismatch (engine vs actor)': { rollout_kl: 3, rollout_logp_max_abs_diff: 3 },
    'throughput (tokens/s)': { 'rollout/tokens_per_s': 3 },
  });
  expect(fs.readdirSync(tensorboard).some((f) => f.startsWith('events.out.tfevents'))).toBe(true);
  await expect(plotRun('missing', storeRoot)).rejects.toThrow(`no metrics for run missing (looked for ${storeRoot}/missing/metrics.jsonl)`);
});
