// Live control of a run: updates (validated before they enter history) and the settings they may
// change. A change applies from the next step and is carried across continue-as-new in the config.
import { defineUpdate } from '@temporalio/workflow';
import type { RecipeConfig } from '../agents/recipe';

// Settings a running run accepts, each with its check. Anything else is fixed for the run's life.
const positive = (v: number) => (Number.isFinite(v) && v > 0 ? null : 'must be a positive number');
const positiveInt = (v: number) => (Number.isInteger(v) && v > 0 ? null : 'must be a positive integer');
const finite = (v: number) => (Number.isFinite(v) ? null : 'must be a finite number');
export const LIVE_SETTINGS = {
  'algo.lr': positive,
  'algo.entropy_coef': finite,
  'algo.kl_coef': (v: number) => (Number.isFinite(v) && v >= 0 ? null : 'must be a number >= 0'),
  'batch.groups': positiveInt,
  'pool.inflight': positiveInt,
} as const;
export type LiveSetting = keyof typeof LIVE_SETTINGS;
export type Settings = Partial<Record<LiveSetting, number>>;

export const pauseUpdate = defineUpdate<ControlState>('pause');
export const resumeUpdate = defineUpdate<ControlState>('resume');
export const setUpdate = defineUpdate<ControlState, [Settings]>('set');
// Saves a checkpoint of the current step (waits for a step in progress) and returns its path.
export const checkpointUpdate = defineUpdate<{ step: number; path: string }>('checkpoint');

export interface ControlState { paused: boolean; settings: Record<LiveSetting, number> }

// Throws (rejecting the update, which then never reaches history) with a message naming the setting.
export function validateSettings(settings: Settings): void {
  if (typeof settings !== 'object' || settings === null || Object.keys(settings).length === 0) {
    throw new Error(`nothing to set: give one or more of ${Object.keys(LIVE_SETTINGS).join(', ')}`);
  }
  for (const [key, value] of Object.entries(settings)) {
    const check = LIVE_SETTINGS[key as LiveSetting];
    if (!check) throw new Error(`${key} cannot be changed on a running run (live settings: ${Object.keys(LIVE_SETTINGS).join(', ')})`);
    const problem = typeof value === 'number' ? check(value) : 'must be a number';
    if (problem) throw new Error(`${key}: ${JSON.stringify(value)} ${problem}`);
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
