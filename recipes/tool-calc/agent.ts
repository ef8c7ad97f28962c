// A multi-turn tool agent (ChatAgent form): the policy solves an arithmetic word problem with a
// calculator tool, through the stock `openai` client pointed at the loopback server. A turn may
// call the tool several times; the episode ends on a reply without a tool call (the final answer)
// or at env.max_turns. Reward: 1 if the final answer's \boxed{} holds the right number, 0 if it
// holds another, -env.format_penalty if there is no boxed number (or no final answer at all).
// The same agent in Python: recipes/tool-calc-py.
import OpenAI from 'openai';
import type { ChatContext } from '../../agents/chat-runner';
import type { ChatMessage, ToolSpec } from '../../agents/chat-template';
import type { ChatAgentRunner } from '../../agents/contract';
import {
  boxedAnswer, calculate, demonstrationProblem, Fraction, groupProblem, problemSettings, ToolInputError, type Problem,
} from '../math/problems';

export const CALCULATOR: ToolSpec = {
  type: 'function',
  function: {
    name: 'calculator',
    description: 'Evaluate + - * / with parentheses exactly',
    parameters: { type: 'object', properties: { expression: { type: 'string' } }, required: ['expression'] },
  },
};

const userMessage = (p: Problem): ChatMessage =>
  ({ role: 'user', content: `${p.text} Use the calculator. Put the final answer in \\boxed{}.` });

// What run() needs besides the conversation: the prompt's label carries it (run() sees no settings).
export interface Label { answer: string; max_turns: number; format_penalty: number }

function labelOf(settings: Record<string, unknown>, answer: Fraction): Label {
  const maxTurns = Number(settings.max_turns ?? 4);
  const penalty = Number(settings.format_penalty ?? 0.1);
  if (!Number.isInteger(maxTurns) || maxTurns < 1) throw new Error(`env.max_turns must be an integer >= 1, got ${settings.max_turns}`);
  if (!(penalty >= 0)) throw new Error(`env.format_penalty must be a number >= 0, got ${settings.format_penalty}`);
  return { answer: answer.toString(), max_turns: maxTurns, format_penalty: penalty };
}

// The tool's reply to one call. What the model got wrong (unknown tool, arguments that are not
// JSON, a bad expression) comes back as an error message it can read; any other error is a bug in
// the recipe and fails the episode.
export function toolReply(name: string, args: string): string {
  if (name !== CALCULATOR.function.name) return `error: unknown tool ${JSON.stringify(name)}; the only tool is calculator`;
  let parsed: { expression?: unknown };
  try {
    parsed = JSON.parse(args);
  } catch {
    return `error: the arguments are not JSON: ${args.slice(0, 100)}`;
  }
  if (typeof parsed?.expression !== 'string') return 'error: the arguments must be {"expression": "<arithmetic>"}';
  try {
    return calculate(parsed.expression).toString();
  } catch (e) {
    if (e instanceof ToolInputError) return `error: ${e.message}`;
    throw e;
  }
}

// The reward of a final answer (null: the episode hit the turn limit without one).
export function score(final: string | null, label: Label): number {
  const got = final === null ? null : boxedAnswer(final);
  if (got === null) return -label.format_penalty;
  return got.toString() === label.answer ? 1 : 0;
}

// The agent loop, separate from run() so tests can drive it with any client.
export async function solve(client: OpenAI, ctx: Pick<ChatContext, 'model' | 'messages' | 'tools'>, label: Label) {
  const messages = [...ctx.messages] as OpenAI.ChatCompletionMessageParam[];
  const tools = ctx.tools as OpenAI.ChatCompletionTool[];
  let final: string | null = null;
  let [turns, toolCalls, toolErrors] = [0, 0, 0];
  while (final === null && turns < label.max_turns) {
    turns++;
    const reply = await client.chat.completions.create({ model: ctx.model, messages, tools });
    const message = reply.choices[0].message;
    messages.push(message as OpenAI.ChatCompletionMessageParam);
    const content = message.content ?? '';
    if (message.tool_calls?.length) {
      for (const call of message.tool_calls) {
        const result = call.type === 'function' ? toolReply(call.function.name, call.function.arguments)
          : `error: only function tools are served, got ${call.type}`;
        toolCalls++;
        if (result.startsWith('error:')) toolErrors++;
        messages.push({ role: 'tool', tool_call_id: call.id, content: result });
      }
    } else if (content.includes('<tool_call>')) {
      // The loopback returns a call it cannot parse (bad JSON, cut off by max_tokens) as text: the
      // model hears about it as a tool error and may try again, like any agent harness would do.
      toolCalls++;
      toolErrors++;
      messages.push({ role: 'tool', tool_call_id: `malformed-${turns}`, content: 'error: malformed tool call (not JSON)' });
    } else {
      final = content;
    }
  }
  return { reward: score(final, label), info: { turns, tool_calls: toolCalls, tool_errors: toolErrors, final }, messages };
}

// A correct episode for supervised warm-up: the problem, one calculator call per step (each
// turn's expression uses the result the tool gave before), the tool results, and the boxed answer.
export function demonstration(index: number, settings: Record<string, unknown>): { messages: ChatMessage[]; tools: ToolSpec[] } {
  const p = demonstrationProblem(index, problemSettings(settings));
  const messages: ChatMessage[] = [userMessage(p)];
  p.steps.forEach((expression, i) => {
    const call = { id: `call_${i}`, type: 'function' as const, function: { name: 'calculator', arguments: { expression } } };
    messages.push({ role: 'assistant', content: '', tool_calls: [call] },
      { role: 'tool', tool_call_id: call.id, content: calculate(expression).toString() });
  });
  messages.push({ role: 'assistant', content: `The answer is \\boxed{${p.answer}}.` });
  return { messages, tools: [CALCULATOR] };
}

export const AgentRunner: ChatAgentRunner & { demonstration: typeof demonstration } = {
  kind: 'chat',
  prompt(task, settings) {
    const p = groupProblem(task, problemSettings(settings));
    return { messages: [userMessage(p)], tools: [CALCULATOR], label: labelOf(settings, p.answer) };
  },
  async run(ctx) {
    // No client retries: the router already moves a request to another engine when one fails.
    const client = new OpenAI({ baseURL: ctx.openaiBaseURL, apiKey: ctx.apiKey, maxRetries: 0 });
    const { reward, info } = await solve(client, ctx, ctx.label as Label);
    return { reward, info };
  },
  demonstration,
};
