// Geometry on synthetic images (issue 18): a triangle drawn by Pillow (recipes/geo/draw.py) with its numbers in the
// picture only, the question in the text; the policy answers with a number. A ChatAgent: the stock `openai` client
// sends the image as an image_url data URL to the loopback server, which has the engine process it once and
// store it with the episode, so the actor trains on exactly what the engine saw. Reward: 1 if the answer's last
// number is the right one, else 0. env.python_tool: the policy may call the sandboxed `python` tool of
// recipes/code (to add the numbers it reads) for up to env.max_turns replies (3) before it answers; the
// image is sent once, in the first message, and stays in the context of every later turn.
import { execFileSync } from 'node:child_process';
import * as path from 'node:path';
import OpenAI from 'openai';
import type { ChatAgentRunner } from '../../agents/contract';
import { REPO_ROOT } from '../../agents/recipe';
import { chatWithPythonTool, PYTHON_TOOL } from '../code/python-tool';

export interface GeoProblem { png: string; question: string; answer: number } // png: base64 of the file

// One problem per seed; Python only for the drawing (the framework's own Python environment has Pillow).
export function geoProblem(seed: number, settings: Record<string, unknown>): GeoProblem {
  const args = JSON.stringify({ seed, kinds: settings.kinds ?? ['angle', 'perimeter'], size: settings.size ?? 128 });
  const out = execFileSync(path.join(REPO_ROOT, '.venv', 'bin', 'python'), [path.join(__dirname, 'draw.py'), args]);
  return JSON.parse(out.toString());
}

export function geoReward(answer: string, expected: number): number {
  const numbers = answer.match(/-?\d+/g);
  return numbers !== null && Number(numbers[numbers.length - 1]) === expected ? 1 : 0;
}

const SYSTEM = 'You may run Python with the python tool. Answer with the number.';

export const AgentRunner: ChatAgentRunner = {
  kind: 'chat',
  prompt(task, settings) {
    const tool = settings.python_tool ?? false;
    const maxTurns = settings.max_turns ?? 3;
    if (typeof tool !== 'boolean') throw new Error(`env.python_tool must be true or false, got ${JSON.stringify(tool)}`);
    if (!Number.isInteger(maxTurns) || (maxTurns as number) < 1) {
      throw new Error(`env.max_turns must be a whole number of replies >= 1, got ${JSON.stringify(maxTurns)}`);
    }
    const problem = geoProblem(task.seed, settings);
    const question = { role: 'user' as const, content: problem.question };
    if (!tool) return { messages: [question], label: { problem, maxTurns: 1 } };
    return { messages: [{ role: 'system', content: SYSTEM }, question], tools: [PYTHON_TOOL], label: { problem, maxTurns } };
  },
  async run(ctx) {
    const { problem, maxTurns } = ctx.label as { problem: GeoProblem; maxTurns: number };
    // No client retries: the router already moves a request to another engine when one fails.
    const client = new OpenAI({ baseURL: ctx.openaiBaseURL, apiKey: ctx.apiKey, maxRetries: 0 });
    // the prompt's question, with the picture before it
    const messages = ctx.messages.map((m) => (m.role !== 'user' ? m : { role: 'user', content: [
      { type: 'image_url', image_url: { url: `data:image/png;base64,${problem.png}` } },
      { type: 'text', text: problem.question },
    ] })) as OpenAI.ChatCompletionMessageParam[];
    let answer: string;
    let toolCalls = 0;
    if (ctx.tools?.length) ({ answer, toolCalls } = await chatWithPythonTool(client, ctx.model, messages, maxTurns));
    else answer = (await client.chat.completions.create({ model: ctx.model, messages })).choices[0].message.content ?? '';
    return { reward: geoReward(answer, problem.answer), info: { answer, expected: problem.answer, toolCalls } };
  },
};
