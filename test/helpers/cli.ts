// `molt-client` as a user runs it: a tsx child process in the repository, with extra environment.
import { execFile } from 'node:child_process';
import * as path from 'node:path';
import { REPO_ROOT } from '../../agents/recipe';

export function runCli(args: string[], env: Record<string, string> = {}): Promise<{ code: number; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    execFile(path.join(REPO_ROOT, 'node_modules', '.bin', 'tsx'), ['client/cli.ts', ...args], { cwd: REPO_ROOT, env: { ...process.env, ...env } },
      (err, stdout, stderr) => resolve({ code: err ? Number(err.code ?? 1) : 0, stdout, stderr }));
  });
}
