// The copy task rewarded by a judge model instead of code: the policy answers `copy abd>`, and the judge pool
// (recipe key `pools.judge`: the tiny architecture with other weights, e.g. recipes/distill/make_teacher.py
// --task judge) is asked the rubric prompt `judge <answer>=<target>>` and answers the number of matching
// positions. Its answer is parsed robustly (parseJudgeScore); one that holds no score gets reward 0 and is
// counted in the metric agent/judge_unparsed (agent/judge_calls counts the judged episodes). agent/true_score sums
// the score code would give (matching positions / length), so a run shows whether the judge's reward tracks it.
import type { Env, EnvAgentRunner, EnvTask, Pools } from '../../agents/contract';
import { resolveModelDir } from '../../agents/recipe';
import { tokenizerFor } from '../../agents/tokenizer';
import { copyTarget } from '../copy/agent';

// The first integer in the answer, read as a score out of `max` (e.g. "2", " 2/3", "score: 2"); null when the
// answer holds none or a number above max. Only ASCII digits count ('³' is not a 3).
export function parseJudgeScore(answer: string, max: number): number | null {
  const match = /(?<![0-9])([0-9]+)/.exec(answer);
  if (!match) return null;
  const score = Number(match[1]);
  return score <= max ? score / max : null;
}

// The answer as the judge reads it: one printable character per sampled token, '?' for any other (a byte that is
// not printable ASCII, a special token). Shown the decoded text, the policy learned to answer with invalid UTF-8
// bytes, which decode to U+FFFD (3 bytes for the judge) and which the judge misread: by steps 150-200 it scored
// 81 of 204 answers wrong, rewarding "c\ufffdc" for "abc" (reward 0.37, true score 0.23).
export function judgeView(ids: number[], tokenizer: { decode(ids: number[]): string }): string {
  return ids.map((id) => {
    const c = tokenizer.decode([id]);
    return /^[\x21-\x7e]$/.test(c) ? c : '?';
  }).join('');
}

// Positions where the answer holds the target's character
const matches = (answer: string, target: string) => [...target].filter((c, i) => answer[i] === c).length;

function createEnv(settings: Record<string, unknown>, episode?: { pools: Pools }): Env {
  const judge = episode?.pools.judge;
  if (!judge) throw new Error('recipes/judge needs a pool named judge (recipe key pools.judge)');
  const letters = String(settings.letters ?? 'abcd');
  const length = Number(settings.length ?? 3);
  // The judge's tokenizer: its model directory's (the tiny byte tokenizer unless set)
  const tokenizer = tokenizerFor(resolveModelDir(String(settings.judge_tokenizer ?? 'tiny')));
  let target = '';
  let seed = 0;
  return {
    reset(task: EnvTask) {
      target = copyTarget(task.seed, letters, length);
      seed = task.seed ^ task.episode;
      return { observation: `copy ${target}>` };
    },
    async step(action) {
      const reply = await judge.generate({
        prompt_token_ids: tokenizer.encode(`judge ${judgeView(action.tokenIds, tokenizer)}=${target}>`),
        sampling: {
          max_tokens: Number(settings.judge_max_tokens ?? 1), temperature: Number(settings.judge_temperature ?? 0),
          top_p: 1, top_k: 0, stop_token_ids: [], seed,
        },
      });
      const score = parseJudgeScore(tokenizer.decode(reply.token_ids), length);
      return {
        reward: score ?? 0, terminated: true, truncated: false,
        metrics: { judge_calls: 1, judge_unparsed: score === null ? 1 : 0, true_score: matches(action.text, target) / length },
      };
    },
  };
}

export const AgentRunner: EnvAgentRunner = { kind: 'env', createEnv };
