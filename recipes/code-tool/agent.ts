// The code task (recipes/code) as a multi-turn ChatAgent with a `python` tool: the policy may run code
// between turns (each call in the sandbox, its output appended as the tool's message), then answers with
// the function; the reward is the fraction of the unit tests it passes.
import OpenAI from 'openai';
import type { ChatAgentRunner } from '../../agents/contract';
import { codeTask, scoreSolution, type CodeTask } from '../code/agent';
import { chatWithPythonTool, PYTHON_TOOL } from '../code/python-tool';

const SYSTEM = 'You may run Python with the python tool. Answer with the function in a ```python block.';

export const AgentRunner: ChatAgentRunner = {
  kind: 'chat',
  prompt(task, settings) {
    const t = codeTask(task.seed, Number(settings.tests ?? 5));
    return {
      messages: [{ role: 'system', content: SYSTEM }, { role: 'user', content: t.prompt }], tools: [PYTHON_TOOL],
      label: { task: t, maxTurns: Number(settings.max_turns ?? 3) },
    };
  },
  async run(ctx) {
    const { task, maxTurns } = ctx.label as { task: CodeTask; maxTurns: number };
    const client = new OpenAI({ baseURL: ctx.openaiBaseURL, apiKey: ctx.apiKey, maxRetries: 0 });
    const { answer, toolCalls } = await chatWithPythonTool(client, ctx.model,
      [...ctx.messages] as OpenAI.ChatCompletionMessageParam[], maxTurns);
    const score = await scoreSolution(answer, task);
    return { reward: score.reward, info: { answer, toolCalls, passed: score.passed, total: score.total } };
  },
};
