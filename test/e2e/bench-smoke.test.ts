// `npm run bench` itself is too long for CI; its smoke mode runs every part of it on tiny sizes
// against real stacks (and a real dev server), and the report must come out whole.
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { REPO_ROOT } from '../../agents/recipe';

test('bench --smoke writes a report with every part measured', () => {
  const res = spawnSync(path.join(REPO_ROOT, 'node_modules', '.bin', 'tsx'), ['bench/run.ts', '--smoke'], { cwd: REPO_ROOT, encoding: 'utf8' });
  expect(res.status).toBe(0);
  const report = JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'bench-out', 'report.json'), 'utf8'));

  expect(report.orchestration).toHaveLength(1);
  const row = report.orchestration[0];
  expect(row.plainMsPerStep).toBeGreaterThan(0);
  expect(row.temporalMsPerStep).toBeGreaterThan(0);
  expect(row.ratio).toBeCloseTo(row.temporalMsPerStep / row.plainMsPerStep, 6);

  const [util] = report.utilization;
  for (const busy of [util.streamingBusy, util.syncBusy]) {
    expect(busy).toBeGreaterThan(0);
    expect(busy).toBeLessThanOrEqual(1);
  }
  expect(util.syncTokensPerSecond).toBeGreaterThan(0);

  // pause mode keep loses nothing: every generation finishes whole, nothing is regenerated
  const [keep, abort] = report.partial;
  expect(keep).toMatchObject({ mode: 'keep', discardedTokens: 0, regenerated: 0, usefulTokens: 4 * 64 });
  expect(abort).toMatchObject({ mode: 'abort', usefulTokens: 4 * 64 });

  expect(report.scale.map((r: { inflight: number }) => r.inflight)).toEqual([4, 8]);
  for (const r of report.scale) {
    expect(r.trajectoriesPerSecond).toBeGreaterThan(0);
    expect(r.eventsPerGroup).toBeGreaterThan(0);
    expect(r.stepSeconds).toHaveLength(r.steps - 1);
    expect(r.executions).toBeGreaterThanOrEqual(1);
  }
  // the engine benchmark ran (a smoke run of bench/engine.py: 1 and 4 concurrent, then refit)
  expect(report.engine.rows).toHaveLength(3);
  for (const r of report.engine.rows) expect(r.ratio).toBeGreaterThan(0);
  const [orchestration] = report.orchestration;
  expect(orchestration.ratios).toHaveLength(1);
  expect(orchestration.serverCpuPerStep).toBeGreaterThan(0);
  expect(orchestration.controlWorkerCpuPerStep).toBeGreaterThan(0);
  expect(report.drain).toMatchObject({ steps: 2, every: 1, continueAsNew: 1 }); // the run drained and continued as new once
  expect(fs.readFileSync(path.join(REPO_ROOT, 'bench-out', 'report.md'), 'utf8')).toContain('| smoke | 3 | 2 | 1 |');
});
