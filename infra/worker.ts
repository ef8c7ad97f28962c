// Temporal workers: molt-control runs the workflows (and their metrics lines), molt-rollout the
// rollout activity, molt-actor the actor's activities. One process may serve any subset of the
// queues, so the stack can run (and kill) a rollout worker on its own. As a program:
// `tsx infra/worker.ts`: Temporal from its environment configuration (infra/temporal-config.ts), the
// services from a placement file (MOLT_PLACEMENT) and/or the variables MOLT_ENGINES, MOLT_POOLS (JSON), MOLT_ACTOR,
// MOLT_STORE, MOLT_TOKEN, which override it field by field (the local stack sets them per process).
import * as fs from 'node:fs';
import * as path from 'node:path';
import { NativeConnection, Worker, type NativeConnectionOptions } from '@temporalio/worker';
import { z } from 'zod';
import { createActivities } from '../activities';
import type { ServiceEndpoints } from '../activities/types';
import { TASK_QUEUES } from '../workflows/train-run';
import { temporalConfig } from './temporal-config';

export type QueueName = keyof typeof TASK_QUEUES;
export const ALL_QUEUES: QueueName[] = ['control', 'rollout', 'actor'];

export interface RunningWorkers {
  done: Promise<void>; // resolves when every worker has stopped
  shutdown(): Promise<void>;
}

export async function runWorkers(opts: {
  temporalAddress: string; connectionOptions?: NativeConnectionOptions; endpoints: ServiceEndpoints; queues?: QueueName[]; namespace?: string;
}): Promise<RunningWorkers> {
  const connection = await NativeConnection.connect(opts.connectionOptions ?? { address: opts.temporalAddress });
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

// Where the services are, one file for every worker of a cluster (paths relative to the file):
//   {"engines": ["http://10.0.0.5:8100"], "actor": "http://10.0.0.7:8200", "store": "/shared/runs", "token_file": "/etc/molt/token",
//    "pools": {"judge": ["http://10.0.0.6:8100"]}}   (pools: a recipe's other engine pools, never refit)
const Pools = z.record(z.string(), z.array(z.url()));
const Placement = z.strictObject({
  engines: z.array(z.url()).optional(), actor: z.url().optional(), store: z.string().optional(), token_file: z.string().optional(),
  pools: Pools.optional(),
});
export function parsePools(value: string): Record<string, string[]> {
  let json: unknown;
  try { json = JSON.parse(value); } catch { /* reported below */ }
  const parsed = Pools.safeParse(json);
  if (!parsed.success) throw new Error(`MOLT_POOLS: expected JSON {"<pool>": ["http://...", ...]}, got ${value}`);
  return parsed.data;
}
export function readPlacement(file: string): z.infer<typeof Placement> {
  let json: unknown;
  try {
    json = JSON.parse(fs.readFileSync(file, 'utf8'));
  } catch (err) {
    throw new Error(`MOLT_PLACEMENT ${file}: ${(err as Error).message}`);
  }
  const parsed = Placement.safeParse(json);
  if (!parsed.success) {
    const issue = parsed.error.issues[0];
    throw new Error(`MOLT_PLACEMENT ${file}: ${issue.path.join('.') || 'the file'}: ${issue.message}`);
  }
  const at = (p: string | undefined) => (p === undefined ? undefined : path.resolve(path.dirname(file), p));
  return { ...parsed.data, store: at(parsed.data.store), token_file: at(parsed.data.token_file) };
}

async function main(): Promise<void> {
  const env = process.env;
  const placed = env.MOLT_PLACEMENT ? readPlacement(env.MOLT_PLACEMENT) : {};
  const endpoints: ServiceEndpoints = {
    engines: env.MOLT_ENGINES !== undefined ? env.MOLT_ENGINES.split(',').map((u) => u.trim()).filter(Boolean) : placed.engines ?? [],
    pools: env.MOLT_POOLS !== undefined ? parsePools(env.MOLT_POOLS) : placed.pools ?? {},
    actor: env.MOLT_ACTOR ?? placed.actor ?? '',
    token: env.MOLT_TOKEN ?? (placed.token_file ? fs.readFileSync(placed.token_file, 'utf8').trim() : ''),
    storeRoot: path.resolve(env.MOLT_STORE ?? placed.store ?? 'runs'),
  };
  const queues = parseQueues(env.MOLT_QUEUES);
  if (queues.includes('rollout') && endpoints.engines.length === 0) throw new Error('no engine URL for the rollout queue: MOLT_PLACEMENT engines, or MOLT_ENGINES (comma-separated)');
  if (queues.includes('actor') && !endpoints.actor) throw new Error('no actor URL for the actor queue: MOLT_PLACEMENT actor, or MOLT_ACTOR');
  const { connectionOptions, namespace } = temporalConfig();
  const temporalAddress = connectionOptions.address!;
  // The workers stop on SIGINT/SIGTERM by themselves (the SDK's runtime handles those signals).
  const workers = await runWorkers({ temporalAddress, connectionOptions, namespace, endpoints, queues });
  console.log(`molt worker ready: ${queues.map((q) => TASK_QUEUES[q]).join(', ')} on ${temporalAddress} (namespace ${namespace})`);
  await workers.done;
}

if (require.main === module) {
  main().catch((err) => { console.error(err instanceof Error ? err.message : err); process.exit(1); });
}
