// Arithmetic word problems in the Env form: the framework owns the LLM loop. One turn: the policy
// reads the problem and answers; reward 1 if the last \boxed{} in its answer holds the right number
// (1.75, 7/4, \frac{7}{4}, "1,204 dollars" all read as numbers), 0 otherwise. Problems come from
// the group's seed; held-out groups (evaluation, `eval.every`) get problems no training group sees.
import type { Env, EnvAgentRunner } from '../../agents/contract';
import type { ChatMessage } from '../../agents/chat-template';
import { boxedAnswer, demonstrationProblem, groupProblem, problemSettings, type Fraction, type Problem } from './problems';

// The policy sees this text as it is (no chat template), then writes its answer after "A:".
export const observationOf = (p: Problem) => `Q: ${p.text} Put the answer in \\boxed{}.\nA:`;

export function reward(answer: string, expected: Fraction): number {
  return boxedAnswer(answer)?.equals(expected) ? 1 : 0;
}

function createEnv(settings: Record<string, unknown>): Env {
  const problems = problemSettings(settings);
  let problem: Problem | undefined;
  return {
    reset(task) {
      problem = groupProblem(task, problems);
      return { observation: observationOf(problem), info: { answer: problem.answer.toString() } };
    },
    step(action) {
      if (!problem) throw new Error('step() before reset()');
      return { reward: reward(action.text, problem.answer), terminated: true, truncated: false,
        info: { answer: problem.answer.toString() } };
    },
  };
}

// A correct episode for supervised warm-up, in the chat shape the SFT command reads: the observation
// as the user's message, what the policy should write after it as the assistant's.
export function demonstration(index: number, settings: Record<string, unknown>): { messages: ChatMessage[] } {
  const p = demonstrationProblem(index, problemSettings(settings));
  return { messages: [{ role: 'user', content: observationOf(p) }, { role: 'assistant', content: ` \\boxed{${p.answer}}` }] };
}

export const AgentRunner: EnvAgentRunner & { demonstration: typeof demonstration } = { kind: 'env', createEnv, demonstration };
