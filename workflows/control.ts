// Live control of a run: updates (validated before they enter history) and the settings they may
// change. A change applies from the next step and is carried across continue-as-new in the config.
import { defineQuery, defineUpdate } from '@temporalio/workflow';
import { LIVE_SETTINGS, type LiveSetting } from '../agents/live-settings';
import type { RecipeConfig } from '../agents/recipe';

// Settings a running run accepts, each checked by its schema in the recipe's zod schema (the
// same check as recipe.json). Anything else is fixed for the run's life.
export { LIVE_SETTINGS, type LiveSetting };
export type Settings = Partial<Record<LiveSetting, number>>;

export const pauseUpdate = defineUpdate<ControlState>('pause');
export const resumeUpdate = defineUpdate<ControlState>('resume');
export const setUpdate = defineUpdate<ControlState, [Settings]>('set');
// Saves a checkpoint of the current step (waits for a step in progress) and returns its path.
export const checkpointUpdate = defineUpdate<{ step: number; path: string }>('checkpoint');

export interface ControlState { paused: boolean; settings: Record<LiveSetting, number> }

// The run's engines (`molt-client engines add|drain|list`, train-run.ts). add: the engine gets the
// run's current weights, then new groups may use it; drain: new groups no longer do, and the update
// returns once the groups that could (`groups`) have finished. Either answers when it is done.
export const addEngineUpdate = defineUpdate<EngineChange, [string]>('addEngine');
export const drainEngineUpdate = defineUpdate<EngineChange, [string]>('drainEngine');
export const enginesQuery = defineQuery<{ serving: string[]; draining: string[]; version: number }>('engines');
export interface EngineChange { url: string; version: number; seconds: number; groups?: number }

export function checkEngineUrl(url: unknown): void {
  if (typeof url !== 'string' || !/^https?:\/\/[^/\s]+\/?$/.test(url)) {
    throw new Error(`engine URL ${JSON.stringify(url)}: expected http://host:port`);
  }
}

// Throws (rejecting the update, which then never reaches history) with a message naming the
// setting. molt-client checks with it too before it sends the update.
export function validateSettings(settings: Settings): void {
  if (typeof settings !== 'object' || settings === null || Object.keys(settings).length === 0) {
    throw new Error(`nothing to set: give one or more of ${Object.keys(LIVE_SETTINGS).join(', ')}`);
  }
  for (const [key, value] of Object.entries(settings)) {
    const schema = Object.prototype.hasOwnProperty.call(LIVE_SETTINGS, key) ? LIVE_SETTINGS[key as LiveSetting] : undefined;
    if (!schema) throw new Error(`${key} cannot be changed on a running run (live settings: ${Object.keys(LIVE_SETTINGS).join(', ')})`);
    const parsed = schema.safeParse(value);
    if (!parsed.success) {
      const problem = parsed.error.issues[0].message.replace(/^Invalid input: /, '');
      throw new Error(`${key}: ${JSON.stringify(value)}${problem.startsWith('must') ? ' ' : ': '}${problem}`);
    }
  }
}

export function applySettings(config: RecipeConfig, settings: Settings): RecipeConfig {
  const next = { ...config, algo: { ...config.algo }, batch: { ...config.batch }, pool: { ...config.pool } };
  for (const [key, value] of Object.entries(settings) as [LiveSetting, number][]) {
    const [section, field] = key.split('.') as ['algo' | 'batch' | 'pool', string];
    (next[section] as Record<string, unknown>)[field] = value;
  }
  return next;
}

export function currentSettings(config: RecipeConfig): Record<LiveSetting, number> {
  return {
    'algo.lr': config.algo.lr, 'algo.entropy_coef': config.algo.entropy_coef, 'algo.kl_coef': config.algo.kl_coef,
    'batch.groups': config.batch.groups, 'pool.inflight': config.pool.inflight,
  };
}
