// Geometry on synthetic images (issue 18): a triangle drawn by Pillow (recipes/geo/draw.py) with its numbers in the
// picture only, the question in the text; the policy answers with a number. A ChatAgent: the stock `openai` client
// sends the image as an image_url data URL to the loopback server, which has the engine process it once and
// store it with the episode, so the actor trains on exactly what the engine saw. Reward: 1 if the answer's last
// number is the right one, else 0.
import { execFileSync } from 'node:child_process';
import * as path from 'node:path';
import OpenAI from 'openai';
import type { ChatAgentRunner } from '../../agents/contract';
import { REPO_ROOT } from '../../agents/recipe';

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

export const AgentRunner: ChatAgentRunner = {
  kind: 'chat',
  prompt(task, settings) {
    const problem = geoProblem(task.seed, settings);
    return { messages: [{ role: 'user', content: problem.question }], label: problem };
  },
  async run(ctx) {
    const problem = ctx.label as GeoProblem;
    // No client retries: the router already moves a request to another engine when one fails.
    const client = new OpenAI({ baseURL: ctx.openaiBaseURL, apiKey: ctx.apiKey, maxRetries: 0 });
    const reply = await client.chat.completions.create({
      model: ctx.model,
      messages: [{ role: 'user', content: [
        { type: 'image_url', image_url: { url: `data:image/png;base64,${problem.png}` } },
        { type: 'text', text: problem.question },
      ] }],
    });
    const answer = reply.choices[0].message.content ?? '';
    return { reward: geoReward(answer, problem.answer), info: { answer, expected: problem.answer } };
  },
};
