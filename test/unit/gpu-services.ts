// Real engine and actor processes for the unit tests: the tiny model, free ports, torch threads
// kept low (the machine is shared), killed after the test file.
import { execFileSync, spawn, type ChildProcess } from 'node:child_process';
import * as fs from 'node:fs';
import * as path from 'node:path';
import type { GenerateChunk, GenerateRequest, GenerateResponse } from '../../activities/gpu-client';
import { REPO_ROOT, resolveModelDir } from '../../agents/recipe';
import { EngineRouter } from '../../agents/router';
import { freePort } from '../../infra/stack';

export { freePort };

export const PYTHON = path.join(REPO_ROOT, '.venv', 'bin', 'python');
export const TOKEN = 't';

export function tinyModel(): string {
  const dir = resolveModelDir('tiny');
  if (!fs.existsSync(path.join(dir, 'model.safetensors'))) {
    execFileSync(PYTHON, ['gpu-services/make_tiny_model.py', '--out', dir], { cwd: REPO_ROOT });
  }
  return dir;
}

export interface Service { url: string; proc: ChildProcess; log: () => string; stop: () => Promise<void> }

async function startService(name: string, args: string[]): Promise<Service> {
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  let output = '';
  const proc = spawn(PYTHON, [...args, '--port', String(port), '--token', TOKEN], {
    cwd: REPO_ROOT, env: { ...process.env, OMP_NUM_THREADS: '1', MKL_NUM_THREADS: '1' },
    stdio: ['ignore', 'pipe', 'pipe'],
  });
  proc.stdout!.on('data', (d) => (output += d));
  proc.stderr!.on('data', (d) => (output += d));
  const stop = async () => {
    if (proc.exitCode !== null || proc.signalCode !== null) return;
    const exited = new Promise((r) => proc.once('exit', r));
    proc.kill('SIGTERM');
    await exited;
  };
  for (let i = 0; i < 1500; i++) { // a loaded shared machine takes minutes to import torch and transformers
    if (proc.exitCode !== null) throw new Error(`${name} exited with ${proc.exitCode}:\n${output}`);
    try {
      const res = await fetch(`${url}/health`, { headers: { authorization: `Bearer ${TOKEN}` } });
      if (res.ok) return { url, proc, log: () => output, stop };
    } catch { /* not listening yet */ }
    await new Promise((r) => setTimeout(r, 200));
  }
  await stop();
  throw new Error(`${name} did not become healthy within 300 s:\n${output}`);
}

export function startEngine(model: string, ...extra: string[]): Promise<Service> {
  return startService('engine', ['gpu-services/engine.py', '--model', model, '--device', 'cpu', ...extra]);
}

export function startActor(model: string, stateDir: string, ...extra: string[]): Promise<Service> {
  return startService('actor', ['-m', 'torch.distributed.run', '--standalone', '--nproc-per-node=1',
    'gpu-services/actor.py', '--model', model, '--state-dir', stateDir, ...extra]);
}

// The real router, keeping what the engine returned for each request so tests compare against it.
export class RecordingRouter extends EngineRouter {
  calls: { session: string; body: GenerateRequest; res: GenerateResponse }[] = [];
  async generate(session: string, body: GenerateRequest, signal?: AbortSignal,
    onChunk?: (chunk: GenerateChunk) => boolean): Promise<GenerateResponse> {
    const res = await super.generate(session, body, signal, onChunk);
    this.calls.push({ session, body, res });
    return res;
  }
}
