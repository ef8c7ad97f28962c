// What a run's folder in the store keeps. <storeRoot>/<runId>/ holds
//   config.json                        the resolved config the run started with (rewritten by each execution)
//   trajectories/g<group>/e<ep>-s<seg>.safetensors   one file per episode segment (activities/store.ts)
//   partials/g<group>/e<ep>.json       journals of unfinished episodes (deleted once the episode is stored)
//   steps/step-<n>.json                what step n trained (activities/actor.ts)
//   checkpoints/step-<n>/, latest      weights and optimizer state
//   metrics.jsonl, tensorboard/        per-step metrics
// Without collection a 600-step run of the embedded recipe left 154,675 files (711 MB).
//
// Garbage, once step `c` is checkpointed: the manifests of steps <= c (a restarted actor loads the
// latest checkpoint and replays only the steps after it) and the trajectories (and their images) of those steps, except
// the last `store.keep_steps` of them (to look at). What a later step may still train must stay:
// groups in flight or waiting for a batch. Group indexes only grow, so the loop names them by one
// number, `liveFrom`: every group below it has been trained or dropped. A group dir that no kept
// manifest names is deleted whole if a deleted manifest names it or it is below `liveFrom` (which
// covers dropped groups and, once the run has ended, cancelled leftovers).
import { existsSync, promises as fs, readFileSync } from 'node:fs';
import * as path from 'node:path';
import type { RecipeConfig } from '../agents/recipe';
import { writeFileAtomic } from './store';

export interface GcPolicy {
  keepAfterStep: number; // manifests of steps <= this go, and their trajectories
  liveFrom: number; // groups with index >= this may still be trained: never touched
  keepCheckpoints: number | null; // the newest this many checkpoints stay (and always the latest); null: all
}
export interface GcResult { files: number; bytes: number } // removed: files and directories, bytes of files

export function runConfigPath(storeRoot: string, runId: string): string {
  return path.join(storeRoot, runId, 'config.json');
}

// The run's newest complete checkpoint and the step it holds; null before the first. `checkpoints/latest`
// holds the folder's path as written; it is found here by its name (the store may have moved since).
export function latestCheckpoint(storeRoot: string, runId: string): { step: number; path: string } | null {
  const checkpoints = path.join(storeRoot, runId, 'checkpoints');
  if (!existsSync(path.join(checkpoints, 'latest'))) return null;
  const dir = path.join(checkpoints, path.basename(readFileSync(path.join(checkpoints, 'latest'), 'utf8').trim()));
  return { step: (JSON.parse(readFileSync(path.join(dir, 'trainer_state.json'), 'utf8')) as { step: number }).step, path: dir };
}

export interface RunConfigInput { runId: string; recipeDir: string; config: RecipeConfig }
export async function writeRunConfig(storeRoot: string, input: RunConfigInput): Promise<void> {
  await writeFileAtomic(runConfigPath(storeRoot, input.runId), `${JSON.stringify(input, null, 2)}\n`);
}
// What a group's activity runs with (activities/types.ts, RolloutGroupInput). A `set` rewrites the file with
// live settings only: of those the rollout reads batch.groups alone, to pick the groups that carry a sample.
export async function readRunConfig(storeRoot: string, runId: string): Promise<RunConfigInput> {
  const file = runConfigPath(storeRoot, runId);
  const text = await fs.readFile(file, 'utf8').catch((e: NodeJS.ErrnoException) => {
    throw new Error(`run ${runId}: cannot read its config ${file} (${e.code ?? e.message}); the run writes it before it `
      + `starts groups, so this worker's store root (${storeRoot}) must be the control worker's`);
  });
  return JSON.parse(text) as RunConfigInput;
}

// Entries of `dir` named like `pattern` (one numeric capture), with their numbers; none if it is missing.
async function numbered(dir: string, pattern: RegExp): Promise<{ name: string; n: number }[]> {
  const names = await fs.readdir(dir).catch((e) => { if (e.code === 'ENOENT') return [] as string[]; throw e; });
  return names.flatMap((name) => { const m = pattern.exec(name); return m ? [{ name, n: Number(m[1]) }] : []; });
}

// Removes a file or a tree, adding what it held to `removed`.
async function remove(target: string, removed: GcResult): Promise<void> {
  const stat = await fs.lstat(target).catch(() => null);
  if (!stat) return;
  if (stat.isDirectory()) {
    for (const name of await fs.readdir(target)) await remove(path.join(target, name), removed);
    await fs.rmdir(target);
  } else {
    await fs.unlink(target);
    removed.bytes += stat.size;
  }
  removed.files++;
}

export async function collectGarbage(storeRoot: string, runId: string, policy: GcPolicy): Promise<GcResult> {
  const runDir = path.join(storeRoot, runId);
  const removed: GcResult = { files: 0, bytes: 0 };
  const keptGroups = new Set<number>(); // named by a kept manifest
  const doneGroups = new Set<number>(); // named by a manifest that goes: trained, inside the checkpoint
  for (const { name, n } of await numbered(path.join(runDir, 'steps'), /^step-(\d+)\.json$/)) {
    const file = path.join(runDir, 'steps', name);
    const { refs } = JSON.parse(await fs.readFile(file, 'utf8')) as { refs: string[] };
    for (const ref of refs) {
      const m = /\/trajectories\/g(\d+)\//.exec(ref);
      if (m) (n <= policy.keepAfterStep ? doneGroups : keptGroups).add(Number(m[1]));
    }
    if (n <= policy.keepAfterStep) await remove(file, removed);
  }
  for (const kind of ['trajectories', 'partials', 'images']) {
    for (const { name, n } of await numbered(path.join(runDir, kind), /^g(\d+)$/)) {
      if (!keptGroups.has(n) && (n < policy.liveFrom || doneGroups.has(n))) await remove(path.join(runDir, kind, name), removed);
    }
  }
  if (policy.keepCheckpoints !== null) {
    const latest = await fs.readFile(path.join(runDir, 'checkpoints', 'latest'), 'utf8')
      .then((s) => path.basename(s.trim()), () => null);
    const saved = (await numbered(path.join(runDir, 'checkpoints'), /^step-(\d+)$/)).sort((a, b) => b.n - a.n);
    for (const { name } of saved.slice(policy.keepCheckpoints)) {
      if (name !== latest) await remove(path.join(runDir, 'checkpoints', name), removed);
    }
  }
  return removed;
}
