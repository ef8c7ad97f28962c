// The run's folder kept bounded: which manifests, trajectories, journals and checkpoints a
// collection removes, and what it must keep (the steps a restarted actor replays, groups that may
// still be trained, the latest checkpoint); `molt-client gc` on a run that ended.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { collectGarbage, runConfigPath, writeRunConfig } from '../../activities/run-folder';
import { trajectoryKey } from '../../activities/store';
import { RecipeConfig } from '../../agents/recipe';
import { gcRun } from '../../client/gc';

let storeRoot: string;
beforeEach(() => { storeRoot = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-gc-')); });
afterEach(() => { fs.rmSync(storeRoot, { recursive: true, force: true }); });

const write = (rel: string, text: string) => {
  fs.mkdirSync(path.dirname(path.join(storeRoot, rel)), { recursive: true });
  fs.writeFileSync(path.join(storeRoot, rel), text);
};

// Steps 1..6 trained groups (2s-2, 2s-1); group 12 was dropped; 13 and 14 are waiting or in flight
// (14 has a journal). Checkpoints at steps 2, 4 and 6.
function makeRun(runId: string): void {
  for (let step = 1; step <= 6; step++) {
    const refs = [2 * step - 2, 2 * step - 1].flatMap((g) => [0, 1].map((e) => trajectoryKey(runId, g, e, 0)));
    write(`${runId}/steps/step-${step}.json`, JSON.stringify({ refs, algo: {} }));
  }
  for (let g = 0; g <= 14; g++) for (const e of [0, 1]) write(trajectoryKey(runId, g, e, 0), 'x'.repeat(100 + g));
  write(`${runId}/partials/g14/e1.json`, '{"calls":[]}');
  write(`${runId}/partials/g3/e0.json`, '{"calls":[]}'); // left by a lost worker
  for (const step of [2, 4, 6]) {
    write(`${runId}/checkpoints/step-${step}/model.safetensors`, 'w'.repeat(1000));
    write(`${runId}/checkpoints/step-${step}/trainer_state.json`, JSON.stringify({ step }));
  }
  write(`${runId}/checkpoints/latest`, path.join(storeRoot, runId, 'checkpoints', 'step-6'));
  write(`${runId}/metrics.jsonl`, '{"step":1}\n');
}

// Every file and directory under the run's folder (relative), and the bytes of the files.
function tree(runId: string): { entries: string[]; bytes: number } {
  const entries: string[] = [];
  let bytes = 0;
  const walk = (dir: string) => {
    for (const name of fs.readdirSync(dir)) {
      const full = path.join(dir, name);
      entries.push(path.relative(path.join(storeRoot, runId), full));
      if (fs.statSync(full).isDirectory()) walk(full); else bytes += fs.statSync(full).size;
    }
  };
  walk(path.join(storeRoot, runId));
  return { entries: entries.sort(), bytes };
}
const groupsIn = (entries: string[], kind: string) =>
  [...new Set(entries.flatMap((e) => { const m = new RegExp(`^${kind}/g(\\d+)$`).exec(e); return m ? [Number(m[1])] : []; }))].sort((a, b) => a - b);

test('a collection after checkpoint 5 keeps the steps after it, the kept steps and live groups; it counts what it removed', async () => {
  makeRun('r');
  const before = tree('r');
  // Checkpoint at step 5 with keep_steps 1: steps 1-4 go (and their groups 0-7); groups 13+ are live.
  const removed = await collectGarbage(storeRoot, 'r', { keepAfterStep: 4, liveFrom: 13, keepCheckpoints: 1 });
  const after = tree('r');
  expect(after.entries.filter((e) => e.startsWith('steps/'))).toEqual(['steps/step-5.json', 'steps/step-6.json']);
  expect(groupsIn(after.entries, 'trajectories')).toEqual([8, 9, 10, 11, 13, 14]); // 12 was dropped: gone
  expect(groupsIn(after.entries, 'partials')).toEqual([14]);
  expect(after.entries.filter((e) => /^checkpoints\/[^/]+$/.test(e))).toEqual(['checkpoints/latest', 'checkpoints/step-6']);
  expect(after.entries).toContain('metrics.jsonl');
  expect(removed).toEqual({ files: before.entries.length - after.entries.length, bytes: before.bytes - after.bytes });
  // A retried collection finds nothing more.
  expect(await collectGarbage(storeRoot, 'r', { keepAfterStep: 4, liveFrom: 13, keepCheckpoints: 1 })).toEqual({ files: 0, bytes: 0 });
});

test('the latest checkpoint stays whatever keep_checkpoints says; null keeps them all; above liveFrom only trained groups go', async () => {
  makeRun('r');
  write('r/checkpoints/latest', path.join(storeRoot, 'r', 'checkpoints', 'step-4')); // step-6 being written
  await collectGarbage(storeRoot, 'r', { keepAfterStep: 0, liveFrom: 0, keepCheckpoints: 1 });
  const entries = tree('r').entries;
  expect(entries.filter((e) => /^checkpoints\/step-\d+$/.test(e))).toEqual(['checkpoints/step-4', 'checkpoints/step-6']);
  expect(groupsIn(entries, 'trajectories')).toEqual([...Array(15).keys()]);
  // Groups a deleted manifest names go even above liveFrom (a slow group holds liveFrom low).
  makeRun('t');
  await collectGarbage(storeRoot, 't', { keepAfterStep: 4, liveFrom: 2, keepCheckpoints: null });
  expect(groupsIn(tree('t').entries, 'trajectories')).toEqual([8, 9, 10, 11, 12, 13, 14]);
  makeRun('s');
  await collectGarbage(storeRoot, 's', { keepAfterStep: 6, liveFrom: 13, keepCheckpoints: null });
  expect(tree('s').entries.filter((e) => /^checkpoints\/step-\d+$/.test(e))).toHaveLength(3);
});

test('molt-client gc on a run that ended: its own store policy from config.json, every group done, the checkpoint from latest', async () => {
  makeRun('done');
  const config = RecipeConfig.parse({
    ...JSON.parse(fs.readFileSync(path.join(__dirname, '..', '..', 'recipes', 'copy', 'recipe.json'), 'utf8')),
    store: { keep_steps: 2, keep_checkpoints: 2 },
  });
  await writeRunConfig(storeRoot, { runId: 'done', recipeDir: '/recipes/copy', config });
  expect(JSON.parse(fs.readFileSync(runConfigPath(storeRoot, 'done'), 'utf8')).config).toEqual(config);
  const { policy } = await gcRun(storeRoot, 'done', 'ended');
  expect(policy).toEqual({ keepAfterStep: 4, liveFrom: Number.MAX_SAFE_INTEGER, keepCheckpoints: 2 });
  const entries = tree('done').entries;
  expect(groupsIn(entries, 'trajectories')).toEqual([8, 9, 10, 11]); // steps 5 and 6; leftovers 12-14 gone
  expect(groupsIn(entries, 'partials')).toEqual([]);
  expect(entries.filter((e) => /^checkpoints\/step-\d+$/.test(e))).toEqual(['checkpoints/step-4', 'checkpoints/step-6']);
  // A running run: the loop's answer bounds it; flags override the policy.
  makeRun('running');
  await gcRun(storeRoot, 'running', { checkpointStep: 4, liveFrom: 10 }, { keepSteps: 0 });
  expect(groupsIn(tree('running').entries, 'trajectories')).toEqual([...Array(15).keys()].slice(8));
  await expect(gcRun(storeRoot, 'nope', 'ended')).rejects.toThrow(`gc: no folder for run nope in ${storeRoot}`);
});
