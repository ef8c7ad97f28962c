// `npm run bench` itself is too long for CI; its smoke mode runs every loop of it on tiny sizes
// against real stacks, and the report must come out whole.
import { spawnSync } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import { REPO_ROOT } from '../../agents/recipe';

test('bench --smoke writes a report with both loops measured', () => {
  const res = spawnSync(path.join(REPO_ROOT, 'node_modules', '.bin', 'tsx'), ['infra/bench.ts', '--smoke'], { cwd: REPO_ROOT, encoding: 'utf8' });
  expect(res.status).toBe(0);
  const report = JSON.parse(fs.readFileSync(path.join(REPO_ROOT, 'bench-out', 'report.json'), 'utf8'));
  expect(report.orchestration).toHaveLength(1);
  const row = report.orchestration[0];
  expect(row.plainMsPerStep).toBeGreaterThan(0);
  expect(row.temporalMsPerStep).toBeGreaterThan(0);
  expect(row.ratio).toBeCloseTo(row.temporalMsPerStep / row.plainMsPerStep, 6);
  expect(fs.readFileSync(path.join(REPO_ROOT, 'bench-out', 'report.md'), 'utf8')).toContain('| smoke | 2 |');
});
