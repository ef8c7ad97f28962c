// The agent boundary: a recipe's agent module exports `AgentRunner`, in one of two forms.
//
// Env form (Gymnasium style): the framework owns the LLM loop (agents/env-runner.ts). It calls
// `reset(task)` for the first observation, generates the policy's action over the exact
// accumulated token ids, and calls `step(action)` until the env says terminated or truncated.
//
// ChatAgent form: the user owns the loop (agents/chat-runner.ts). `prompt(task, settings)` gives
// the group's conversation start; `run(ctx)` talks to the policy through the loopback chat server
// with any OpenAI / Anthropic client and returns the reward.
import type { GenerateRequest, GenerateResponse } from '../activities/gpu-client';
import type { ChatAgent, ChatPrompt } from './chat-runner';
import type { ChatMessage, ToolSpec } from './chat-template';
import type { SamplingConfig } from './recipe';

// A further engine pool of the recipe (`pools`: a judge, a teacher) as an episode calls it. Each call is
// journaled with the episode: a retried episode gets the same answers back and does not ask again.
export interface PoolClient {
  generate(body: GenerateRequest): Promise<GenerateResponse>; // token ids in, token ids out, as the policy's
  score(tokenIds: number[]): Promise<number[]>; // log p(id_t | ids before it) of exactly these ids, [0] = 0
}
export type Pools = Record<string, PoolClient>;

// What a prompt group is about: every episode of the group gets the same task.
export interface GroupTask {
  groupIndex: number; // the prompt group
  seed: number; // derived from (run seed, groupIndex)
}

export interface EnvTask extends GroupTask {
  episode: number; // 0..group_size-1 within the group
}

export interface EnvObservation {
  observation: string; // text the framework tokenizes and appends (never trained on)
  // vision-language policies: base64 image files, one per <|image_pad|> of the observation (in the model's own
  // vision block, e.g. <|vision_start|><|image_pad|><|vision_end|>), processed and stored by the framework
  images?: string[];
  info?: Record<string, unknown>;
}

export interface EnvAction {
  text: string; // the sampled tokens decoded, for the env to read
  tokenIds: number[]; // the sampled tokens themselves
}

export interface EnvStepResult {
  observation?: string; // appended before the next turn; ignored once the episode ends
  images?: string[]; // as EnvObservation.images
  reward: number; // summed over the steps of an episode
  terminated: boolean; // the task reached an end state
  truncated: boolean; // cut short (step limit, ...)
  info?: Record<string, unknown>;
  sampling?: Partial<SamplingConfig>; // overrides for the next turn only
  metrics?: Record<string, number>; // summed over the step's episodes into agent/<name>
}

export interface Env {
  reset(task: EnvTask): EnvObservation | Promise<EnvObservation>;
  step(action: EnvAction): EnvStepResult | Promise<EnvStepResult>;
  close?(): void | Promise<void>;
}

// A worked episode for the SFT warm start (`molt-client sft`, agents/sft-data.ts): the conversation as the
// agent would hold it, assistant turns (with tool_calls) being what the policy should answer. Env form:
// user messages are the observations, assistant messages the actions, tokenized as the env loop does.
export interface Demonstration { messages: ChatMessage[]; tools?: ToolSpec[] }
// Optional on both forms: demonstration `index` of a deterministic stream (a retried step gets the same ones).
export type DemonstrationFn =
  (index: number, settings: Record<string, unknown>) => Demonstration | Promise<Demonstration>;

export interface EnvAgentRunner {
  kind: 'env';
  // settings: the recipe's `env` object; one env per episode, with the episode's pool clients
  createEnv(settings: Record<string, unknown>, episode?: { pools: Pools }): Env;
  demonstration?: DemonstrationFn;
}

export interface ChatAgentRunner extends ChatAgent {
  // Called once per group; settings: the recipe's `env` object.
  prompt(task: GroupTask, settings: Record<string, unknown>): ChatPrompt | Promise<ChatPrompt>;
  demonstration?: DemonstrationFn;
}

export type AgentRunner = EnvAgentRunner | ChatAgentRunner;

// Loads and checks an agent module: a missing or misshapen `AgentRunner` is an error naming the
// module and what is wrong, before any episode runs.
export async function loadAgentRunner(modulePath: string): Promise<AgentRunner> {
  let mod: any;
  try {
    mod = await import(modulePath);
  } catch (e) {
    throw new Error(`agent module ${modulePath} could not be loaded: ${(e as Error).message}`);
  }
  const runner = mod?.AgentRunner ?? mod?.default?.AgentRunner;
  if (runner === undefined || runner === null || typeof runner !== 'object') {
    throw new Error(`agent module ${modulePath} does not export an AgentRunner object (exports: ${Object.keys(mod ?? {}).join(', ') || 'none'})`);
  }
  const methods: Record<string, string> | null = runner.kind === 'env' ? { createEnv: '(settings) => Env' }
    : runner.kind === 'chat' ? { prompt: '(task, settings) => ChatPrompt', run: '(ctx) => Promise<{ reward }>' }
    : null;
  if (!methods) {
    throw new Error(`agent module ${modulePath}: AgentRunner.kind must be 'env' or 'chat', got ${JSON.stringify(runner.kind)}`);
  }
  for (const [name, signature] of Object.entries(methods)) {
    if (typeof runner[name] !== 'function') {
      throw new Error(`agent module ${modulePath}: a '${runner.kind}' AgentRunner needs ${name}: a function ${signature}`);
    }
  }
  return runner as AgentRunner;
}

// Checks what createEnv returned, so a missing method fails with the module's name, not deep in the loop.
export function checkEnv(env: unknown, modulePath: string): Env {
  const missing = ['reset', 'step'].filter((m) => typeof (env as any)?.[m] !== 'function');
  if (missing.length) throw new Error(`agent module ${modulePath}: the Env from createEnv lacks ${missing.join(' and ')}()`);
  return env as Env;
}
