// Temporal workers: molt-control runs the workflows (and their metrics lines), molt-rollout the
// rollout activity, molt-actor the actor's activities. One process may serve any subset of the
// queues, so the stack can run (and kill) a rollout worker on its own. As a program:
// `tsx infra/worker.ts`, configured by env.
import * as path from 'node:path';
import { NativeConnection, Worker } from '@temporalio/worker';
import { createActivities } from '../activities';
import type { ServiceEndpoints } from '../activities/types';
import { TASK_QUEUES } from '../workflows/train-run';

export type QueueName = keyof typeof TASK_QUEUES;
export const ALL_QUEUES: QueueName[] = ['control', 'rollout', 'actor'];

export interface RunningWorkers {
  done: Promise<void>; // resolves when every worker has stopped
  shutdown(): Promise<void>;
}

export async function runWorkers(opts: { temporalAddress: string; endpoints: ServiceEndpoints; queues?: QueueName[]; namespace?: string }): Promise<RunningWorkers> {
  const connection = await NativeConnection.connect({ address: opts.temporalAddress });
  const common = { connection, namespace: opts.namespace ?? 'default' };
  const {
    rolloutGroup, evaluate, trainStep, sftStep, refit, checkpoint, claimActor, resumePoint, recordMetrics, writeRunConfig,
  } = createActivities(opts.endpoints);
  const make: Record<QueueName, () => Promise<Worker>> = {
    control: () => Worker.create({
      ...common, taskQueue: TASK_QUEUES.control, workflowsPath: path.join(__dirname, '..', 'workflows', 'index.ts'),
      activities: { recordMetrics, writeRunConfig },
    }),
    rollout: () => Worker.create({ ...common, taskQueue: TASK_QUEUES.rollout, activities: { rolloutGroup, evaluate } }),
    // One optimizer step at a time: the actor is a single trainer. This also makes the claims of
    // runs on the actor (claimActor) one at a time.
    actor: () => Worker.create({
      ...common, taskQueue: TASK_QUEUES.actor, activities: { trainStep, sftStep, refit, checkpoint, claimActor, resumePoint },
      maxConcurrentActivityTaskExecutions: 1,
    }),
  };
  const workers = await Promise.all((opts.queues ?? ALL_QUEUES).map((q) => make[q]()));
  const done = Promise.all(workers.map((w) => w.run())).then(() => connection.close());
  return {
    done,
    async shutdown() {
      for (const w of workers) if (w.getState() === 'RUNNING') w.shutdown();
      await done;
    },
  };
}

function parseQueues(value: string | undefined): QueueName[] {
  if (!value) return ALL_QUEUES;
  return value.split(',').map((raw) => {
    const q = raw.trim().replace(/^molt-/, '') as QueueName; // accepts "rollout" or "molt-rollout"
    if (!ALL_QUEUES.includes(q)) throw new Error(`MOLT_QUEUES: unknown queue "${raw}" (expected ${ALL_QUEUES.join(', ')})`);
    return q;
  });
}

async function main(): Promise<void> {
  const env = process.env;
  const endpoints: ServiceEndpoints = {
    engines: (env.MOLT_ENGINES ?? '').split(',').map((u) => u.trim()).filter(Boolean),
    actor: env.MOLT_ACTOR ?? '',
    token: env.MOLT_TOKEN ?? '',
    storeRoot: path.resolve(env.MOLT_STORE ?? 'runs'),
  };
  const queues = parseQueues(env.MOLT_QUEUES);
  if (queues.includes('rollout') && endpoints.engines.length === 0) throw new Error('MOLT_ENGINES: no engine URL (comma-separated) for the rollout queue');
  if (queues.includes('actor') && !endpoints.actor) throw new Error('MOLT_ACTOR: no actor URL for the actor queue');
  const temporalAddress = env.MOLT_TEMPORAL_ADDRESS ?? 'localhost:7233';
  // The workers stop on SIGINT/SIGTERM by themselves (the SDK's runtime handles those signals).
  const workers = await runWorkers({ temporalAddress, endpoints, queues });
  console.log(`molt worker ready: ${queues.map((q) => TASK_QUEUES[q]).join(', ')} on ${temporalAddress}`);
  await workers.done;
}

if (require.main === module) {
  main().catch((err) => { console.error(err instanceof Error ? err.message : err); process.exit(1); });
}
