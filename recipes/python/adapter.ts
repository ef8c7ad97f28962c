// Agents written in Python, as recipe agent modules: a recipe's agent.ts is
//   export const AgentRunner = pythonChatAgent(path.join(__dirname, 'agent.py'));   // or pythonEnv(...)
// The Python side is recipes/python/molt_agent.py (on PYTHONPATH for these programs), which also
// documents the wire formats. The error of a call that fails carries the Python traceback (file and line).
import { spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import * as path from 'node:path';
import type { ChatPrompt, ChatResult } from '../../agents/chat-runner';
import type { ChatAgentRunner, Demonstration, Env, EnvAgentRunner, EnvStepResult } from '../../agents/contract';
import { REPO_ROOT } from '../../agents/recipe';

export const PYTHON = process.env.MOLT_PYTHON ?? path.join(REPO_ROOT, '.venv', 'bin', 'python');
const pythonEnvVars = () => ({
  ...process.env, PYTHONUNBUFFERED: '1', OMP_NUM_THREADS: process.env.OMP_NUM_THREADS ?? '1',
  PYTHONPATH: [__dirname, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter),
});
const tail = (text: string) => text.trim().split('\n').slice(-12).join('\n');

const shown = (file: string) => (file.startsWith(REPO_ROOT + path.sep) ? path.relative(REPO_ROOT, file) : file);

// An error from the Python side: the innermost frame of its traceback (the file and line that raised)
// right after the message, the traceback below; no JS stack (the adapter's frames would name the wrong file).
function pythonError(message: string, traceback = ''): Error {
  const frames = [...traceback.matchAll(/File "([^"]+)", line (\d+), in (\S+)/g)];
  const at = frames.length ? ` (${shown(frames[frames.length - 1][1])}:${frames[frames.length - 1][2]}, in ${frames[frames.length - 1][3]})` : '';
  const e = new Error(`${message}${at}${traceback ? `\n${tail(traceback)}` : ''}`);
  e.stack = `Error: ${e.message}`;
  return e;
}

// A ChatAgent program (molt_agent.chat_agent) started once per worker process with `serve`: it forks a
// child per call, so the imports (openai: a second of CPU) are paid once, not per episode. Calls go
// as JSON lines {id, call, request}; replies {id, result} or {id, error, traceback} come in any order.
class PythonServer {
  private child?: ChildProcessWithoutNullStreams;
  private stdout = '';
  private stderr = '';
  private nextId = 0;
  private readonly pending = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void; call: string }>();

  constructor(private readonly file: string) {}

  call(call: string, request: unknown): Promise<unknown> {
    const child = (this.child ??= this.start());
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject, call });
      child.ref(); // calls in flight keep the event loop alive; an idle server does not
      child.stdin.write(`${JSON.stringify({ id, call, request })}\n`);
    });
  }

  private start(): ChildProcessWithoutNullStreams {
    const child = spawn(PYTHON, [this.file, 'serve'], { env: pythonEnvVars() });
    child.stdout.on('data', (d) => {
      this.stdout += d;
      for (let at = this.stdout.indexOf('\n'); at >= 0; at = this.stdout.indexOf('\n')) {
        const reply = JSON.parse(this.stdout.slice(0, at));
        this.stdout = this.stdout.slice(at + 1);
        const waiting = this.pending.get(reply.id);
        if (!waiting) continue;
        this.pending.delete(reply.id);
        if (!this.pending.size) child.unref();
        if (typeof reply.error === 'string') {
          waiting.reject(pythonError(`python ${shown(this.file)}: ${waiting.call}(): ${reply.error}`, String(reply.traceback ?? '')));
        } else {
          waiting.resolve(reply.result);
        }
      }
    });
    child.stderr.on('data', (d) => (this.stderr = (this.stderr + d).slice(-20_000)));
    const gone = (why: string) => {
      if (this.child === child) this.child = undefined; // the next call starts a new one
      for (const { reject } of this.pending.values()) reject(pythonError(`python ${shown(this.file)} ${why}: ${tail(this.stderr)}`));
      this.pending.clear();
    };
    child.on('error', (e) => gone(`could not start: ${e.message}`));
    child.on('close', (code, signal) => gone(`exited with ${code ?? signal}`));
    child.stdin.on('error', () => undefined); // a dead process: reported by 'close'
    for (const s of [child.stdin, child.stdout, child.stderr]) (s as unknown as { unref(): void }).unref();
    child.unref();
    return child;
  }
}

