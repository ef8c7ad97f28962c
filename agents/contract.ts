// The agent boundary: a recipe's agent module exports `AgentRunner`.
//
// Env form (Gymnasium style): the framework owns the LLM loop (agents/env-runner.ts). It calls
// `reset(task)` for the first observation, generates the policy's action over the exact
// accumulated token ids, and calls `step(action)` until the env says terminated or truncated.
import type { SamplingConfig } from './recipe';

export interface EnvTask {
  groupIndex: number; // the prompt group
  episode: number; // 0..group_size-1 within the group
  seed: number; // derived from (run seed, groupIndex): the same for every episode of a group, so they share one task
}

export interface EnvObservation {
  observation: string; // text the framework tokenizes and appends (never trained on)
  info?: Record<string, unknown>;
}

export interface EnvAction {
  text: string; // the sampled tokens decoded, for the env to read
  tokenIds: number[]; // the sampled tokens themselves
}

export interface EnvStepResult {
  observation?: string; // appended before the next turn; ignored once the episode ends
  reward: number; // summed over the steps of an episode
  terminated: boolean; // the task reached an end state
  truncated: boolean; // cut short (step limit, ...)
  info?: Record<string, unknown>;
  sampling?: Partial<SamplingConfig>; // overrides for the next turn only
}

export interface Env {
  reset(task: EnvTask): EnvObservation | Promise<EnvObservation>;
  step(action: EnvAction): EnvStepResult | Promise<EnvStepResult>;
  close?(): void | Promise<void>;
}

export interface EnvAgentRunner {
  kind: 'env';
  createEnv(settings: Record<string, unknown>): Env; // settings: the recipe's `env` object
}

// The ChatAgent form (kind: 'chat', the user owns the loop and talks to the loopback chat server)
// joins this union in a later issue.
export type AgentRunner = EnvAgentRunner;

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
  if (runner.kind !== 'env') {
    throw new Error(`agent module ${modulePath}: AgentRunner.kind must be 'env', got ${JSON.stringify(runner.kind)}`);
  }
  if (typeof runner.createEnv !== 'function') {
    throw new Error(`agent module ${modulePath}: AgentRunner.createEnv must be a function (settings) => Env`);
  }
  return runner as AgentRunner;
}

// Checks what createEnv returned, so a missing method fails with the module's name, not deep in the loop.
export function checkEnv(env: unknown, modulePath: string): Env {
  const missing = ['reset', 'step'].filter((m) => typeof (env as any)?.[m] !== 'function');
  if (missing.length) throw new Error(`agent module ${modulePath}: the Env from createEnv lacks ${missing.join(' and ')}()`);
  return env as Env;
}
