// The copy task (recipes/copy) as a ChatAgent: the agent owns the loop and asks the policy with the
// stock `openai` client, pointed at the loopback server. Same task per group as the Env form (same
// seed, same letters), same reward; the prompt goes through the model's chat template instead.
import OpenAI from 'openai';
import type { ChatAgentRunner } from '../../agents/contract';
import { copyDemonstration, copyReward, copyTarget } from '../copy/agent';

export const AgentRunner: ChatAgentRunner = {
  kind: 'chat',
  prompt(task, settings) {
    const target = copyTarget(task.seed, String(settings.letters ?? 'abcd'), Number(settings.length ?? 3));
    return { messages: [{ role: 'user', content: `copy ${target}>` }], label: target };
  },
  demonstration: (index, settings) => copyDemonstration(index, settings, true),
  async run(ctx) {
    // No client retries: the router already moves a request to another engine when one fails.
    const client = new OpenAI({ baseURL: ctx.openaiBaseURL, apiKey: ctx.apiKey, maxRetries: 0 });
    const reply = await client.chat.completions.create({
      model: ctx.model, messages: ctx.messages as OpenAI.ChatCompletionMessageParam[],
    });
    const answer = reply.choices[0].message.content ?? '';
    return { reward: copyReward(answer, String(ctx.label)), info: { answer } };
  },
};
