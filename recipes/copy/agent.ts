// The embedded task: copy three letters. Prompt `copy abc>`, the policy answers exactly 3 tokens
// (sampling.max_tokens 3), reward = fraction of positions that match. Seen to learn from scratch
// with a tiny random-init model in minutes on CPU (DESIGN.md, "The embedded default").
import type { Demonstration, Env, EnvAgentRunner, EnvTask } from '../../agents/contract';
import { deriveSeed } from '../../agents/env-runner';

// Fraction of the target's positions where the answer has the same character.
export function copyReward(answer: string, target: string): number {
  const a = [...answer];
  const t = [...target];
  let hits = 0;
  for (let i = 0; i < t.length; i++) if (a[i] === t[i]) hits++;
  return hits / t.length;
}

// The task of a group: `length` letters drawn from `letters` by a small PRNG seeded with the
// group's seed (mulberry32), so every episode of the group, and every retry, sees the same prompt.
export function copyTarget(seed: number, letters: string, length: number): string {
  let s = seed >>> 0;
  let out = '';
  for (let i = 0; i < length; i++) {
    s = (s + 0x6d2b79f5) >>> 0;
    let x = Math.imul(s ^ (s >>> 15), s | 1);
    x ^= x + Math.imul(x ^ (x >>> 7), x | 61);
    const r = ((x ^ (x >>> 14)) >>> 0) / 2 ** 32; // uniform in [0, 1)
    out += letters[Math.floor(r * letters.length)];
  }
  return out;
}

// env.reverse: the answer is the letters backwards (`reverse abc>` -> `cba`), a harder variant
// (bench/learning.ts): the policy must attend to a different position for each answer token.
function createEnv(settings: Record<string, unknown>): Env {
  const letters = String(settings.letters ?? 'abcd');
  const length = Number(settings.length ?? 3);
  const reverse = settings.reverse === true;
  let target = '';
  return {
    reset(task: EnvTask) {
      const shown = copyTarget(task.seed, letters, length);
      target = reverse ? [...shown].reverse().join('') : shown;
      return { observation: `${reverse ? 'reverse' : 'copy'} ${shown}>`, info: { target } };
    },
    step(action) {
      return { reward: copyReward(action.text, target), terminated: true, truncated: false, info: { target } };
    },
  };
}

// For the SFT warm start (`molt-client sft recipes/copy`): a correct answer to demonstration `index`'s
// prompt (its own seeds, apart from the run's groups).
export function copyDemonstration(index: number, settings: Record<string, unknown>, chat = false): Demonstration {
  const shown = copyTarget(deriveSeed(0x5f7, index), String(settings.letters ?? 'abcd'), Number(settings.length ?? 3));
  const reverse = settings.reverse === true && !chat;
  const answer = reverse ? [...shown].reverse().join('') : shown;
  return { messages: [{ role: 'user', content: `${reverse ? 'reverse' : 'copy'} ${shown}>` }, { role: 'assistant', content: answer }] };
}

export const AgentRunner: EnvAgentRunner = { kind: 'env', createEnv, demonstration: (i, s) => copyDemonstration(i, s) };
