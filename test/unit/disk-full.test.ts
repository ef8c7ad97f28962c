// A full disk on every write path of the worker (issue 15, item 8): the trajectory store, the
// episode journal, the step manifest's atomic writes and metrics.jsonl. Each failed write says
// ENOSPC and names its file, leaves no `*.tmp-*` file, and succeeds once there is room again.
// The disk is a real 2 MiB tmpfs (mounting needs root: elsewhere these tests are skipped).
import { execFileSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { EpisodeJournal, journalKey } from '../../activities/episode-journal';
import { readMetrics, recordMetrics, metricsFile } from '../../activities/metrics';
import { trajectoryKey, writeTrajectory } from '../../activities/store';
import { readTrajectory } from '../helpers/store';

const root = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-disk-'));
const disk = path.join(root, 'disk');
const asRoot = process.getuid?.() === 0;
const maybe = asRoot ? test : test.skip;

beforeAll(() => {
  if (!asRoot) return;
  fs.mkdirSync(disk);
  execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=2m', 'tmpfs', disk]);
});
afterAll(() => {
  if (asRoot) execFileSync('umount', ['-l', disk]);
  fs.rmSync(root, { recursive: true, force: true });
});

const filler = () => path.join(disk, 'filler');
function fill(): void {
  const fd = fs.openSync(filler(), 'w');
  try {
    for (;;) fs.writeSync(fd, Buffer.alloc(4096));
  } catch (e) {
    if ((e as NodeJS.ErrnoException).code !== 'ENOSPC') throw e;
  } finally {
    fs.closeSync(fd);
  }
}
const free = () => fs.rmSync(filler(), { force: true });
const tempFiles = (dir: string): string[] =>
  (fs.readdirSync(dir, { recursive: true }) as string[]).filter((f) => /\.tmp-/.test(f));

const T = 4000;
const trajectory = { tokens: Array(T).fill(7), logprobs: Array(T).fill(-1), versions: Array(T).fill(0), lossMask: Array(T).fill(1) };
const meta = { run: 'r', group: 0, episode: 0, segment: 0, reward: 1, finish: 'stop' };

maybe('store and journal writes on a full disk: ENOSPC naming the file, no temp file, then they succeed', async () => {
  fs.mkdirSync(path.join(disk, 'r', 'trajectories', 'g0'), { recursive: true });
  fs.mkdirSync(path.join(disk, 'r', 'partials', 'g0'), { recursive: true });
  fill();
  const key = trajectoryKey('r', 0, 0, 0);
  await expect(writeTrajectory(disk, key, trajectory, meta))
    .rejects.toThrow(`no space left on device (ENOSPC) writing ${path.join(disk, key)}`);
  const journal = new EpisodeJournal(disk, journalKey('r', 0, 0), null, { tokens: 64, seconds: 5 }, () => undefined);
  const { tokens, logprobs, versions } = trajectory;
  journal.recorded.calls.push({ prompt: 'p', token_ids: tokens, logprobs, versions, finish_reason: 'length' });
  await expect(journal.save())
    .rejects.toThrow(`no space left on device (ENOSPC) writing ${path.join(disk, journalKey('r', 0, 0))}`);
  expect(tempFiles(disk)).toEqual([]);

  free();
  await writeTrajectory(disk, key, trajectory, meta);
  expect(readTrajectory(disk, key).trajectory.tokens).toHaveLength(4000);
  const again = new EpisodeJournal(disk, journalKey('r', 0, 0), null, { tokens: 64, seconds: 5 }, () => undefined);
  again.recorded.calls.push(...journal.recorded.calls);
  await again.save();
  expect(JSON.parse(fs.readFileSync(path.join(disk, journalKey('r', 0, 0)), 'utf8')).calls).toHaveLength(1);
  expect(tempFiles(disk)).toEqual([]);
});

maybe('metrics on a full disk: ENOSPC naming metrics.jsonl, then one whole line per step', async () => {
  const endpoints = { engines: [], actor: '', token: '', storeRoot: disk };
  const big = Object.fromEntries(Array.from({ length: 2000 }, (_, i) => [`m/${i}`, i + 0.5]));
  await recordMetrics(endpoints, { runId: 'm', step: 1, metrics: { reward: 1 } });
  fill();
  await expect(recordMetrics(endpoints, { runId: 'm', step: 2, metrics: big }))
    .rejects.toThrow(`no space left on device (ENOSPC) writing ${metricsFile(disk, 'm')}`);
  free();
  expect(await recordMetrics(endpoints, { runId: 'm', step: 2, metrics: big })).toEqual({ written: true });
  expect((await readMetrics(disk, 'm')).map((m) => m.step)).toEqual([1, 2]);
});
