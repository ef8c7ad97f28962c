// `molt-client eval <checkpointDir> <recipeDir>`: the recipe's held-out evaluation (activities/evaluate.ts)
// of a checkpoint, outside any run: a local stack whose engines serve the checkpoint, the evaluate
// activity run in-process, the figures printed.
import * as fs from 'node:fs';
import * as os from 'node:os';
import * as path from 'node:path';
import { MockActivityEnvironment } from '@temporalio/testing';
import { evaluate, type EvaluateResult } from '../activities/evaluate';
import { loadRecipe } from '../agents/recipe';
import { EngineRouter } from '../agents/router';
import { UsageError } from './errors';

// overrides: recipe overrides (`molt-client eval` turns --prompts N and --samples N into eval.prompts, eval.samples).
export async function evalCheckpoint(
  checkpointDir: string, recipeDir: string, overrides: Record<string, string>,
): Promise<EvaluateResult> {
  const dir = path.resolve(checkpointDir);
  const files = fs.existsSync(dir) && fs.statSync(dir).isDirectory() ? fs.readdirSync(dir) : null;
  if (files === null) throw new UsageError(`eval: checkpoint ${dir} does not exist (or is not a directory)`);
  if (!files.includes('config.json') || !files.some((f) => f.endsWith('.safetensors'))) {
    throw new UsageError(`eval: ${dir} is not a checkpoint: it needs config.json and *.safetensors`);
  }
  const config = loadRecipe(recipeDir, overrides);

  const { startStack } = await import('../infra/stack');
  const stateDir = fs.mkdtempSync(path.join(os.tmpdir(), 'molt-eval-'));
  const stack = await startStack({ modelDir: dir, stateDir, engines: config.engines.count, workers: false, quiet: true });
  try {
    const router = new EngineRouter(stack.engines, stack.token);
    const input = { runId: `eval-${path.basename(dir)}`, step: 0, recipeDir: path.resolve(recipeDir), config };
    return await new MockActivityEnvironment().run(evaluate, router, input);
  } finally {
    await stack.stop();
    fs.rmSync(stateDir, { recursive: true, force: true });
  }
}
