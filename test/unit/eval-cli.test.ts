// `molt-client eval` as a user runs it (a tsx child process): a clear error for a checkpoint that is
// not there, and an evaluation of a model directory (the tiny model stands in for a checkpoint).
import * as path from 'node:path';
import { REPO_ROOT } from '../../agents/recipe';
import { tinyModel } from './gpu-services';
import { runCli } from '../helpers/cli';

const COPY_DIR = path.join(REPO_ROOT, 'recipes', 'copy');

const cli = (...args: string[]) => runCli(args, { OMP_NUM_THREADS: '1' });

test('eval of a missing checkpoint exits 2 naming it', async () => {
  const { code, stderr } = await cli('eval', '/nonexistent/step-7', COPY_DIR);
  expect(code).toBe(2);
  expect(stderr).toContain('checkpoint /nonexistent/step-7 does not exist');
  const notCheckpoint = await cli('eval', COPY_DIR, COPY_DIR);
  expect(notCheckpoint.code).toBe(2);
  expect(notCheckpoint.stderr).toContain(`${COPY_DIR} is not a checkpoint: it needs config.json and *.safetensors`);
}, 30_000);

test('eval prints greedy reward and pass@k of the model it serves', async () => {
  const { code, stdout, stderr } = await cli('eval', tinyModel(), COPY_DIR, '--prompts', '2', '--samples', '3');
  expect(stderr).not.toMatch(/error/i);
  expect(code).toBe(0);
  expect(stdout).toContain('2 held-out prompts, 3 samples each');
  expect(stdout).toMatch(/greedy reward \d\.\d{4}, sample reward mean \d\.\d{4}/);
  expect(stdout).toMatch(/pass@1 \d\.\d{4}, pass@3 \d\.\d{4}/);
  console.log(stdout);
}, 90_000);