// A ChatAgent program (molt_agent.chat_agent): prompt(), run() and demonstration() are calls to it.
export function pythonChatAgent(file: string): ChatAgentRunner & {
  demonstration(index: number, settings: Record<string, unknown>): Promise<Demonstration>;
} {
  const server = new PythonServer(file);
  return {
    kind: 'chat',
    prompt: async (task, settings) => (await server.call('prompt', { task, settings })) as ChatPrompt,
    run: async (ctx) => (await server.call('run', ctx)) as ChatResult,
    demonstration: async (index, settings) => (await server.call('demonstration', { index, settings })) as Demonstration,
  };
}

// An Env program (molt_agent.serve_env): one process per env, JSON lines over stdin/stdout.
export function pythonEnv(file: string): EnvAgentRunner {
  return { kind: 'env', createEnv: (settings) => new LineEnv(file, settings) };
}

class LineEnv implements Env {
  private child?: ChildProcessWithoutNullStreams;
  private stdout = '';
  private stderr = '';
  private exit?: string; // why the process is gone
  private waiting?: { resolve: (line: string) => void; reject: (e: Error) => void };

  constructor(private readonly file: string, private readonly settings: Record<string, unknown>) {}

  async reset(task: { groupIndex: number; episode: number; seed: number }) {
    return (await this.call({ method: 'reset', settings: this.settings, task })) as unknown as { observation: string };
  }

  async step(action: { text: string; tokenIds: number[] }) {
    const reply = (await this.call({ method: 'step', text: action.text, token_ids: action.tokenIds })) as unknown as EnvStepResult;
    return { ...reply, observation: reply.observation ?? undefined };
  }

  async close() {
    const child = this.child;
    if (!child || this.exit) return;
    const gone = new Promise((r) => child.once('close', r));
    child.stdin.end(`${JSON.stringify({ method: 'close' })}\n`);
    const timer = setTimeout(() => child.kill('SIGKILL'), 5000); // an env that will not stop
    await gone;
    clearTimeout(timer);
  }

  private start(): ChildProcessWithoutNullStreams {
    const child = spawn(PYTHON, [this.file], { env: pythonEnvVars() });
    child.stdout.on('data', (d) => {
      this.stdout += d;
      this.deliver();
    });
    child.stderr.on('data', (d) => (this.stderr = (this.stderr + d).slice(-20_000)));
    const gone = (why: string) => {
      this.exit ??= why;
      this.waiting?.reject(pythonError(`python env ${shown(this.file)} ${why}: ${tail(this.stderr)}`));
      this.waiting = undefined;
    };
    child.on('error', (e) => gone(`could not start: ${e.message}`));
    child.on('close', (code, signal) => gone(`exited with ${code ?? signal}`));
    child.stdin.on('error', () => undefined); // a dead process: reported by 'close'
    return child;
  }

  // One request at a time: the next whole line is its reply.
  private deliver() {
    const at = this.stdout.indexOf('\n');
    if (at < 0 || !this.waiting) return;
    const line = this.stdout.slice(0, at);
    this.stdout = this.stdout.slice(at + 1);
    const { resolve } = this.waiting;
    this.waiting = undefined;
    resolve(line);
  }

  private async call(request: { method: string } & Record<string, unknown>): Promise<Record<string, unknown>> {
    this.child ??= this.start();
    if (this.exit) throw pythonError(`python env ${shown(this.file)} ${this.exit}: ${tail(this.stderr)}`);
    const line = await new Promise<string>((resolve, reject) => {
      this.waiting = { resolve, reject };
      this.child!.stdin.write(`${JSON.stringify(request)}\n`);
      this.deliver();
    });
    let reply: Record<string, unknown>;
    try {
      reply = JSON.parse(line);
    } catch {
      throw pythonError(`python env ${shown(this.file)}: ${request.method}: the reply is not JSON: ${JSON.stringify(line.slice(0, 200))}`);
    }
    if (typeof reply.error === 'string') {
      throw pythonError(`python env ${shown(this.file)}: ${request.method}(): ${reply.error}`, String(reply.traceback ?? ''));
    }
    return reply;
  }
}
