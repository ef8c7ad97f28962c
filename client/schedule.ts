// `molt-client schedule ...`: recipe runs on a Temporal Schedule. Each firing starts workflow
// `molt-<scheduleId>-<time>`, and that id names the run (store directory, actor steps).
import {
  ScheduleNotFoundError, ScheduleOverlapPolicy, type ScheduleDescription, type ScheduleHandle, type ScheduleSpec,
} from '@temporalio/client';
import type { Command } from 'commander';
import { loadRecipe } from '../agents/recipe';
import { runWorkflowId, type TrainRunInput } from '../workflows/train-run';
import { connect, recipeKeysHelp } from './command';
import { RunNotFound, UsageError } from './errors';
import { hasSearchAttributes, runStartOptions } from './start-options';

interface CreateOptions { cron?: string; every?: string; overlap: string; note?: string; continueFromSchedule?: boolean }
const OVERLAP_POLICIES = Object.keys(ScheduleOverlapPolicy).filter((k) => k !== 'UNSPECIFIED').map((k) => k.toLowerCase());

// `schedule create|list|describe|pause|unpause|trigger|delete`. `withOverrides` marks a command
// that takes recipe overrides (cli.ts collects them into `overrides`).
export function addScheduleCommands(program: Command, { overrides, withOverrides }: {
  overrides: Record<string, string>; withOverrides: (command: Command) => Command;
}): void {
  const schedule = program.command('schedule').description('recipe runs on a Temporal Schedule (cron or interval)');
  withOverrides(schedule.command('create'))
    .description('a schedule whose every firing starts a run molt-<id>-<time> of the recipe')
    .argument('<id>').argument('<recipeDir>')
    .option('--cron <expr>', 'cron expression, e.g. "0 2 * * *"')
    .option('--every <interval>', 'interval, e.g. 1h, 30m')
    .option('--overlap <policy>', `a firing while the last run still runs: ${OVERLAP_POLICIES.join(', ')}`, 'skip')
    .option('--note <text>', 'a note on the schedule')
    .option('--continue-from-schedule', 'each firing starts from the latest checkpoint of the previous firing (a lineage)')
    .addHelpText('after', () => `\n${recipeKeysHelp()}`)
    .action(async (id: string, recipeDir: string, opts: CreateOptions) => {
      const { cron, every, overlap, note, continueFromSchedule } = opts;
      if ((cron === undefined) === (every === undefined)) {
        throw new UsageError('schedule create: give exactly one of --cron "<expr>" or --every <interval> (e.g. 1h, 30m)');
      }
      if (!OVERLAP_POLICIES.includes(overlap)) {
        throw new UsageError(`--overlap: "${overlap}" is not a policy (${OVERLAP_POLICIES.join(', ')})`);
      }
      const policy = overlap.toUpperCase() as ScheduleOverlapPolicy;
      const config = loadRecipe(recipeDir, overrides);
      const spec: ScheduleSpec = cron !== undefined
        ? { cronExpressions: [cron] } : { intervals: [{ every: every as never }] };
      const { client, connection } = await connect();
      const start = runStartOptions(recipeDir, config, undefined, await hasSearchAttributes(connection, client.options.namespace));
      if (continueFromSchedule) start.args[0].lineage = id;
      try {
        await client.schedule.create({
          // the server turns cron into calendars: the memo keeps the words
          scheduleId: id, spec, memo: { ...start.memo, spec: describeSpec(spec) },
          policies: { overlap: policy },
          state: note ? { note } : undefined,
          action: { type: 'startWorkflow', workflowType: 'trainRun', workflowId: runWorkflowId(id), ...start },
        });
      } catch (err) {
        throw new UsageError(`schedule create ${id}: ${(err as Error).message}`); // e.g. a bad cron expression or a taken id
      }
      console.log(`schedule ${id} created: ${describeSpec(spec)}, overlap ${overlap}; runs are molt-${id}-<time>` +
        (continueFromSchedule ? ', each starting from the previous one\'s latest checkpoint' : ''));
    });

  schedule.command('list').description('all schedules, with their next firing').action(async () => {
    let count = 0;
    for await (const s of (await connect()).client.schedule.list()) {
      count++;
      const next = s.info.nextActionTimes[0]?.toISOString() ?? '-';
      const spec = s.memo?.spec ?? describeSpec(s.spec);
      console.log(`${s.scheduleId}\t${s.state.paused ? 'PAUSED' : 'ACTIVE'}\t${spec}\tnext ${next}\t${s.memo?.recipe ?? ''}`);
    }
    if (count === 0) console.log('no schedules');
  });

  // The commands on one schedule: what each does, and what it prints after (null: the description it fetched).
  // A schedule that does not exist is RunNotFound (exit 1).
  const onSchedule: [string, string, (h: ScheduleHandle, note?: string) => Promise<unknown>, string | null][] = [
    ['describe', 'spec, policy, recipe, next firings and recent runs', (h) => h.describe(), null],
    ['pause', 'no firings until unpaused', (h, note) => h.pause(note), 'paused'],
    ['unpause', 'fire again', (h, note) => h.unpause(note), 'unpaused'],
    ['trigger', 'fire now (the overlap policy applies)', (h) => h.trigger(), 'triggered'],
    ['delete', 'delete the schedule (its runs go on)', (h) => h.delete(), 'deleted'],
  ];
  for (const [name, description, run, done] of onSchedule) {
    const command = schedule.command(name).description(description).argument('<id>');
    if (name === 'pause' || name === 'unpause') command.option('--note <text>', 'a note on the schedule');
    command.action(async (id: string, opts: { note?: string }) => {
      try {
        const result = await run((await connect()).client.schedule.getHandle(id), opts.note);
        console.log(done ? `schedule ${id} ${done}` : describeSchedule(result as ScheduleDescription));
      } catch (err) {
        if (err instanceof ScheduleNotFoundError) throw new RunNotFound(`no schedule ${id}`);
        throw err;
      }
    });
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
  const recent = d.info.recentActions.map((a) =>
    `    ${a.takenAt.toISOString()} -> ${a.action.type === 'startWorkflow' ? a.action.workflow.workflowId : a.action.type}`);
  return [
    `schedule ${d.scheduleId}: ${d.state.paused ? 'PAUSED' : 'ACTIVE'}${d.state.note ? ` (${d.state.note})` : ''}`,
    `  spec: ${d.memo?.spec ?? describeSpec(d.spec)}, overlap ${d.policies.overlap?.toLowerCase() ?? 'skip'}`,
    `  recipe: ${d.memo?.recipe ?? '-'} (${d.memo?.recipeDir ?? '-'})` +
      (d.action.type === 'startWorkflow' && (d.action.args?.[0] as TrainRunInput | undefined)?.lineage
        ? ', each firing from the previous one\'s latest checkpoint' : ''),
    `  runs started: ${d.info.numActionsTaken}, ` +
      `running now: ${d.info.runningActions.map((a) => a.workflow.workflowId).join(', ') || 'none'}`,
    `  next: ${d.info.nextActionTimes.slice(0, 3).map((t) => t.toISOString()).join(', ') || '-'}`,
    `  recent runs:\n${recent.join('\n') || '    none'}`,
  ].join('\n');
}
