// `molt-client schedule ...`: recipe runs on a Temporal Schedule. Each firing starts workflow
// `molt-<scheduleId>-<time>`, and that id names the run (store directory, actor steps).
import { ScheduleNotFoundError, ScheduleOverlapPolicy, type Client, type Connection, type ScheduleDescription, type ScheduleSpec } from '@temporalio/client';
import { loadRecipe } from '../agents/recipe';
import { runWorkflowId } from '../workflows/train-run';
import { RunNotFound, UsageError } from './errors';
import { hasSearchAttributes, runStartOptions } from './start-options';

export const SCHEDULE_USAGE = `  schedule create <id> <recipeDir> (--cron "0 2 * * *" | --every 1h) [--overlap skip] [--note TEXT] [--dotted.key value ...]
  schedule list | describe <id> | pause <id> [--note TEXT] | unpause <id> | trigger <id> | delete <id>
      overlap (a firing while the last run still runs): ${Object.keys(ScheduleOverlapPolicy).filter((k) => k !== 'UNSPECIFIED').map((k) => k.toLowerCase()).join(', ')}`;

interface Args { positional: string[]; overrides: Record<string, string> }

export async function scheduleCommand({ client, connection }: { client: Client; connection: Connection }, args: Args): Promise<void> {
  const [sub, id, recipeDir] = args.positional;
  const { cron, every, overlap, note, ...recipeOverrides } = args.overrides;
  if (sub === 'list') {
    let count = 0;
    for await (const s of client.schedule.list()) {
      count++;
      const next = s.info.nextActionTimes[0]?.toISOString() ?? '-';
      console.log(`${s.scheduleId}\t${s.state.paused ? 'PAUSED' : 'ACTIVE'}\t${s.memo?.spec ?? describeSpec(s.spec)}\tnext ${next}\t${s.memo?.recipe ?? ''}`);
    }
    if (count === 0) console.log('no schedules');
    return;
  }
  if (!sub || !id) throw new UsageError(`schedule: expected a subcommand and a schedule id\n${SCHEDULE_USAGE}`);
  if (sub === 'create') {
    if (!recipeDir) throw new UsageError(`schedule create: missing <recipeDir>\n${SCHEDULE_USAGE}`);
    if ((cron === undefined) === (every === undefined)) throw new UsageError('schedule create: give exactly one of --cron "<expr>" or --every <interval> (e.g. 1h, 30m)');
    const policy = (overlap ?? 'skip').toUpperCase();
    if (!(policy in ScheduleOverlapPolicy) || policy === 'UNSPECIFIED') throw new UsageError(`--overlap: "${overlap}" is not a policy\n${SCHEDULE_USAGE}`);
    const config = loadRecipe(recipeDir, recipeOverrides);
    const spec: ScheduleSpec = cron !== undefined ? { cronExpressions: [cron] } : { intervals: [{ every: every as never }] };
    const start = runStartOptions(recipeDir, config, undefined, await hasSearchAttributes(connection));
    try {
      await client.schedule.create({
        scheduleId: id, spec, memo: { ...start.memo, spec: describeSpec(spec) }, // the server turns cron into calendars: keep the words
        policies: { overlap: policy as ScheduleOverlapPolicy },
        state: note ? { note } : undefined,
        action: { type: 'startWorkflow', workflowType: 'trainRun', workflowId: runWorkflowId(id), ...start },
      });
    } catch (err) {
      throw new UsageError(`schedule create ${id}: ${(err as Error).message}`); // e.g. a bad cron expression or a taken id
    }
    console.log(`schedule ${id} created: ${describeSpec(spec)}, overlap ${policy.toLowerCase()}; runs are molt-${id}-<time>`);
    return;
  }
  const handle = client.schedule.getHandle(id);
  try {
    switch (sub) {
      case 'describe': console.log(describeSchedule(await handle.describe())); return;
      case 'pause': await handle.pause(note); console.log(`schedule ${id} paused`); return;
      case 'unpause': await handle.unpause(note); console.log(`schedule ${id} unpaused`); return;
      case 'trigger': await handle.trigger(); console.log(`schedule ${id} triggered`); return;
      case 'delete': await handle.delete(); console.log(`schedule ${id} deleted`); return;
      default: throw new UsageError(`schedule: unknown subcommand "${sub}"\n${SCHEDULE_USAGE}`);
    }
  } catch (err) {
    if (err instanceof ScheduleNotFoundError) throw new RunNotFound(`no schedule ${id}`);
    throw err;
  }
}

function describeSpec(spec: ScheduleSpec | ScheduleDescription['spec'] | undefined): string {
  if (!spec) return '-';
  const cron = (spec as ScheduleSpec).cronExpressions ?? [];
  const intervals = (spec.intervals ?? []).map((i) => `every ${typeof i.every === 'number' ? `${i.every / 1000}s` : i.every}`);
  const calendars = (spec.calendars ?? []).map((c) => `calendar ${JSON.stringify(c)}`);
  return [...cron.map((c) => `cron "${c}"`), ...intervals, ...calendars].join(', ') || '-';
}

function describeSchedule(d: ScheduleDescription): string {
  const recent = d.info.recentActions.map((a) => `    ${a.takenAt.toISOString()} -> ${a.action.type === 'startWorkflow' ? a.action.workflow.workflowId : a.action.type}`);
  return [
    `schedule ${d.scheduleId}: ${d.state.paused ? 'PAUSED' : 'ACTIVE'}${d.state.note ? ` (${d.state.note})` : ''}`,
    `  spec: ${d.memo?.spec ?? describeSpec(d.spec)}, overlap ${d.policies.overlap?.toLowerCase() ?? 'skip'}`,
    `  recipe: ${d.memo?.recipe ?? '-'} (${d.memo?.recipeDir ?? '-'})`,
    `  runs started: ${d.info.numActionsTaken}, running now: ${d.info.runningActions.map((a) => a.workflow.workflowId).join(', ') || 'none'}`,
    `  next: ${d.info.nextActionTimes.slice(0, 3).map((t) => t.toISOString()).join(', ') || '-'}`,
    `  recent runs:\n${recent.join('\n') || '    none'}`,
  ].join('\n');
}
