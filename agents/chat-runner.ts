// One ChatAgent episode: open a loopback session, let the agent talk to the policy through the
// stock openai / @anthropic-ai/sdk clients (or any HTTP client), collect the token-exact segments.
import { spawn } from 'node:child_process';
import type { ChatMessage, ChatTemplate, ToolSpec } from './chat-template';
import type { Pools } from './contract';
import type { FinishReason, GenerateFn, ProcessImageFn, Sampling, Segment } from './chat-session';
import type { LoopbackServer } from './loopback';

export interface ChatContext {
  openaiBaseURL: string; // .../s/<session>/v1
  anthropicBaseURL: string; // .../s/<session>
  model: 'policy';
  apiKey: string;
  messages: ChatMessage[]; // the prompt
  tools?: ToolSpec[];
  label?: unknown; // what the reward compares against
  sampling: Sampling;
  maxContext: number;
  pools?: Pools; // the recipe's other engine pools (judge, teacher), journaled with the episode; set by the rollout
}
// metrics: numbers summed over the step's episodes into agent/<name> (e.g. a judge's unparseable answers)
export interface ChatResult { reward: number; info?: Record<string, unknown>; metrics?: Record<string, number> }

// The loop of the ChatAgent form: the user owns it. A recipe's AgentRunner adds prompt(task)
// (ChatAgentRunner in agents/contract.ts); commandAgent() below makes one from any program.
export interface ChatAgent { kind: 'chat'; run(ctx: ChatContext): Promise<ChatResult> }

export interface ChatPrompt { messages: ChatMessage[]; tools?: ToolSpec[]; label?: unknown }

export interface ChatEpisode {
  segments: Segment[]; // each one trajectory for the store; a prefix rewrite starts a new one
  reward: number;
  info?: Record<string, unknown>;
  metrics?: Record<string, number>;
  finish: FinishReason | null; // of the last generation (null: the agent never called the policy)
}

export async function runChatEpisode(opts: {
  server: LoopbackServer;
  agent: ChatAgent;
  template: ChatTemplate;
  generate: GenerateFn;
  prompt: ChatPrompt;
  sampling: Sampling;
  maxContext: number;
  pools?: Pools;
  processImage?: ProcessImageFn; // vision-language policies: how the episode's images reach the engine and the store
}): Promise<ChatEpisode> {
  const { server, template } = opts;
  const stopIds = [...new Set([...opts.sampling.stop_token_ids, ...template.endOfTurnIds()])];
  const defaults = { ...opts.sampling, stop_token_ids: stopIds };
  const session = server.openSession({
    template, generate: opts.generate, defaults, maxContext: opts.maxContext, processImage: opts.processImage,
  });
  try {
    const result = await opts.agent.run({
      ...server.urls(session), model: 'policy', apiKey: session.apiKey,
      messages: opts.prompt.messages, tools: opts.prompt.tools, label: opts.prompt.label,
      sampling: defaults, maxContext: opts.maxContext, pools: opts.pools ?? {},
    });
    if (typeof result?.reward !== 'number' || !Number.isFinite(result.reward)) {
      throw new Error(`chat agent: run() must return {reward: <finite number>}, got ${JSON.stringify(result)}`);
    }
    return {
      segments: session.segments(), reward: result.reward, info: result.info, metrics: result.metrics,
      finish: session.lastFinish,
    };
  } finally {
    server.closeSession(session);
  }
}

// A ChatAgent that is a program in any language: it gets the session in environment variables
// (MOLT_OPENAI_BASE_URL, MOLT_ANTHROPIC_BASE_URL, MOLT_API_KEY, MOLT_MODEL, and MOLT_PROMPT: JSON of
// {messages, tools, label, sampling, maxContext}) and prints {"reward": ..., "info": ...} as the
// last line of its stdout.
export function commandAgent(command: string, args: string[] = [], options: { cwd?: string; env?: NodeJS.ProcessEnv } = {}): ChatAgent {
  return {
    kind: 'chat',
    run: (ctx) => new Promise((resolve, reject) => {
      const child = spawn(command, args, {
        cwd: options.cwd,
        env: {
          ...process.env, ...options.env,
          MOLT_OPENAI_BASE_URL: ctx.openaiBaseURL, MOLT_ANTHROPIC_BASE_URL: ctx.anthropicBaseURL,
          MOLT_API_KEY: ctx.apiKey, MOLT_MODEL: ctx.model,
          MOLT_PROMPT: JSON.stringify({ messages: ctx.messages, tools: ctx.tools, label: ctx.label, sampling: ctx.sampling, maxContext: ctx.maxContext }),
        },
        stdio: ['ignore', 'pipe', 'pipe'],
      });
      let stdout = '';
      let stderr = '';
      child.stdout.on('data', (d) => (stdout += d));
      child.stderr.on('data', (d) => (stderr += d));
      child.on('error', reject);
      child.on('close', (code) => {
        const where = `chat agent command ${command}`;
        if (code !== 0) return reject(new Error(`${where} exited with ${code}: ${stderr.slice(-2000)}`));
        const last = stdout.trim().split('\n').pop() ?? '';
        try {
          resolve(JSON.parse(last));
        } catch {
          reject(new Error(`${where}: the last stdout line must be JSON {"reward": ...}, got ${JSON.stringify(last.slice(0, 200))}`));
        }
      });
    }),
  };
}
