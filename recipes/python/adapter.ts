// Agents written in Python, as recipe agent modules: a recipe's agent.ts is
//   export const AgentRunner = pythonChatAgent(path.join(__dirname, 'agent.py'));   // or pythonEnv(...)
// The Python side is recipes/python/molt_agent.py (on PYTHONPATH for these programs), which also
// documents the wire formats. One Python process per episode; its stderr tail (a traceback names the
// file and line) is in the error of an episode that fails.
import { execFileSync, spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import * as path from 'node:path';
import { commandAgent } from '../../agents/chat-runner';
import type { ChatMessage, ToolSpec } from '../../agents/chat-template';
import type { ChatAgentRunner, Env, EnvAgentRunner, EnvStepResult } from '../../agents/contract';
import { REPO_ROOT } from '../../agents/recipe';

export const PYTHON = process.env.MOLT_PYTHON ?? path.join(REPO_ROOT, '.venv', 'bin', 'python');
const pythonEnvVars = () => ({
  ...process.env, PYTHONUNBUFFERED: '1', OMP_NUM_THREADS: process.env.OMP_NUM_THREADS ?? '1',
  PYTHONPATH: [__dirname, process.env.PYTHONPATH].filter(Boolean).join(path.delimiter),
});
const tail = (text: string) => text.trim().split('\n').slice(-12).join('\n');

// Runs `python <file> <mode>` with one JSON request on stdin; its last stdout line is the JSON answer.
function ask(file: string, mode: string, request: unknown): Promise<unknown> {
  return new Promise((resolve, reject) => {
    const child = spawn(PYTHON, [file, mode], { env: pythonEnvVars() });
    let [stdout, stderr] = ['', ''];
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    child.on('error', reject);
    child.on('close', (code) => {
      if (code !== 0) return reject(new Error(`python ${file} ${mode} exited with ${code}:\n${tail(stderr)}`));
      try {
        resolve(JSON.parse(stdout.trim().split('\n').pop() ?? ''));
      } catch {
        reject(new Error(`python ${file} ${mode}: the last stdout line is not JSON: ${JSON.stringify(stdout.slice(-200))}`));
      }
    });
    child.stdin.end(JSON.stringify(request));
  });
}

type Demonstration = { messages: ChatMessage[]; tools?: ToolSpec[] };
function demonstrationOf(file: string) {
  // Synchronous, as the AgentRunner contract has it (the SFT command asks for them one by one).
  return (index: number, settings: Record<string, unknown>): Demonstration => {
    const out = execFileSync(PYTHON, [file, 'demonstration'], {
      env: pythonEnvVars(), input: JSON.stringify({ index, settings }), stdio: ['pipe', 'pipe', 'pipe'],
    }).toString();
    return JSON.parse(out.trim().split('\n').pop() ?? '');
  };
}

// A ChatAgent program (molt_agent.chat_agent): prompt() and run() are calls to it.
export function pythonChatAgent(file: string): ChatAgentRunner & { demonstration: ReturnType<typeof demonstrationOf> } {
  const agent = commandAgent(PYTHON, [file, 'run'], { env: pythonEnvVars() });
  return {
    kind: 'chat',
    prompt: async (task, settings) => (await ask(file, 'prompt', { task, settings })) as any,
    run: (ctx) => agent.run(ctx),
    demonstration: demonstrationOf(file),
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
      this.waiting?.reject(new Error(`python env ${this.file} ${why}:\n${tail(this.stderr)}`));
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
    if (this.exit) throw new Error(`python env ${this.file} ${this.exit}:\n${tail(this.stderr)}`);
    const line = await new Promise<string>((resolve, reject) => {
      this.waiting = { resolve, reject };
      this.child!.stdin.write(`${JSON.stringify(request)}\n`);
      this.deliver();
    });
    let reply: Record<string, unknown>;
    try {
      reply = JSON.parse(line);
    } catch {
      throw new Error(`python env ${this.file}: ${request.method}: the reply is not JSON: ${JSON.stringify(line.slice(0, 200))}`);
    }
    if (typeof reply.error === 'string') {
      throw new Error(`python env ${this.file}: ${request.method}: ${reply.error}\n${tail(String(reply.traceback ?? ''))}`);
    }
    return reply;
  }
}
